"""Checks over the per-step table: each problem becomes one finding with its numbers and its fix.

Pure functions of the step table (one row per run, group, term and step): no Parquet, no DuckDB.
Notation (SPEC §1): per record S, n, b; c = b/S (or the probe's Σ∂b/∂ℓ / n); e = c·g/D;
N = Σn over the step of one term. A step is correct iff q = e·N = 1 for every record with n > 0.
How the normalization is recovered lives in `tokaudit.normalization`.

A run's table is read in parts (`RunSteps`: the whole table, or the step ranges the engine aggregated,
kept on disk), in the order of the whole table, a block of steps at a time: each check keeps what its
finding says (counts, sums, extremes, the first and the worst step, the step range) and never a column
of every step, so a run of any length costs the same few arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit.codes import DEFAULT_SEVERITY, Code, Severity
from tokaudit.engine import one_value
from tokaudit.normalization import (
    BLOCK_STEPS,
    DENOMINATORS,
    FORMULA,
    Decisions,
    Denominator,
    Diagnoses,
    FactorExplanation,
    FactorKind,
    Span,
    StepKind,
    _Block,
    ClusterStarts,
    _candidates,
    cluster,
    explain_factor,
    name_ranks,
    Spans,
    span_rows,
)
from tokaudit.report import Finding, StepRange
from tokaudit.sorting import SortedColumn, at_positions, middle, middle_positions
from tokaudit.schema import UNNAMED

DENOMINATOR_WORDS = {
    Denominator.N: "the step's global valid-token count N",
    Denominator.MICRO_GLOBAL: "each microbatch's own global count N_m",
    Denominator.RANK: "each rank's own valid-token count n_r",
    Denominator.MICRO_TIMES_M: "each microbatch's own mean (its own count n) divided by the number of microbatches M",
    Denominator.MICRO: "each microbatch's own count n",
    Denominator.POSITIONS: "the positions of each microbatch, padding and ignored labels included",
    Denominator.STEP_POSITIONS: "the positions of the whole step, padding and ignored labels included",
    Denominator.ONE: "nothing (a raw loss sum)",
    Denominator.UNDETERMINED: "undetermined: counts are equal everywhere, so local and global means coincide",
    Denominator.UNEXPLAINED: "no single denominator",
}

_NONUNIFORM_CODES = {
    Denominator.RANK: Code.LOCAL_MEAN, Denominator.MICRO_TIMES_M: Code.LOCAL_MEAN, Denominator.MICRO: Code.LOCAL_MEAN,
    Denominator.MICRO_GLOBAL: Code.PER_MICRO_DENOMINATOR, Denominator.POSITIONS: Code.PADDED_DENOMINATOR,
}

VARYING_CLUSTERS = 3
PLAUSIBLE_SHARE = 0.9
"""More distinct uniform factors than VARYING_CLUSTERS, most of them no plausible W or loss scale:
one factor that varies from step to step, whatever a few steps happen to land on."""

MAX_DECIMALS = 6
"""A reported loss rounded to at most this many decimals is compared within half its last digit."""


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


Extremes = Callable[[Any], Any]
"""Given a row of the step table without the evidence columns (`engine.EXTREME_COLUMNS`), a row with them."""


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

    @classmethod
    def of(cls, frame: pd.DataFrame) -> RunSteps:
        """One run's whole table, put in the table's order (group, term, step) if it is not."""
        groups, terms = sorted({str(g) for g in frame.grp.unique()}), loss_terms(frame)
        step = frame.step.to_numpy()
        if len(groups) > 1 or len(terms) > 1 or not bool((step[1:] > step[:-1]).all()):
            order = np.lexsort((step, name_ranks(frame.term, terms), name_ranks(frame.grp, groups)))
            if (order != np.arange(len(order))).any():
                frame = frame.iloc[order].reset_index(drop=True)
        return cls(lambda: [frame], groups, terms)

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
                yield frame.iloc[start:start + BLOCK_STEPS]


def _selected(part: pd.DataFrame, group: str | None, term: str | None) -> pd.DataFrame:
    """The rows of one group and one term (None: any) of a part, in its order: the part itself when it
    holds no other."""
    keep = None
    for column, name in (("grp", group), ("term", term)):
        if name is None:
            continue
        # by each distinct name, not every row as text (0.9 s of a 16-group run's 2 s of checks)
        mine = name_ranks(part[column], [name]) == 0
        if mine.all():
            continue
        keep = mine if keep is None else keep & mine
    return part if keep is None else part[keep].reset_index(drop=True)


def check_run(run: str, steps: pd.DataFrame | RunSteps, rtol: float,
              duplicates: tuple[int, int, int, int] | None = None,
              extremes: Extremes | None = None) -> tuple[list[Finding], list[Span], int]:
    """All checks for one run's steps (every group and term): its findings, its normalization spans
    (at most `MAX_SPANS` per group and term) and how many spans were left out.

    Each loss term is its own token mean (SPEC §1): recovery and weight checks run per term.
    `duplicates`: (records dropped, first step, last step, steps) when the reader found repeated keys.
    `extremes`: where the heaviest and lightest token of an evidence step were, when the table does not
    hold them (the audit aggregates them for the few steps a finding names).

    Each term's table is read three times: twice for the run's decisions (`Decisions.of`, the first also
    for W, D and M), once for every check; once more for the uniform factors' clusters (`_FactorTable`)
    where some step may be uniformly off, and twice for the reported losses where there are some.

    A whole table has the steps whose counts the probe contradicts left out here (`without_miscounted`, one
    count_mismatch finding); a RunSteps is taken as given, as the audit leaves them out before."""
    if isinstance(steps, RunSteps):
        source, miscounted = steps, None  # the audit leaves its miscounted steps out itself, for its summary too
    else:
        source, miscounted = without_miscounted(RunSteps.of(steps), rtol)
    findings: list[Finding] = []
    spans: list[Span] = []
    omitted = 0
    terms = source.terms
    # W over every term: read with the main term's first pass when it is the only one.
    sizes: set[int] | None = None if len(terms) == 1 else {w for block in source.blocks() for w in world_sizes(block)}
    reported = len(terms) > 1
    for term in terms:
        shape = _Shape()

        def observed(term: str = term) -> Iterator[_Block]:
            for block in source.blocks(term):
                shape.add(block)
                yield _candidates(block, rtol)

        def again(term: str = term) -> Iterator[_Block]:
            return (_candidates(block, rtol) for block in source.blocks(term))

        decisions = Decisions.of(observed(), again, rtol)
        if not shape.blocks:
            continue  # every step of the term was left out (count_mismatch)
        if sizes is None:
            sizes = shape.worlds
        reported = reported or shape.reported
        context = shape.context(run, term, tuple(sorted(sizes)), rtol)
        # q's clusters need every uniform q ≠ 1 first: read once more only where a step may have one.
        factors = _FactorTable.of(((block, decisions.diagnose(block)) for block in source.blocks(term)), context) \
            if decisions.may_be_off else _FactorTable(rtol, np.zeros(0), {}, [], False)
        keep_steps = len(source.groups) > 1  # a step number repeats across groups: counted as a set
        weighting = _Weighting(factors, context, extremes, keep_steps)
        checks: list[_Check] = [_Structure(context, keep_steps), _Sync(context, keep_steps)] if term == terms[0] else []
        checks += [_Values(context, keep_steps), _Probe(context, keep_steps), _MissingRanks(context, keep_steps),
                   _Divisor(context, keep_steps), _WeightPresence(context, keep_steps)]
        balanced = _Balanced(context, keep_steps, decisions.confused)
        term_spans = Spans()
        for block in source.blocks(term):
            diagnoses = decisions.diagnose(block)
            weighting.add(block, diagnoses)
            for check in checks:
                check.add(block)
            balanced.add(block, diagnoses)
            term_spans.add(span_rows(block, diagnoses, source.groups, 0))
        findings.extend(weighting.findings())
        for check in checks:
            findings.extend(check.findings())
        findings.extend(balanced.findings())
        listed, left_out = term_spans.listed(source.groups, [term])
        spans.extend(listed)
        omitted += left_out
    if reported:
        findings.extend(_reported_findings(source, run, rtol, terms[0]))
    if duplicates is not None:
        findings.append(_duplicates(duplicates, run))
    if miscounted:
        findings.append(miscounted.finding(run))
    return findings, spans, omitted


BF16_ROUNDING = 2.0 ** -7
"""How far a weight computed in bfloat16 may be from the token mean's: b, S and each token's ∂b/∂ℓ keep 8
significant bits, each rounded by at most 2⁻⁹, c = b/S by up to 2⁻⁸; twice that, to spare a margin."""
BF16_HINT = (" Every weight here is within 2⁻⁷ (0.78%) of the token mean's, which is how far computing the loss in "
             "bfloat16 (on bf16 logits, not under autocast) rounds it: if it was, audit with --rtol 1e-2.")


_PROBE_RANGE = frozenset({"probed", "e_low", "e_high", "tok_low", "tok_high"})


def miscounted_rows(rows: pd.DataFrame, rtol: float) -> npt.NDArray[np.bool_]:
    """Rows of the step table (one group, term and step each) where the probe contradicts a recorded count.
    A record's mean probed weight c = Σ∂b/∂ℓᵢ / n is the mean of its valid tokens' weights when n is the
    number of tokens the probe saw, so it lies between the lightest and the heaviest of them; the step's
    extremes of e = c·g/D then lie within those of the probe's (tok_low ≤ e_low, e_high ≤ tok_high, as no
    record's c leaves its own range). A step outside them by more than rtol holds a record whose n is not
    the probe's count. Where no record has the probe's extremes, tok_* are e_* and nothing is found."""
    if not _PROBE_RANGE.issubset(rows.columns):
        return np.zeros(len(rows), dtype=bool)  # a table made without the probe's columns
    probed: npt.NDArray[np.bool_] = rows.probed.to_numpy(dtype=float) > 0
    if not probed.any():
        return probed
    e_low, e_high = rows.e_low.to_numpy(dtype=float), rows.e_high.to_numpy(dtype=float)
    low, high = rows.tok_low.to_numpy(dtype=float), rows.tok_high.to_numpy(dtype=float)
    return probed & outside_probe_range(e_low, e_high, low, high, rtol)


def outside_probe_range(low: npt.NDArray[np.float64], high: npt.NDArray[np.float64],
                        lightest: npt.NDArray[np.float64], heaviest: npt.NDArray[np.float64],
                        rtol: float) -> npt.NDArray[np.bool_]:
    """Where mean weights (their lowest and highest) leave the probe's lightest and heaviest token by more than
    rtol of the larger: a count that is not the probe's (`miscounted_rows`); NaN anywhere is never outside."""
    slack = rtol * np.fmax(np.abs(lightest), np.abs(heaviest))
    with np.errstate(invalid="ignore"):
        outside: npt.NDArray[np.bool_] = (low < lightest - slack) | (high > heaviest + slack)
    return outside


@dataclass
class Miscounted:
    """The steps `without_miscounted` leaves out, read from the last whole pass over the run's parts."""

    parts: Callable[[], Iterable[pd.DataFrame]]
    steps: _Steps
    first: pd.Series | None = None
    """The finding's evidence: a row of the lowest step found."""
    complete: bool = False

    def __bool__(self) -> bool:
        if not self.complete:
            for _ in self.parts():
                pass
        return self.first is not None

    def finding(self, run: str) -> Finding:
        row = self.first
        assert row is not None
        tokens = float(row.tokens)
        low, high = float(row.tok_low) * tokens, float(row.tok_high) * tokens
        above = float(row.e_high) * tokens > high
        mean = float(row.e_high if above else row.e_low) * tokens
        grp = f" (group {row.grp})" if str(row.grp) != UNNAMED else ""
        measured = (f"the same weight, {low:.4g}/N, on every valid token" if f"{low:.4g}" == f"{high:.4g}"
                    else f"every valid token's weight between {low:.4g}/N and {high:.4g}/N")
        steps = self.steps.range()
        context = RunContext(run=run, term=str(row.term), world_size=0, world_sizes=(), microbatches=0, divisor=0.0,
                             rtol=0.0)
        return _finding(
            context, Code.COUNT_MISMATCH, self.steps,
            f"At step {int(row.step)}{grp} the probe measured {measured}, yet a record's probed weight sum divided "
            "by its recorded valid_tokens gives "
            f"{mean:.4g}/N, {'above' if above else 'below'} that range: valid_tokens is not the number of tokens "
            "the probe saw (a count of another mask, such as attention_mask.sum() where the loss ignores labels "
            "of -100, or padding counted). N and every weight derived from the counts would be wrong, so "
            f"{steps.count} step(s) are left out instead of being judged on them.",
            "record valid_tokens from the mask the loss and rec.probe use (labels != ignore_index), summed over "
            "the same microbatch",
            {"step": int(row.step), "probe_weight_range": [low, high], "mean_weight": mean, "global_tokens": int(tokens)})


def without_miscounted(source: RunSteps, rtol: float) -> tuple[RunSteps, Miscounted]:
    """The run's table without the steps whose counts the probe contradicts (`miscounted_rows`), every term of
    that group's step, as the steps that lost records are left out; and those steps, noted on each whole pass."""
    found = Miscounted(source.parts, _Steps(len(source.groups) > 1))

    def parts() -> Iterator[pd.DataFrame]:
        noting = not found.complete
        steps, first = _Steps(found.steps.keep), None
        for part in source.parts():
            flagged = miscounted_rows(part, rtol)
            if flagged.any():
                step = part.step.to_numpy()
                # every term of a flagged (group, step): a step's terms are summed and compared together
                whole = pd.Series(flagged).groupby([part.grp.to_numpy(), step]).transform("any").to_numpy(dtype=bool)
                if noting:
                    if first is None:
                        # the lowest step, the first of its rows in the table's order (group, term): the parts
                        # hold ascending ranges of steps, so whole or in parts it is the same row
                        rows = np.flatnonzero(flagged)
                        first = part.iloc[int(rows[np.argmin(step[rows])])]
                    steps.add(np.unique(step[whole]))
                part = part[~whole].reset_index(drop=True)
            if len(part):
                yield part
        if noting:
            found.steps, found.first, found.complete = steps, first, True

    found.parts = parts
    return RunSteps(parts, source.groups, source.terms), found


class _Shape:
    """What a term's first pass notes besides the decisions: W and D's counts (their most frequent values,
    the smallest among equally frequent, as pandas' mode), the largest M, every W, and whether any step
    has a reported loss."""

    def __init__(self) -> None:
        self.worlds: set[int] = set()
        self.world_counts: dict[Any, int] = {}
        self.divisor_counts: dict[Any, int] = {}
        self.microbatches = -math.inf
        self.reported = False
        self.blocks = 0

    def add(self, block: pd.DataFrame) -> None:
        self.blocks += 1
        self.worlds.update(world_sizes(block))
        for counts, column in ((self.world_counts, block.w_high), (self.divisor_counts, block.d_high)):
            values = column.to_numpy()
            repeat = len(values) if one_value(values) else 1
            values = values[:1] if repeat > 1 else values
            found, times = np.unique(values[~pd.isna(values)], return_counts=True)
            for value, count in zip(found.tolist(), times.tolist()):
                counts[value] = counts.get(value, 0) + count * repeat
        self.microbatches = max(self.microbatches, float(block.m_high.max()))
        self.reported = self.reported or bool((_column(block, "reported") > 0).any())

    def context(self, run: str, term: str, sizes: tuple[int, ...], rtol: float) -> RunContext:
        def mode(counts: dict[Any, int]) -> Any:
            return min(counts, key=lambda value: (-counts[value], value)) if counts else math.nan

        return RunContext(run=run, term=term, world_size=int(mode(self.world_counts)), world_sizes=sizes,
                          microbatches=int(self.microbatches), divisor=float(mode(self.divisor_counts)), rtol=rtol)


class _Steps:
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
        self.increasing = self.increasing and (self.last is None or int(numbers[0]) > self.last) and bool(
            (numbers[1:] > numbers[:-1]).all())
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


class _Listed:
    """The first eight steps of a list in order, and how many there are (`_list`)."""

    def __init__(self) -> None:
        self.first: list[int] = []
        self.count = 0

    def add(self, values: Any) -> None:
        values = np.asarray(values)
        if len(self.first) < 8:
            self.first.extend(int(v) for v in values[:8 - len(self.first)])
        self.count += len(values)

    def text(self) -> str:
        return ", ".join(map(str, self.first)) + (f", … ({self.count} in all)" if self.count > 8 else "")


def _finding(context: RunContext, code: Code, steps: _Steps, message: str, fix: str,
             evidence: dict[str, Any], severity: Severity | None = None) -> Finding:
    if context.term != UNNAMED:
        message = f"[term {context.term}] {message}"
    return Finding(run=context.run, code=code, severity=severity or DEFAULT_SEVERITY[code], steps=steps.range(),
                   message=message, fix=fix, evidence=evidence, term=context.term)


def _fix_average(context: RunContext) -> str:
    w, m = context.world_size, context.microbatches
    over = f"all {m} microbatches of the step on all {w} ranks" if m > 1 else f"all {w} ranks"
    if context.divisor == 1:
        return (f"backpropagate S_r/N (the reduction sums, D=1) with N the valid tokens of {over}, "
                "counted before the first backward with one all-reduce")
    return (f"backpropagate W·S_r/N with W={w} (the size of the averaging group) and N summed over {over}, "
            "counted before the first backward with one all-reduce")


def _column(block: pd.DataFrame, name: str) -> npt.NDArray[Any]:
    values: npt.NDArray[Any] = block[name].to_numpy()
    return values


def _sum(values: npt.NDArray[Any]) -> float:
    """A column's sum with NaN left out, as pandas sums."""
    return float(np.nansum(values)) if values.dtype.kind == "f" else float(values.sum())


# ---------------------------------------------------------------------------------- weights


_CODES: tuple[Code, ...] = tuple(Code)


def _weighting_codes(diagnoses: Diagnoses, explanation: npt.NDArray[np.int32],
                     table: list[FactorExplanation]) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.int32]]:
    """Per step, the index in _CODES of its weighting finding (−1: none), and the explanation whose
    label tells kinds of factor apart (for world_size_mismatch and loss_scale; −1 otherwise).
    Narrow integers (2 and 4 bytes a step): at millions of steps every per-step array counts."""
    by_denominator = np.array([_CODES.index(_NONUNIFORM_CODES.get(d, Code.UNEXPLAINED_WEIGHTING))
                               for d in DENOMINATORS], dtype=np.int16)
    code = np.where(diagnoses.kind_is(StepKind.NONUNIFORM), by_denominator[diagnoses.denominator], np.int16(-1))
    kinds = {FactorKind.WORLD_SIZE: Code.WORLD_SIZE_MISMATCH, FactorKind.LOSS_SCALE: Code.LOSS_SCALE,
             FactorKind.OTHER: Code.SCALE_MISMATCH}
    by_explanation = np.array([_CODES.index(kinds[e.kind]) for e in table] + [_CODES.index(Code.SCALE_MISMATCH)],
                              dtype=np.int16)  # the last entry stands for "none"
    labelled = np.array([e.kind != FactorKind.OTHER for e in table] + [False])
    off = diagnoses.kind_is(StepKind.UNIFORM_OFF)
    padded = np.isin(diagnoses.denominator, [DENOMINATORS.index(Denominator.POSITIONS),
                                             DENOMINATORS.index(Denominator.STEP_POSITIONS)])
    raw = diagnoses.denominator == DENOMINATORS.index(Denominator.ONE)
    named = np.where(explanation >= 0, explanation, np.int32(len(table)))
    # Written in place, one condition at a time: no nested np.where of whole columns.
    code[off] = by_explanation[named[off]]
    code[off & raw] = _CODES.index(Code.SCALE_MISMATCH)
    code[off & padded] = _CODES.index(Code.PADDED_DENOMINATOR)
    label = np.where(off & ~padded & ~raw & labelled[named], named, np.int32(-1))
    return code, label


@dataclass
class _FactorTable:
    """Each uniform factor q ≠ 1 named, per cluster of equal q (and W): the clusters' smallest q, the
    explanation of each (cluster, W), and per step the index of its explanation (`ids`). A factor that
    differs from step to step (a count off by a few tokens per row: q = N/(N+4)) is one varying constant:
    its steps that land on 1/2 or 1/3 by chance are no world-size mistake."""

    rtol: float
    anchors: npt.NDArray[np.float64]
    pairs: dict[tuple[int, int], int]
    table: list[FactorExplanation]
    varying: bool
    """Every factor is the one varying constant (table holds it alone)."""

    @classmethod
    def of(cls, diagnosed: Iterable[tuple[pd.DataFrame, Diagnoses]], context: RunContext) -> _FactorTable:
        """From every step's q where the weights are uniform and off, read in the table's order, each with
        its W (held in memory up to `sorting.RUN_VALUES`, past that on disk in sorted runs)."""
        column = SortedColumn()
        try:
            for block, diagnoses in diagnosed:
                off = diagnoses.kind_is(StepKind.UNIFORM_OFF) & ~np.isnan(diagnoses.distortion)
                if off.any():
                    column.add(diagnoses.distortion[off], _column(block, "w_high")[off].astype(np.int64))
            if not column.count:
                return cls(context.rtol, np.zeros(0), {}, [], False)
            anchors, pairs, counts, centers = _pairs(column, context.rtol)
        finally:
            column.close()
        table = [explain_factor(center, w, context.world_sizes, context.rtol) for (_, w), center in zip(pairs, centers)]
        plausible = sum(count for count, e in zip(counts, table) if e.kind != FactorKind.OTHER)
        numbered = {pair: index for index, pair in enumerate(pairs)}
        if len(table) > VARYING_CLUSTERS and plausible < PLAUSIBLE_SHARE * column.count:
            return cls(context.rtol, anchors, numbered, [FactorExplanation(FactorKind.OTHER, "c")], True)
        return cls(context.rtol, anchors, numbered, table, False)

    def ids(self, block: pd.DataFrame, diagnoses: Diagnoses) -> npt.NDArray[np.int32]:
        """Per step of this block, the index of its explanation in `table` (−1: none)."""
        ids = np.full(len(diagnoses), -1, dtype=np.int32)
        off = np.flatnonzero(diagnoses.kind_is(StepKind.UNIFORM_OFF) & ~np.isnan(diagnoses.distortion))
        if not len(off) or not self.table:
            return ids
        if self.varying:
            ids[off] = 0
            return ids
        # every q lies in the cluster whose smallest q is the largest at or below it
        labels = np.searchsorted(self.anchors, diagnoses.distortion[off], side="right") - 1
        world = _column(block, "w_high")[off].astype(np.int64)
        found, inverse = np.unique(np.stack([labels, world], axis=1), axis=0, return_inverse=True)
        numbers = np.array([self.pairs[(int(label), int(w))] for label, w in found], dtype=np.int32)
        ids[off] = numbers[inverse.reshape(-1)]  # a lookup per distinct (cluster, W), not per step
        return ids


def _pairs(column: SortedColumn, rtol: float
           ) -> tuple[npt.NDArray[np.float64], list[tuple[int, int]], list[int], list[float]]:
    """The clusters of q (`cluster`) as their smallest q, and per (cluster, W) in that order (as np.unique
    orders them): its steps and its median q."""
    if not column.spilled:
        q, world = column.in_order()
        labels = cluster(q, rtol)
        found, inverse, counts = np.unique(np.stack([labels, world], axis=1), axis=0, return_inverse=True,
                                           return_counts=True)
        inverse = inverse.reshape(-1)
        order = np.argsort(q, kind="stable")
        anchors = q[order][np.flatnonzero(np.r_[True, np.diff(labels[order]) != 0])]
        centers = [float(np.median(q[inverse == index])) for index in range(len(found))]
        return anchors, [(int(label), int(w)) for label, w in found], [int(c) for c in counts], centers
    # On disk: one pass for the clusters and each (cluster, W)'s count, one for the medians, each the
    # middle of that pair's q in ascending order.
    chain = ClusterStarts(rtol)
    count: dict[tuple[int, int], int] = {}
    for values, worlds in column.chunks():
        for (label, w), n in zip(*_counted(chain.add(values), worlds)):
            count[(label, w)] = count.get((label, w), 0) + n
    pairs = sorted(count)
    wanted = {pair: middle_positions(0, count[pair]) for pair in pairs}
    seen = dict.fromkeys(pairs, 0)
    picked: dict[tuple[int, int], list[float]] = {pair: [] for pair in pairs}
    for values, worlds in column.chunks():
        labels = chain.of(values)
        for (label, w), _ in zip(*_counted(labels, worlds)):
            pair = (label, w)
            mine = values[(labels == label) & (worlds == w)]
            for position in wanted[pair]:
                if seen[pair] <= position < seen[pair] + len(mine):
                    picked[pair].append(float(mine[position - seen[pair]]))
            seen[pair] += len(mine)
    return np.array(chain.starts), pairs, [count[pair] for pair in pairs], [middle(picked[pair]) for pair in pairs]


def _counted(labels: npt.NDArray[Any], worlds: npt.NDArray[Any]) -> tuple[list[tuple[int, int]], list[int]]:
    """The distinct (label, W) of a chunk and how many of each."""
    found, counts = np.unique(np.stack([labels, worlds], axis=1), axis=0, return_counts=True)
    return [(int(label), int(w)) for label, w in found], [int(c) for c in counts]


class _Check:
    """One check, fed the table a block at a time (`add`), then asked for its findings."""

    def __init__(self, context: RunContext, keep_steps: bool) -> None:
        self.context = context
        self.keep_steps = keep_steps

    def steps(self) -> _Steps:
        return _Steps(self.keep_steps)

    def add(self, block: pd.DataFrame) -> None:
        raise NotImplementedError

    def findings(self) -> Iterator[Finding]:
        raise NotImplementedError


@dataclass
class _WeightingGroup:
    """The steps of one weighting finding (one code, denominator, kind of factor and fit)."""

    code: Code
    denominator: Denominator
    steps: _Steps
    worst: tuple[float, float] | None = None
    """(how unequally tokens were weighted, how far q is from 1) at the worst step so far."""
    row: Any = None
    diagnosis: Any = None
    explanation: int = -1
    factor_range: list[float] = field(default_factory=list)
    distortion_range: list[float] = field(default_factory=list)
    approximate: float = math.nan
    explanations: set[int] = field(default_factory=set)
    count: int = 0


def _extend(bounds: list[float], values: npt.NDArray[np.float64]) -> list[float]:
    """[lowest, highest] of the values seen so far, NaN left out (empty while none is a number)."""
    values = values[~np.isnan(values)]
    if not len(values):
        return bounds
    low, high = float(values.min()), float(values.max())
    return [min(bounds[0], low), max(bounds[1], high)] if bounds else [low, high]


class _Weighting:
    """local_mean, per_micro_denominator, padded_denominator, unexplained_weighting, world_size_mismatch,
    loss_scale, scale_mismatch: one finding per (code, denominator, kind of factor, approximate fit), in
    order of first appearance, however many steps it spans, with the range of its factor."""

    def __init__(self, factors: _FactorTable, context: RunContext, extremes: Extremes | None, keep_steps: bool) -> None:
        self.factors, self.context, self.extremes, self.keep_steps = factors, context, extremes, keep_steps
        names = [e.label for e in factors.table] + [""]
        self.label_numbers = np.array([names.index(name) for name in names], dtype=np.int64)
        self.names = len(names)
        self.groups: dict[int, _WeightingGroup] = {}

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses) -> None:
        explanation = self.factors.ids(block, diagnoses)
        code, label = _weighting_codes(diagnoses, explanation, self.factors.table)
        flagged = np.flatnonzero(code >= 0)
        if not len(flagged):
            return
        # The four as one integer key (labels of equal text are one label).
        key = ((code[flagged].astype(np.int64) * len(DENOMINATORS) + diagnoses.denominator[flagged]) * self.names
               + self.label_numbers[label[flagged]]) * 2 + np.isnan(diagnoses.approximate[flagged])
        keys, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        steps = _column(block, "step")
        ratio_all = _ratios(block)
        for index in np.argsort(first):
            value = int(keys[index])
            rows = flagged[inverse == index]
            group = self.groups.get(value)
            if group is None:
                group = self.groups[value] = _WeightingGroup(_CODES[int(code[rows[0]])],
                                                             DENOMINATORS[int(diagnoses.denominator[rows[0]])],
                                                             _Steps(self.keep_steps))
            group.steps.add(steps[rows])
            group.count += len(rows)
            group.factor_range = _extend(group.factor_range, diagnoses.factor[rows])
            group.distortion_range = _extend(group.distortion_range, diagnoses.distortion[rows])
            approximate = diagnoses.approximate[rows]
            if not np.isnan(approximate).all():
                here = float(np.nanmax(approximate))
                group.approximate = here if math.isnan(group.approximate) else max(group.approximate, here)
            group.explanations.update(int(i) for i in np.unique(explanation[rows]))
            # The evidence's step: where tokens were weighted most unequally, then where q is furthest
            # from 1, the last of equals (np.lexsort((far, unequal))[-1] over every member).
            ratio = ratio_all[rows]
            unequal = np.where(ratio > 1 + self.context.rtol, ratio, 1.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                far = np.nan_to_num(np.abs(np.log(np.abs(diagnoses.distortion[rows]))), nan=0.0)
            here_index = int(np.lexsort((far, unequal))[-1])
            candidate = (float(unequal[here_index]), float(far[here_index]))
            if group.worst is None or candidate >= group.worst:  # a later step wins ties
                row = int(rows[here_index])
                group.worst, group.row = candidate, block.iloc[row]
                group.diagnosis, group.explanation = diagnoses[row], int(explanation[row])

    def findings(self) -> Iterator[Finding]:
        for group in self.groups.values():
            yield _weighting_finding(group, self.factors.table, self.context, self.extremes)


def _ratios(steps: pd.DataFrame) -> np.ndarray:
    """Per step, the heaviest token's weight over the lightest's (∞ when the lightest is 0)."""
    low, high = steps.tok_low.to_numpy(dtype=float), steps.tok_high.to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(low > 0, high / low, np.inf)


def _range(values: list[float]) -> list[float]:
    return [float(min(values)), float(max(values))]


def _weighting_finding(group: _WeightingGroup, table: list[FactorExplanation], context: RunContext,
                       extremes: Extremes | None = None) -> Finding:
    code, denominator, row, diagnosis = group.code, group.denominator, group.row, group.diagnosis
    step, w, tokens = int(row.step), int(row.w_high), int(row.tokens)
    explanation = table[group.explanation] if group.explanation >= 0 else None
    factors = group.factor_range
    evidence: dict[str, Any] = {"step": step, "denominator": denominator.value, "factor": diagnosis.factor,
                                "world_size": w, "grad_divisor": float(row.d_high), "global_tokens": tokens}
    if factors:
        evidence["factor_range"] = _range(factors)
    grp = f" (group {row.grp})" if str(row.grp) != UNNAMED else ""
    if diagnosis.kind == StepKind.NONUNIFORM:
        heavy_e, light_e = float(row.e_high), float(row.e_low)
        ratio = heavy_e / light_e if light_e > 0 else math.inf
        if "heavy_rank" in row.index:
            located = row
        elif extremes is not None:
            located = extremes(row)
        else:
            raise ValueError("the step table lacks the evidence columns (heavy_rank, ...) and no way to find them")
        heavy = _describe(located, "heavy", heavy_e, tokens)
        light = _describe(located, "light", light_e, tokens)
        evidence.update({"heaviest": heavy, "lightest": light, "weight_ratio": ratio})
        where = (f"at step {step}{grp} a token on rank {heavy['rank']} (microbatch {heavy['micro']}, "
                 f"n={heavy['valid_tokens']}) received {ratio:.3g}× the weight of a token on rank {light['rank']} "
                 f"(microbatch {light['micro']}, n={light['valid_tokens']}); the correct weight is 1/N = 1/{tokens}, "
                 f"they got {heavy_e * tokens:.3g}/N and {light_e * tokens:.3g}/N")
        alpha = "?" if diagnosis.factor is None else f"{diagnosis.factor:.4g}"
        formula = f"b·g = {alpha}·{FORMULA.get(denominator, '?')}"
        near = ""
        if diagnosis.approximate is not None:
            off = group.approximate
            evidence.update({"approximate": True, "approximation_error": off})
            near = (f"The weights fit {DENOMINATOR_WORDS[denominator]} only approximately (α varies by up to "
                    f"{off:.2%}; a count that is off by a few tokens per sequence, such as one extra label per "
                    "row from unshifted labels, does this). ")
        if code == Code.LOCAL_MEAN and denominator == Denominator.MICRO_TIMES_M:
            message = (f"{near}Each microbatch's loss was its own mean over its n valid tokens, divided by the "
                       f"number of microbatches M={context.microbatches} (loss.mean() / gradient_accumulation_steps; "
                       f"{formula}), so microbatches count equally instead of tokens: {where}.")
        elif code == Code.LOCAL_MEAN:
            message = (f"{near}Each loss was divided by {DENOMINATOR_WORDS[denominator]} ({formula}), so ranks "
                       f"and microbatches count equally instead of tokens: {where}.")
        elif code == Code.PER_MICRO_DENOMINATOR:
            message = (f"{near}Each microbatch was divided by its own global count N_m instead of the step's N "
                       f"({formula}): {where}.")
        elif code == Code.PADDED_DENOMINATOR:
            message = (f"{near}The loss was divided by the positions T of each microbatch, padding and ignored "
                       f"labels included ({formula}): {where}.")
        elif diagnosis.approximate is not None:
            message = (f"Tokens of one step received different weights; the nearest denominator is "
                       f"{DENOMINATOR_WORDS[denominator]} ({formula}), off by up to "
                       f"{evidence['approximation_error']:.2%}: {where}.")
            # nearest to the token mean itself (b·g = D·S/N, q = 1), and within bf16's rounding of it
            if denominator == Denominator.N and evidence["approximation_error"] <= BF16_ROUNDING and \
                    diagnosis.factor is not None and abs(diagnosis.factor / float(row.d_high) - 1) <= BF16_ROUNDING:
                evidence["within_bfloat16_rounding"] = True
                message += BF16_HINT
        else:
            message = (f"Tokens of one step received different weights and no denominator (n, n_r, n·M, N_m, N, T, "
                       f"1) explains them: {where}.")
        return _finding(context, code, group.steps, message, _fix_average(context), evidence)

    q = diagnosis.distortion or 0.0
    distortions = group.distortion_range
    evidence.update({"distortion": q, "effective_weight": q / tokens, "distortion_range": _range(distortions)})
    spread = "" if len(set(np.round(distortions, 12))) <= 1 else \
        f"; over the {group.count} step(s) q ranges from {min(distortions):.4g} to {max(distortions):.4g}"
    scaled = (f"every valid token received {q:.4g}/N instead of 1/N (step {step}{grp}, N={tokens}, W={w}, "
              f"D={row.d_high:g}){spread}")
    if code == Code.PADDED_DENOMINATOR:
        evidence["positions"] = int(row.positions)
        message = (f"The loss was divided by all {int(row.positions)} positions of the step, padding and ignored "
                   f"labels included, instead of its {tokens} valid tokens: {scaled}.")
        return _finding(context, code, group.steps, message, _fix_average(context), evidence)
    if code == Code.LOSS_SCALE:
        assert explanation is not None
        exponents = sorted({j for i in group.explanations if i >= 0 and (j := table[i].integer) is not None})
        evidence["loss_scale_exponents"] = exponents
        shown = " to ".join(f"2^{j}" for j in ([exponents[0], exponents[-1]] if len(exponents) > 1 else exponents))
        message = (f"Weights are uniform but carry a power-of-two factor ({shown}) that W={w} does not explain: "
                   f"{scaled}. This is the loss scale of mixed precision (a GradScaler), which the log does not "
                   "record, so the gradient's true scale cannot be judged here.")
        fix = ("pass the scaler to the recorder, Recorder(..., scaler=scaler), so its scale is divided out of the "
               "weights (the Hugging Face and Lightning callbacks find the trainer's scaler themselves)")
        return _finding(context, code, group.steps, message, fix, evidence)
    if code == Code.WORLD_SIZE_MISMATCH:
        assert explanation is not None
        cause = _world_size_cause(explanation, q, w, float(row.d_high))
        evidence["integer_factor"] = {"1/W": f"1/{w}", "1/k": f"1/{explanation.integer}", "W'/W": f"{explanation.integer}/{w}",
                                      "k/W": f"{explanation.integer}/{w}"}.get(explanation.label, explanation.integer)
        if explanation.label == "W'/W":
            evidence["world_sizes"] = [explanation.integer, w]
            evidence["stale_world_size"] = explanation.integer
        message = f"Weights are uniform but off by a world-size factor: {scaled}; {cause}."
        return _finding(context, code, group.steps, message, _fix_average(context), evidence)
    if denominator == Denominator.ONE:
        message = (f"The loss sum was backpropagated without a token denominator (b·g = {diagnosis.factor:g}·S): "
                   f"{scaled}; the gradient's size grows with the number of valid tokens (under SGD so does the step; "
                   "under Adam(W) its balance against epsilon, weight decay and gradient clipping shifts).")
    else:
        aux = (" If this term is weighted on purpose (an auxiliary loss coefficient λ), this is that λ."
               if context.term != UNNAMED else "")
        what = "a constant" if not spread else "a factor that changes from step to step"
        message = f"Weights are uniform within each step but scaled by {what}: {scaled}.{aux}"
        if max(abs(d - 1) for d in distortions) <= BF16_ROUNDING:
            evidence["within_bfloat16_rounding"] = True
            message += BF16_HINT
    return _finding(context, code, group.steps, message, _fix_average(context), evidence)


def _world_size_cause(explanation: FactorExplanation, q: float, w: int, divisor: float) -> str:
    k = explanation.integer
    if explanation.label == "1/W":
        return (f"the W factor is missing: S/N went into a reduction that averages over W={w}" if divisor != 1
                else f"S/N was divided by W={w} once more")
    if explanation.label == "W":
        if divisor == 1:
            return f"W·S/N (W={w}) went into a summing reduction (D=1), which needs S/N"
    if explanation.label == "W'/W":
        return (f"the code still scales by W={k} while the averaging group now has W={w}: a stale W kept "
                "across an elastic resize or a resume on other hardware")
    if explanation.label == "1/k":
        return (f"the gradient is {k}× too small: N counted {k}× the tokens (ranks that replicate the batch, "
                f"such as tensor- or context-parallel ranks, counted in N), or a constant 1/{k} in the code")
    used = q * w
    return (f"the code scaled by {used:.4g} where the averaging group has W={w}: a hard-coded W, a stale "
            "constant, the global world size used on a data-parallel subgroup (DP×TP), or W applied twice")


def _describe(row: Any, which: str, weight: float, tokens: int) -> dict[str, Any]:
    return {"rank": int(getattr(row, f"{which}_rank")), "micro": int(getattr(row, f"{which}_micro")),
            "valid_tokens": int(getattr(row, f"{which}_n")), "rank_tokens": int(getattr(row, f"{which}_rank_tokens")),
            "effective_weight": weight, "distortion": weight * tokens}


# ---------------------------------------------------------------------------------- other checks


class _Flagged:
    """Steps where a condition holds: their range, how many rows, and the first such row."""

    def __init__(self, keep: bool) -> None:
        self.steps = _Steps(keep)
        self.rows = 0
        self.first: Any = None

    def add(self, block: pd.DataFrame, mask: npt.NDArray[np.bool_]) -> None:
        if not mask.any():
            return
        if self.first is None:
            self.first = block.iloc[int(np.argmax(mask))]
        self.steps.add(_column(block, "step")[mask])
        self.rows += int(mask.sum())

    def __bool__(self) -> bool:
        return self.rows > 0


def _unequal(block: pd.DataFrame, low: str, high: str) -> npt.NDArray[np.bool_]:
    """Where two columns differ (NaN differs from everything, as pandas compares); two columns held as one
    value each compare as those values."""
    one, other = _column(block, low), _column(block, high)
    if one_value(one) and one_value(other):
        return np.full(len(one), bool(one[0] != other[0]))
    differ: npt.NDArray[np.bool_] = one != other
    return differ


class _Structure(_Check):
    """world_size_inconsistent, world_size_changed, uneven_microbatches. W's changes are looked for group
    by group, in the groups' order: the sizes in order of appearance, and the steps where W is not the
    group's first."""

    def __init__(self, context: RunContext, keep_steps: bool) -> None:
        super().__init__(context, keep_steps)
        self.inconsistent = _Flagged(keep_steps)
        self.uneven = _Flagged(keep_steps)
        self.changes: dict[str, tuple[list[int], _Steps]] = {}

    def add(self, block: pd.DataFrame) -> None:
        self.inconsistent.add(block, _unequal(block, "w_low", "w_high"))
        self.uneven.add(block, _unequal(block, "m_low", "m_high"))
        world = _column(block, "w_high")
        for group, rows in _groups(block.grp):
            values = world[rows]
            if group not in self.changes:
                self.changes[group] = ([int(values[0])], self.steps())
            sizes, changed = self.changes[group]
            new = values[np.sort(np.unique(values, return_index=True)[1])]  # in order of appearance
            sizes.extend(int(w) for w in new if int(w) not in sizes)
            changed.add(_column(block, "step")[rows][values != sizes[0]])

    def findings(self) -> Iterator[Finding]:
        context = self.context
        if self.inconsistent:
            row = self.inconsistent.first
            yield _finding(context, Code.WORLD_SIZE_INCONSISTENT, self.inconsistent.steps,
                           f"Ranks disagree on W within one step (step {int(row.step)}: W from {int(row.w_low)} to "
                           f"{int(row.w_high)}).",
                           "derive W from the process group that averages the gradients "
                           "(dist.get_world_size(ddp_model.process_group)) on every rank",
                           {"step": int(row.step), "world_size_low": int(row.w_low), "world_size_high": int(row.w_high)})
        for group in sorted(self.changes):
            sizes, changed = self.changes[group]
            if len(sizes) > 1:
                yield _finding(context, Code.WORLD_SIZE_CHANGED, changed,
                               f"W changed between steps{'' if group == UNNAMED else f' in group {group}'}: "
                               f"{' → '.join(map(str, sizes))} (an elastic restart or a resume on other hardware).",
                               "nothing to fix if the restart was intended; check that N and W were recomputed after it",
                               {"world_sizes": sizes})
        if self.uneven:
            row = self.uneven.first
            yield _finding(context, Code.UNEVEN_MICROBATCHES, self.uneven.steps,
                           f"Ranks ran different numbers of microbatches in one step (step {int(row.step)}: from "
                           f"{int(row.m_low)} to {int(row.m_high)}); every backward that syncs must be matched on all "
                           "ranks, and N must count every microbatch.",
                           "give every rank the same number of microbatches per step (pad with empty ones that "
                           "still run backward with a zero contribution)",
                           {"step": int(row.step), "microbatches_low": int(row.m_low),
                            "microbatches_high": int(row.m_high)})


def world_sizes(steps: pd.DataFrame) -> list[int]:
    """Every W the steps saw, sorted: each column's distinct values (one value: that value), not a sort of
    both columns joined (200 MB at 12.5M steps)."""
    return sorted({int(w) for column in (steps.w_low, steps.w_high) for w in distinct(column)})


def distinct(column: pd.Series) -> npt.NDArray[Any]:
    """The distinct values of a column, sorted: its one value when it is held as one (`engine._constant`)."""
    values = column.to_numpy()
    return np.unique(values[:1] if one_value(values) else values)


def _groups(column: pd.Series) -> Iterator[tuple[str, Any]]:
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


class _Values(_Check):
    """nonfinite_values, zero_token_nonfinite, empty_update. Non-finite values of an update the
    trainer skipped (a GradScaler overflow) did not reach the weights: they are not errors."""

    def __init__(self, context: RunContext, keep_steps: bool) -> None:
        super().__init__(context, keep_steps)
        self.nonfinite, self.nonfinite_records = self.steps(), 0.0
        self.zero_bad, self.zero_records = self.steps(), 0.0
        self.empty, self.empty_listed, self.disagree_listed = self.steps(), _Listed(), _Listed()
        self.unmarked = self.empty_nonfinite = False

    def add(self, block: pd.DataFrame) -> None:
        step = _column(block, "step")
        skipped_true, skipped_false = _column(block, "skipped_true"), _column(block, "skipped_false")
        nonfinite_valid, nonfinite_zero = _column(block, "nonfinite_valid"), _column(block, "nonfinite_zero")
        nonfinite = (nonfinite_valid > 0) & ~(skipped_true > 0)
        self.nonfinite.add(step[nonfinite])
        self.nonfinite_records += _sum(nonfinite_valid[nonfinite])
        self.zero_bad.add(step[nonfinite_zero > 0])
        self.zero_records += _sum(nonfinite_zero)
        empty = _column(block, "tokens") == 0
        if empty.any():
            disagree = (skipped_true[empty] > 0) & (skipped_false[empty] > 0)
            self.empty_nonfinite = self.empty_nonfinite or bool((nonfinite_zero[empty] > 0).any())
            self.unmarked = self.unmarked or bool((skipped_true[empty] == 0).any())
            self.empty.add(step[empty])
            self.empty_listed.add(step[empty])
            self.disagree_listed.add(step[empty][disagree])

    def findings(self) -> Iterator[Finding]:
        context = self.context
        if self.nonfinite:
            records = int(self.nonfinite_records)
            yield _finding(context, Code.NONFINITE_VALUES, self.nonfinite,
                           f"NaN or infinity in S, b, g, D or the probe columns of {records} record(s) with valid tokens; "
                           "the reduced gradient of those steps is not finite, or its weight cannot be read.",
                           "find the first non-finite loss (torch.autograd.set_detect_anomaly) and guard the division; "
                           "record finite grad_scale and grad_divisor values",
                           {"records": records, "first_step": int(self.nonfinite.range().first)})
        if self.zero_bad:
            yield _finding(context, Code.ZERO_TOKEN_NONFINITE, self.zero_bad,
                           f"{int(self.zero_records)} record(s) with no valid token have a non-finite backward "
                           "scalar: the code divided by its own zero count (0/0), and DDP spreads the NaN to every rank.",
                           "divide by the global count N (clamped to at least 1), never by the local count; a rank "
                           "with no valid token backpropagates an exact zero that stays connected to the graph",
                           {"records": int(self.zero_records)})
        if self.empty:
            disagree = self.disagree_listed.count > 0
            severity = Severity.ERROR if self.empty_nonfinite or disagree else Severity.INFO
            details = []
            if disagree:
                details.append(f"ranks disagree on skipping it at step(s) {self.disagree_listed.text()}")
            if self.empty_nonfinite:
                details.append("some ranks backpropagated a non-finite value")
            if self.unmarked and not disagree:
                details.append("the log does not say the update was skipped; an optimizer step on zero gradients still "
                               "moves weights through momentum and weight decay")
            yield _finding(context, Code.EMPTY_UPDATE, self.empty,
                           f"No valid token anywhere in {self.empty_listed.count} step(s) (N = 0)"
                           + (": " + "; ".join(details) if details else ", and every rank skipped it together."),
                           "decide from the global N (known to every rank after one all-reduce): when N = 0, every rank "
                           "runs backward on a zero loss and skips optimizer.step() together",
                           {"steps": self.empty_listed.text()}, severity=severity)


class _Sync(_Check):
    """missing_sync, sync_every_micro."""

    def __init__(self, context: RunContext, keep_steps: bool) -> None:
        super().__init__(context, keep_steps)
        self.missing, self.unsynced = self.steps(), 0.0
        self.every, self.every_count, self.multi_count = self.steps(), 0, 0

    def add(self, block: pd.DataFrame) -> None:
        step, unsynced = _column(block, "step"), _column(block, "unsynced_ranks")
        self.missing.add(step[unsynced > 0])
        self.unsynced += _sum(unsynced)
        records = _column(block, "records")
        multi = (_column(block, "m_high") > 1) & (_column(block, "sync_known") == records)
        every = multi & (_column(block, "sync_true") == records)
        self.every.add(step[every])
        self.every_count += int(every.sum())
        self.multi_count += int(multi.sum())

    def findings(self) -> Iterator[Finding]:
        if self.missing:
            yield _finding(self.context, Code.MISSING_SYNC, self.missing,
                           f"The last microbatch of a step did not synchronize gradients on "
                           f"{int(self.unsynced)} rank-step(s): those ranks stepped on their local gradient.",
                           "run the last microbatch's forward and backward outside model.no_sync()",
                           {"rank_steps": int(self.unsynced)})
        if self.every_count and self.every_count == self.multi_count:
            yield _finding(self.context, Code.SYNC_EVERY_MICRO, self.every,
                           f"Every microbatch synchronized gradients in {self.every_count} multi-microbatch step(s): "
                           f"correct, but {self.context.microbatches}× the communication.",
                           "wrap all but the last microbatch in model.no_sync()", {"steps": self.every_count})


def decimals(values: np.ndarray) -> np.ndarray:
    """Per value, the fewest decimals (0..MAX_DECIMALS) it is rounded to, float32 storage allowed
    for; −1 when it has more."""
    out = np.full(len(values), -1)
    for k in range(MAX_DECIMALS, -1, -1):
        rounded = np.round(values, k)
        exact = np.abs(values - rounded) <= 1e-7 * np.maximum(np.abs(values), 1e-12)
        out = np.where(exact, k, out)
    return out


class _Rounding:
    """Half a unit of the last decimal a trainer rounded its logged losses to, read from all of them (a
    value with few decimals by chance says nothing alone); 0 when they are not rounded."""

    def __init__(self) -> None:
        self.most = -1
        self.unrounded = False
        self.seen = False

    def add(self, values: np.ndarray) -> None:
        if not len(values):
            return
        k = decimals(values)
        self.seen = True
        self.unrounded = self.unrounded or bool((k < 0).any())
        self.most = max(self.most, int(k.max()))

    def value(self) -> float:
        if not self.seen or self.unrounded:
            return 0.0
        return 0.5 * 10.0 ** (-self.most) * (1 + 1e-6)


def rounding_of(values: np.ndarray) -> float:
    """`_Rounding` of these values."""
    rounding = _Rounding()
    rounding.add(values)
    return rounding.value()


def _agrees(reported: np.ndarray, truth: np.ndarray, rtol: float, rounding: float) -> np.ndarray:
    """reported equals truth within rtol, or within half a unit of the decimal it was rounded to."""
    tolerance = np.maximum(rtol * np.abs(truth), rounding)
    agrees: np.ndarray = np.abs(reported - truth) <= tolerance
    return agrees


def _step_means(frame: pd.DataFrame, main_term: str) -> pd.DataFrame:
    """The main term's steps with valid tokens, in order: the step, its token mean ΣS/N (`mean`) and the sum of
    every term's token mean (`total`), each (group, step)'s own."""
    counted = frame[_column(frame, "tokens") > 0]
    means = counted[["grp", "term", "step"]].assign(mean=counted.loss / counted.tokens)
    total = means.groupby(["grp", "step"], observed=True)["mean"].transform("sum")
    rows = means[means.term.astype(str) == main_term]
    return pd.DataFrame({"step": rows.step.to_numpy(np.int64), "mean": rows["mean"].to_numpy(float),
                         "total": total[rows.index].to_numpy(float)}, index=rows.index)


def _step_at(frame: pd.DataFrame, step: int, main_term: str) -> tuple[float, float] | None:
    """(`mean`, `total`) of `_step_means` at one step of a part; None where it has no valid token there."""
    at = _step_means(frame[_column(frame, "step") == step], main_term)
    return (float(at["mean"].iloc[0]), float(at["total"].iloc[0])) if len(at) else None


def _reported_rows(source: RunSteps, main_term: str) -> Iterator[pd.DataFrame]:
    """The main term's steps with a reported loss and valid tokens, in the table's order, with the token
    mean of the main term (`mean`) and the sum of every term's token mean (`total`), each (group, step)'s own,
    and those of the step before and after it (`previous_mean`, `next_mean`, `previous_total`, `next_total`;
    NaN where that step has no valid token or is not in the log), across the table's parts."""
    frames = source.frames()
    current = next(frames, None)
    carried: tuple[Any, int, tuple[float, float] | None] | None = None  # (group, step, its means): a part's last
    while current is not None:
        following = next(frames, None)
        group, last = current.grp.iloc[0], int(_column(current, "step").max())
        if not bool((_column(current, "reported") > 0).any()):
            # nothing here to compare: only its last step is read, the next part's first step's neighbour
            carried, current = (group, last, _step_at(current, last, main_term)), following
            continue
        steps = _step_means(current, main_term)
        step, mean, total = steps.step.to_numpy(), steps["mean"].to_numpy(), steps["total"].to_numpy()
        # each step's neighbours: the rows beside it, where their steps are one apart; at the part's ends,
        # the last step of the part before and the first of the part after, of the same group
        previous, next_ = np.full((2, len(step)), np.nan), np.full((2, len(step)), np.nan)
        adjacent = step[1:] == step[:-1] + 1
        previous[:, 1:] = np.where(adjacent, np.stack([mean[:-1], total[:-1]]), np.nan)
        next_[:, :-1] = np.where(adjacent, np.stack([mean[1:], total[1:]]), np.nan)
        if len(step) and carried is not None and carried[0] == group and carried[1] == step[0] - 1 and carried[2]:
            previous[:, 0] = carried[2]
        if len(step) and following is not None and following.grp.iloc[0] == group:
            after = _step_at(following, int(step[-1]) + 1, main_term)
            if after is not None:
                next_[:, -1] = after
        carried = (group, last, (float(mean[-1]), float(total[-1])) if len(step) and step[-1] == last else None)
        known = current.loc[steps.index, ["grp", "term", "step", "loss", "tokens", "reported", "reported_low",
                                          "reported_high", "mean_of_local_means"]]
        rows = known.assign(mean=mean, total=total, previous_mean=previous[0], previous_total=previous[1],
                            next_mean=next_[0], next_total=next_[1])
        rows = rows[_column(rows, "reported") > 0]
        if len(rows):
            yield rows
        current = following


def _reported_findings(source: RunSteps, run: str, rtol: float, main_term: str) -> Iterator[Finding]:
    """reported_loss_mismatch: the logged loss against ΣS/N of the main term, or against the sum of
    the terms' token means when the trainer logs the whole objective. Read twice: how the losses were
    rounded is read from all of them first. reported_loss_shifted (information) instead, where every step
    that differs (two or more) carries the token mean of the step after it, or every one that of the step
    before, and none the mean of local means: the right losses, stamped one update off."""
    rounding_seen = _Rounding()
    for rows in _reported_rows(source, main_term):
        rounding_seen.add(np.concatenate([rows.reported_low.to_numpy(float), rows.reported_high.to_numpy(float)]))
    if not rounding_seen.seen:
        return
    rounding = rounding_seen.value()

    def agree(rows: pd.DataFrame, mean: str, total: str) -> np.ndarray:
        """Each row's reported loss (every record's) is its `mean` column's value, or its `total`'s."""
        low, high = rows.reported_low.to_numpy(float), rows.reported_high.to_numpy(float)
        truth, whole = rows[mean].to_numpy(float), rows[total].to_numpy(float)
        agrees: np.ndarray = (_agrees(low, truth, rtol, rounding) & _agrees(high, truth, rtol, rounding)) | \
            (_agrees(low, whole, rtol, rounding) & _agrees(high, whole, rtol, rounding))
        return agrees

    bad_steps, bad_count, first = _Steps(len(source.groups) > 1), 0, None
    all_local, any_local = True, False
    all_next, all_previous = True, True  # every step that differs carries its neighbour's token mean
    for rows in _reported_rows(source, main_term):
        fine = agree(rows, "mean", "total")
        if fine.all():
            continue
        bad = rows[~fine]
        all_next = all_next and bool(agree(bad, "next_mean", "next_total").all())
        all_previous = all_previous and bool(agree(bad, "previous_mean", "previous_total").all())
        local_of = bad.mean_of_local_means.to_numpy(float)
        local = _agrees(bad.reported_low.to_numpy(float), local_of, rtol, rounding) & \
            _agrees(bad.reported_high.to_numpy(float), local_of, rtol, rounding)
        all_local, any_local = all_local and bool(local.all()), any_local or bool(local.any())
        if first is None:
            first = bad.iloc[0]
        bad_steps.add(bad.step.to_numpy())
        bad_count += len(bad)
    if first is None:
        return
    true_value = float(first.loss / first.tokens)
    evidence = {"step": int(first.step), "reported": float(first.reported_high), "token_mean": true_value,
                "mean_of_local_means": float(first.mean_of_local_means), "rounding": rounding}
    context = RunContext(run=run, term=main_term, world_size=0, world_sizes=(), microbatches=0, divisor=0.0, rtol=rtol)
    if (all_next or all_previous) and not any_local and bad_count > 1:
        # reported[s] = ΣS/N of s + 1 (or s − 1) at every step that differs: a loss stamped on the update beside
        # its own, as report_loss() did by default when called before optimizer.step() closed the update
        neighbour = "next" if all_next else "previous"
        theirs = float(first.next_mean if all_next else first.previous_mean)
        evidence[f"token_mean_of_the_{neighbour}_step"] = theirs
        yield _finding(context, Code.REPORTED_LOSS_SHIFTED, bad_steps,
                       f"The reported loss is the token mean ΣS/N of the {neighbour} step, not its own, in all "
                       f"{bad_count} step(s) where it differs (step {int(first.step)}: reported "
                       f"{float(first.reported_high):.6g}, its own ΣS/N {true_value:.6g}, the {neighbour} step's "
                       f"{theirs:.6g}): the losses are right, recorded one update {'early' if all_next else 'late'}.",
                       "give the step the loss belongs to (rec.report_loss(value, step=...)), or report it "
                       "after optimizer.step() for the update just closed", evidence)
        return
    if all_local:
        what = "the mean of per-rank means, not the token mean"
    elif any_local:
        what = "partly the mean of per-rank means"
    else:
        what = f"{float(first.reported_high) / true_value:.4g}× the token mean" if true_value else "not the token mean"
    yield _finding(context, Code.REPORTED_LOSS_MISMATCH, bad_steps,
                   f"The reported loss differs from ΣS/N in {bad_count} step(s), beyond rounding; it is {what} (step "
                   f"{int(first.step)}: reported {float(first.reported_high):.6g}, ΣS/N = {true_value:.6g}, mean of "
                   f"local means {float(first.mean_of_local_means):.6g}).",
                   "report all_reduce(Σ S)/all_reduce(Σ n) over the step from detached sums and counts",
                   evidence)


class _Probe(_Check):
    """nonuniform_in_microbatch, masked_tokens_weighted."""

    def __init__(self, context: RunContext, keep_steps: bool) -> None:
        super().__init__(context, keep_steps)
        self.nonuniform, self.nonuniform_records = self.steps(), 0.0
        self.masked, self.masked_records = self.steps(), 0.0

    def add(self, block: pd.DataFrame) -> None:
        step = _column(block, "step")
        nonuniform, masked = _column(block, "probe_nonuniform"), _column(block, "masked_weighted")
        self.nonuniform.add(step[nonuniform > 0])
        self.nonuniform_records += _sum(nonuniform)
        self.masked.add(step[masked > 0])
        self.masked_records += _sum(masked)

    def findings(self) -> Iterator[Finding]:
        if self.nonuniform:
            yield _finding(self.context, Code.NONUNIFORM_IN_MICROBATCH, self.nonuniform,
                           f"Valid tokens of one microbatch got different weights in {int(self.nonuniform_records)} "
                           "record(s): a per-sequence or per-document mean, or a token weighting. Legitimate only when "
                           "chosen on purpose.",
                           "for the token-mean objective, sum per-token losses over the microbatch and divide once by N",
                           {"records": int(self.nonuniform_records)})
        if self.masked:
            yield _finding(self.context, Code.MASKED_TOKENS_WEIGHTED, self.masked,
                           f"Positions that are not valid and whose loss is not 0 (padding labelled as a real token, "
                           f"a mask applied after the loss) carry weight in {int(self.masked_records)} "
                           "record(s): their loss is trained.",
                           "label padding and ignored positions with ignore_index (their loss is then exactly 0), or "
                           "mask per-token losses before reducing; divide by the valid-token count",
                           {"records": int(self.masked_records)})


class _MissingRanks(_Check):
    """missing_rank: fewer ranks than W recorded a step that others recorded."""

    def __init__(self, context: RunContext, keep_steps: bool) -> None:
        super().__init__(context, keep_steps)
        self.missing = _Flagged(keep_steps)

    def add(self, block: pd.DataFrame) -> None:
        self.missing.add(block, _column(block, "ranks") < _column(block, "w_high"))

    def findings(self) -> Iterator[Finding]:
        if not self.missing:
            return
        first = self.missing.first
        w = int(first.w_high)
        mask = 0 if pd.isna(first.rank_mask) else int(first.rank_mask)
        absent = [r for r in range(min(w, 64)) if not mask >> r & 1]
        listed = f"ranks {_list(absent)}" if w <= 64 else f"{w - int(first.ranks)} ranks (of those below 64: {_list(absent)})"
        yield _finding(self.context, Code.MISSING_RANK, self.missing.steps,
                       f"{self.missing.rows} step(s) lack records from some ranks (step {int(first.step)}: {listed} "
                       f"of W={w} have none). A rank that skips backward or a collective desynchronizes DDP; if it only "
                       "skipped recording, its tokens are missing from N here.",
                       "every rank runs forward, backward and every collective each microbatch, with a zero loss when "
                       "it has no valid token",
                       {"step": int(first.step), "missing_ranks": absent, "world_size": w})


class _Divisor(_Check):
    """unknown_divisor: D could not be seen, so the weights' absolute scale is not judged."""

    def __init__(self, context: RunContext, keep_steps: bool) -> None:
        super().__init__(context, keep_steps)
        self.unknown, self.records, self.rows = self.steps(), 0.0, 0
        self.weighted = False
        self.q = SortedColumn()

    def add(self, block: pd.DataFrame) -> None:
        unknown = (_column(block, "unknown_divisor") > 0) & (_column(block, "tokens") > 0)
        if not unknown.any():
            return
        self.unknown.add(_column(block, "step")[unknown])
        self.records += _sum(_column(block, "unknown_divisor")[unknown])
        self.rows += int(unknown.sum())
        weighted = unknown & (_column(block, "weighted_records") > 0)
        if weighted.any():
            self.weighted = True
            e_low, e_high = _column(block, "e_low")[weighted], _column(block, "e_high")[weighted]
            self.q.add((e_low + e_high) / 2 * _column(block, "tokens")[weighted])

    def findings(self) -> Iterator[Finding]:
        if not self.unknown:
            return
        context = self.context
        evidence: dict[str, Any] = {"records": int(self.records), "world_size": context.world_size}
        detail = ""
        if self.weighted:
            # The log assumed D = W; with a summing reduction (D = 1) every weight is W× larger.
            q = _median(self.q)
            self.q.close()
            evidence.update({"distortion_if_average": q, "distortion_if_sum": q * context.world_size})
            detail = (f" If the reduction averages (D = W = {context.world_size}), tokens got q = e·N = {q:.4g}; "
                      f"if it sums (D = 1), q = {q * context.world_size:.4g} (correct is 1).")
        yield _finding(context, Code.UNKNOWN_DIVISOR, self.unknown,
                       f"The divisor D of the gradient reduction could not be seen in {self.rows} step(s) (a DDP comm hook "
                       "the recorder does not know, or no DDP model given), so the absolute scale of the weights is not "
                       f"judged; relative checks (local means, per-microbatch denominators) still ran.{detail}",
                       "tell the recorder what the reduction divides by: Recorder(..., grad_divisor=1) for a summing "
                       f"hook, grad_divisor={context.world_size} for an average (or pass the DDP model as model=)",
                       evidence)


def _median(column: SortedColumn) -> float:
    """The median of a column, NaN left out (NaN when none is a number), as pandas takes it."""
    if not column.count:
        return math.nan
    if not column.spilled:
        return float(pd.Series(column.in_order()[0]).median())
    return middle(at_positions(column, middle_positions(0, column.count)))


class _WeightPresence(_Check):
    """no_weights: valid records without a usable weight (no b and no probe, or S = 0 without a probe)."""

    def __init__(self, context: RunContext, keep_steps: bool) -> None:
        super().__init__(context, keep_steps)
        self.unweighted, self.records, self.none_at_all = self.steps(), 0.0, 0

    def add(self, block: pd.DataFrame) -> None:
        unweighted_records = _column(block, "unweighted_records")
        unweighted = unweighted_records > 0
        self.unweighted.add(_column(block, "step")[unweighted])
        self.records += _sum(unweighted_records[unweighted])
        self.none_at_all += int((unweighted & (_column(block, "weighted_records") == 0)).sum())

    def findings(self) -> Iterator[Finding]:
        if not self.unweighted:
            return
        records = int(self.records)
        yield _finding(self.context, Code.NO_WEIGHTS, self.unweighted,
                       f"{records} record(s) with valid tokens carry no usable weight (no backward scalar and no probe, "
                       f"or a loss sum of 0 without a probe); {self.none_at_all} step(s) have no weight at all, so their "
                       "normalization cannot be judged.",
                       "record backward_scalar= with every record, or wrap the per-token loss in rec.probe()",
                       {"records": records, "steps_without_weight": self.none_at_all})


def _duplicates(duplicates: tuple[int, int, int, int], run: str) -> Finding:
    """duplicate_records: the engine kept the later of each repeated (group, term, step, micro, rank)."""
    copies, first, last, count = duplicates
    return Finding(run=run, code=Code.DUPLICATE_RECORDS, severity=DEFAULT_SEVERITY[Code.DUPLICATE_RECORDS],
                   steps=StepRange(first, last, count),
                   message=f"{copies} record(s) repeat a (group, term, step, micro, rank) already logged, e.g. after a "
                           "resume that replayed steps; the later record (by `time`, then file) was kept.",
                   fix="resume from the checkpoint's step and start a new shard sequence; or delete the older shards",
                   evidence={"dropped_records": copies})


_CONFUSED_COUNTS = {
    Denominator.RANK: ("each rank held the same number of valid tokens n_r", "a rank-local mean"),
    Denominator.MICRO_TIMES_M: ("every microbatch held the same number of valid tokens",
                                "a per-microbatch mean divided by M"),
    Denominator.MICRO: ("every microbatch held the same number of valid tokens", "a per-microbatch mean"),
    Denominator.MICRO_GLOBAL: ("every microbatch index held the same number of valid tokens over the ranks",
                               "a per-microbatch global count N_m"),
}


class _Balanced:
    """balanced_counts: in every step the counts that a local normalization needs to differ were
    equal, so the logs cannot tell it from the token mean."""

    def __init__(self, context: RunContext, keep_steps: bool, confused: Denominator | None) -> None:
        self.context, self.confused = context, confused
        self.nonempty = _Steps(keep_steps)
        self.counts: set[int] = set()
        self.balanced = True

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses) -> None:
        if self.confused is None:
            return
        nonempty = _column(block, "tokens") > 0
        self.nonempty.add(_column(block, "step")[nonempty])
        self.counts.update(int(n) for n in np.unique(_column(block, "n_high")[nonempty]))
        self.balanced = self.balanced and bool(diagnoses.balanced[nonempty].all())

    def findings(self) -> Iterator[Finding]:
        if self.confused is None:
            return
        counts = sorted(self.counts)
        what, mistake = _CONFUSED_COUNTS[self.confused]
        detail = f"every record had the same valid-token count ({_list(counts)})" if self.balanced else what
        yield _finding(self.context, Code.BALANCED_COUNTS, self.nonempty,
                       f"In every step {detail}, so {mistake} and the global token mean give the same weights here: "
                       "this run cannot show which one the code uses.",
                       "audit a run with uneven counts (padding, ignored labels, different sequence lengths per rank)",
                       {"counts": counts, "indistinguishable_from": self.confused.value})


def loss_terms(steps: pd.DataFrame) -> list[str]:
    """The loss terms of a step table, as text, the main term (UNNAMED, "0") first: each distinct value named
    once, not every row converted."""
    return sorted({str(term) for term in steps.term.unique()}, key=lambda t: (t != UNNAMED, t))


def _list(values: Any) -> str:
    items = [str(int(v)) for v in values]
    return ", ".join(items[:8]) + (f", … ({len(items)} in all)" if len(items) > 8 else "")
