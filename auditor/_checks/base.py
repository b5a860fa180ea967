"""What every check shares: the run's context, its step table read in parts, and how a finding is made.

Notation: per record S, n, b; c = b/S (or the probe's Σ∂b/∂ℓ / n); e = c·g/D; N = Σn over the step of one
term. A step is correct iff q = e·N = 1 for every record with n > 0.

A run's table is read in parts (`RunSteps`), a block of steps at a time: each check keeps what its finding
says (counts, sums, extremes, the first and the worst step, the step range) and never a column of every
step, so a run of any length costs the same few arrays."""

from __future__ import annotations

import itertools

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit.codes import DEFAULT_SEVERITY, TOKEN_MEAN_FIXES, Code, Severity
from tokaudit._checks.reach import Later
from tokaudit._recipes import advice, recipe_for
from tokaudit._engine import one_value
from tokaudit._normalization import BLOCK_STEPS, DENOMINATOR_FACTS, Denominator, Diagnoses, name_ranks
from tokaudit._report import Finding, StepRange
from tokaudit._schema import UNNAMED, Provenance
from tokaudit._sorting import SortedColumn, at_positions, middle, middle_positions


DENOMINATOR_WORDS = {d: facts.words for d, facts in DENOMINATOR_FACTS.items()}


@dataclass(frozen=True, slots=True)
class RunContext:
    """What the fixes and messages of one run (and one loss term) need to name."""

    run: str
    term: str
    world_size: int
    world_sizes: tuple[int, ...]
    microbatches: int
    divisor: float
    rtol: float
    provenance: Provenance = Provenance()
    """How the run was recorded, as its shards say: the trainer whose own settings are named, a pipeline
    schedule's division, the launch's world size."""

    @property
    def trainer(self) -> str | None:
        return self.provenance.trainer


Extremes = Callable[[Any], Any]
"""Given a row of the step table without the evidence columns (`engine.EVIDENCE`), a row with them."""


@dataclass(frozen=True)
class RunSteps:
    """One run's step table, read a part at a time: `parts()` gives the run's rows part by part, each part
    a range of steps (every group and term of them) in step order within each (group, term), the parts in
    step order. The whole table in memory is one part (`of`); the engine's ranges kept on disk are many."""

    parts: Callable[[], Iterable[pd.DataFrame]]
    groups: list[str]
    """The run's groups, in the order of the whole table (sorted as text)."""
    terms: list[str]
    """The run's loss terms, the main term (UNNAMED) first (`loss_terms`)."""
    stand_ins: Mapping[str, str] = field(default_factory=dict)
    """Per group that holds no record of the main term, the term that stands for it there (`stand_ins`)."""
    tied: tuple[str, ...] = ()
    """The terms the counts cannot tell from the main term (`tied_terms`)."""

    def step_range(self) -> StepRange:
        """Every step of the run: a finding about the run as a whole covers them."""
        steps = StepsSeen(True)
        for block in self.blocks():
            steps.add(column_of(block, "step"))
        return steps.range()

    def frames(self, term: str | None = None) -> Iterator[pd.DataFrame]:
        """The rows of one term (every term when None), in the whole table's order: group by group, each
        group's steps in order."""
        for group in self.groups:
            for part in self.parts():
                rows = _selected(part, group if len(self.groups) > 1 else None, term if len(self.terms) > 1 else None)
                if len(rows):
                    yield rows

    def blocks(self, term: str | None = None) -> Iterator[pd.DataFrame]:
        """`frames` BLOCK_STEPS rows at a time: what a block's temporaries cost stays a few MB."""
        for frame in self.frames(term):
            for start in range(0, len(frame), BLOCK_STEPS):
                yield frame.iloc[start : start + BLOCK_STEPS]


def _selected(part: pd.DataFrame, group: str | None, term: str | None) -> pd.DataFrame:
    """The rows of one group and one term (None: any) of a part, in its order: the part itself when it
    holds no other."""
    keep = None
    for column, name in (("grp", group), ("term", term)):
        if name is None:
            continue
        # by each distinct name, not every row as text: a run of many groups has millions of rows
        mine = name_ranks(part[column], [name]) == 0
        if mine.all():
            continue
        keep = mine if keep is None else keep & mine
    return part if keep is None else part[keep].reset_index(drop=True)


BF16_ROUNDING = 2.0**-7
"""How far a weight computed in bfloat16 may be from the token mean's: b, S and each token's ∂b/∂ℓ keep 8
significant bits, each rounded by at most 2⁻⁹, c = b/S by up to 2⁻⁸; twice that, to spare a margin."""

BF16_HINT = (
    " Every weight here is within 2⁻⁷ (0.78%) of the token mean's, which is how far computing the loss in "
    "bfloat16 (on bf16 logits, not under autocast) rounds it: if it was, audit with --rtol 1e-2."
)


class StepsSeen:
    """The steps of one finding, added in the table's order: their range and how many there are, each
    step once. Steps of one group come in order, each once: counted without a set of millions of them;
    with several groups (a step number repeats across them) they are kept to be counted."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.kept: list[npt.NDArray[np.int64]] = []
        self.count = 0
        self.low: int | None = None
        self.high: int | None = None
        self.last: int | None = None
        self.increasing = True

    def add(self, steps: Any) -> None:
        numbers = np.asarray(steps, dtype=np.int64)
        if not len(numbers):
            return
        self.increasing = (
            self.increasing
            and (self.last is None or int(numbers[0]) > self.last)
            and bool((numbers[1:] > numbers[:-1]).all())
        )
        self.last = int(numbers[-1])
        low, high = int(numbers.min()), int(numbers.max())
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)
        self.count += len(numbers)
        if self.keep:
            self.kept.append(numbers)

    def __bool__(self) -> bool:
        return self.count > 0

    def range(self) -> StepRange:
        assert self.low is not None and self.high is not None
        count = self.count if self.increasing else len(np.unique(np.concatenate(self.kept)))
        return StepRange(first=self.low, last=self.high, count=count)


class ListedSteps:
    """The first eight steps of a list in order, and how many there are (`step_list`)."""

    def __init__(self) -> None:
        self.first: list[int] = []
        self.count = 0

    def add(self, values: Any) -> None:
        values = np.asarray(values)
        if len(self.first) < 8:
            self.first.extend(int(v) for v in values[: 8 - len(self.first)])
        self.count += len(values)

    def text(self) -> str:
        return ", ".join(map(str, self.first)) + (f", … ({self.count} in all)" if self.count > 8 else "")


PARTIAL_UPDATE_FACTORS = frozenset({Code.SCALE_MISMATCH, Code.WORLD_SIZE_MISMATCH})
"""Uniform factors that an update judged on part of its records makes (its ends guessed from the backwards, copies
of its keys dropped): each record weighs N_part/N of what the whole update's N gives it."""


def cannot_tell(
    findings: list[Finding], codes: Iterable[Code], why: str, where: Callable[[Finding], bool] | None = None
) -> list[Finding]:
    """The findings of these codes (and those `where` says) as warnings that say the logs cannot tell, `why` added to
    each message (what may explain them instead); the others as they are."""
    said = frozenset(codes)
    return [
        replace(f, severity=Severity.WARNING, undecidable=True, message=f"{f.message} {why}")
        if f.code in said or (where is not None and where(f))
        else f
        for f in findings
    ]


def run_finding(run: str, code: Code, source: RunSteps, message: str, fix: str, evidence: dict[str, Any]) -> Finding:
    """A finding about the run as a whole, over every step of it, at its code's severity."""
    return Finding(
        run=run,
        code=code,
        severity=DEFAULT_SEVERITY[code],
        steps=source.step_range(),
        message=message,
        fix=fix,
        evidence=evidence,
    )


def make_finding(
    context: RunContext,
    code: Code,
    steps: StepsSeen,
    message: str,
    fix: str,
    evidence: dict[str, Any],
    severity: Severity | None = None,
    undecidable: bool | None = None,
) -> Finding:
    if context.term != UNNAMED:
        message = f"[term {context.term}] {message}"
    return Finding(
        run=context.run,
        code=code,
        severity=severity or DEFAULT_SEVERITY[code],
        steps=steps.range(),
        message=message,
        fix=fix,
        evidence=evidence,
        term=context.term,
        fix_code=recipe_for(context.trainer) if code in TOKEN_MEAN_FIXES else "",
        undecidable=undecidable,
    )


def average_fix(context: RunContext, row: Any = None) -> str:
    """The token mean's fix, in the run's W and microbatches; in a step `row`'s where its W is not the run's (steps
    after an elastic resize: the fix is for them), with its microbatches where it has several. Never a step's one
    microbatch where the run has more: a fix said for it would read as N counted per microbatch on the others."""
    if row is not None and int(row.world_high) != context.world_size:
        shown = int(row.microbatches_high)
        context = replace(
            context, world_size=int(row.world_high), microbatches=shown if shown > 1 else context.microbatches
        )
    w, m = context.world_size, context.microbatches
    over = f"all {m} microbatches of the step on all {w} ranks" if m > 1 else f"all {w} ranks"
    if context.divisor == 1:
        return (
            f"backpropagate S_r/N (the reduction sums, D=1) with N the valid tokens of {over}, "
            "counted before the first backward with one all-reduce" + trainer_fix(context, ', reduction="sum"')
        )
    return (
        f"backpropagate W·S_r/N with W={w} (the size of the averaging group) and N summed over {over}, "
        "counted before the first backward with one all-reduce" + trainer_fix(context)
    )


def trainer_fix(context: RunContext, reduction: str = "") -> str:
    """The token mean in the recording trainer's own settings where they give it, else with the helpers
    tokaudit.hooks ships (a line to paste)."""
    own = advice(context.trainer, "token_mean_settings")
    if own:
        return f"; {own}"
    return (
        f"; with tokaudit.hooks: N = global_valid_tokens(labels_of_each_microbatch) before the first "
        f"backward, then backward on token_mean_loss(loss_sum, N{reduction})"
    )


def column_of(block: pd.DataFrame, name: str) -> npt.NDArray[Any]:
    values: npt.NDArray[Any] = block[name].to_numpy()
    return values


def rank_masks(block: pd.DataFrame) -> npt.NDArray[np.uint64]:
    """The step table's rank masks (bit r: rank r recorded the step) as unsigned integers, a NULL none."""
    masks = column_of(block, "rank_mask")
    found: npt.NDArray[np.uint64] = masks if masks.dtype.kind == "u" else np.nan_to_num(masks).astype(np.uint64)
    return found


def nan_sum(values: npt.NDArray[Any]) -> float:
    """A column's sum with NaN left out, as pandas sums."""
    return float(np.nansum(values)) if values.dtype.kind == "f" else float(values.sum())


def mixed_sync(synced: npt.NDArray[Any], records: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """Steps whose records (`records` a step, `synced` of them synchronized, NaN: not said) hold both some that
    synchronized and some that did not: an accumulation's (no_sync() before the last microbatch), or ranks that
    disagree."""
    synced = np.nan_to_num(synced.astype(float, copy=False))
    return (synced > 0) & (synced < records)


def accumulating(synced: npt.NDArray[Any], records: npt.NDArray[Any], ranks: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """`mixed_sync` steps where a rank holds several records (more records than `ranks`): an accumulation's pattern,
    not only ranks of one record each that disagree."""
    return mixed_sync(synced, records) & (records > ranks)


@dataclass(frozen=True)
class TermInputs:
    """What every check of one loss term is made from (`checks.run.CHECKS`)."""

    context: RunContext
    keep_steps: bool
    """A step number repeats across groups: steps are counted as a set."""
    main_term: bool
    """The run's first term (its structure is checked there, and in a group without it by the term that stands for
    it: `RunSteps.stand_ins`)."""
    coefficient: bool = False
    """Its uniform factors may be a coefficient λ chosen for it (`checks.run._coefficient`): the run has several
    loss terms, not all off by one constant; this one declares no λ; each of its factors holds over one span."""
    factors: Any = None
    """The uniform factors' clusters (`weighting.FactorTable`) where the term's weighting is judged alone."""
    extremes: Extremes | None = None
    confused: Denominator | None = None
    """The local denominator the counts cannot tell from the token mean (`Decisions.confused`)."""
    later: Later = Later()
    """The run's last step with valid tokens and its last with finite losses, over every term."""
    main_ranks: Any = None
    """Where the run has several terms: the main term's steps (`ranks.MainSteps`), which another term's missing_rank
    reads."""
    other_syncs: Any = None
    """Where the run has several terms: the main term's unsynchronized steps another term synchronized
    (`sync.OtherTermSyncs`), which missing_sync reads."""
    stand_in: bool = False
    """Not the main term, it stands for it in groups that hold none of it (`RunSteps.stand_ins`): their logs may hold
    no record of an update's last microbatch (an auxiliary loss of some microbatches), so whether it synchronized
    and how many microbatches a rank ran the records cannot tell."""


class Check:
    """One check of one loss term: made from its `TermInputs`, fed the term's table a block at a time with each
    step's diagnosis (`add`; None where the term's weighting is not judged alone), then asked for its findings.
    `main_term_only`: made for the run's first term (and a term standing for it in some groups) only;
    `judges_weighting`: made only where the term's weighting is judged alone (its diagnoses are never None)."""

    main_term_only = False
    judges_weighting = False

    def __init__(self, term: TermInputs) -> None:
        self.context = term.context
        self.keep_steps = term.keep_steps

    def steps(self) -> StepsSeen:
        return StepsSeen(self.keep_steps)

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        raise NotImplementedError

    def findings(self) -> Iterator[Finding]:
        raise NotImplementedError


def weight_ratio(low: Any, high: Any) -> Any:
    """The heaviest token's weight over the lightest's (a step's `token_weight_high` / `token_weight_low`: the
    probe's extremes where recorded, else the records' mean weights; ∞ where the lightest is 0 or below): the one
    ratio the summary's "max ratio", the weighting findings' `weight_ratio` and --min-ratio read."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(low > 0, high / np.where(low > 0, low, 1.0), np.inf)


class FlaggedSteps:
    """Steps where a condition holds: their range, how many rows, and the first such row."""

    def __init__(self, keep: bool) -> None:
        self.steps = StepsSeen(keep)
        self.rows = 0
        self.first: Any = None

    def add(self, block: pd.DataFrame, mask: npt.NDArray[np.bool_]) -> None:
        if not mask.any():
            return
        if self.first is None:
            self.first = block.iloc[int(np.argmax(mask))]
        self.steps.add(column_of(block, "step")[mask])
        self.rows += int(mask.sum())

    def __bool__(self) -> bool:
        return self.rows > 0


def differ_rows(block: pd.DataFrame, low: str, high: str) -> npt.NDArray[np.bool_]:
    """Where two columns differ (NaN differs from everything, as pandas compares); two columns held as one
    value each compare as those values."""
    one, other = column_of(block, low), column_of(block, high)
    if one_value(one) and one_value(other):
        return np.full(len(one), bool(one[0] != other[0]))
    differ: npt.NDArray[np.bool_] = one != other
    return differ


def world_sizes(steps: pd.DataFrame) -> list[int]:
    """Every W the steps saw, sorted: each column's distinct values (one value: that value), not a sort of
    both columns joined (200 MB at 12.5M steps)."""
    return sorted({int(w) for column in (steps.world_low, steps.world_high) for w in distinct(column)})


def distinct(column: pd.Series) -> npt.NDArray[Any]:
    """The distinct values of a column, sorted: its one value when it is held as one (`engine.tables.constant_of`)."""
    values = column.to_numpy()
    return np.unique(values[:1] if one_value(values) else values)


def grouped_rows(block: pd.DataFrame, rows: npt.NDArray[np.bool_]) -> Iterator[tuple[str, npt.NDArray[np.bool_]]]:
    """(name, mask) per group of a block (`grouped`): these `rows` of the group's."""
    for group, within in grouped(block.grp):
        mask = np.zeros(len(block), dtype=bool)
        mask[within] = True
        yield group, mask & rows


def grouped(column: pd.Series) -> Iterator[tuple[str, Any]]:
    """(name, rows) per group, in a group-by's order (the names sorted): rows a slice of every row when
    there is one group, else the group's indices."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes, names = column.cat.codes.to_numpy(), [str(name) for name in column.cat.categories]
    else:
        codes, uniques = pd.factorize(column, sort=True)
        names = [str(name) for name in uniques]
    present = [int(code) for code in np.unique(codes) if code >= 0]
    if len(present) == 1:
        yield names[present[0]], slice(None)
        return
    for code in sorted(present, key=lambda c: names[c]):
        yield names[code], np.flatnonzero(codes == code)


def median_of(column: SortedColumn) -> float:
    """The median of a column, NaN left out (NaN when none is a number), as pandas takes it."""
    if not column.count:
        return math.nan
    if not column.spilled:
        return float(pd.Series(column.in_order()[0]).median())
    return middle(at_positions(column, middle_positions(0, column.count)))


def step_list(values: Any) -> str:
    """The first 8 values, and how many there are in all past 8 (of a list, an array or a range: only 8 are read)."""
    shown = [str(int(v)) for v in itertools.islice(values, 8)]
    return ", ".join(shown) + (f", … ({len(values)} in all)" if len(values) > 8 else "")
