"""A run's summary and verdict from its findings and step table; the steps its recorders dropped; the CI policy."""

from __future__ import annotations

import math
from pathlib import PurePosixPath
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._ends import spans_cover
from tokaudit._checks import PARTIAL_UPDATE_FACTORS, RunSteps, cannot_tell, distinct, pooled_sums, run_finding
from tokaudit._checks import weight_ratio, world_sizes
from tokaudit.codes import CODE_DOCS, DEFAULT_SEVERITY, REPORTING, UNDECIDABLE, WEIGHTING, Code, Severity
from tokaudit.errors import LogFormatError
from tokaudit._normalization import judged_steps
from tokaudit._discovery import UNREADABLE_FOLDER
from tokaudit._partitions import partition_folders, run_folder
from tokaudit._reader import Shard
from tokaudit._report import Finding, RunSummary, Segment, StepRange, Verdict, Reporting
from tokaudit._schema import HALF_PRECISION_BITS, Provenance


@dataclass
class DroppedRecords:
    """Records one run's recorders could not keep, from their shards' footers."""

    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per group, the step ranges (first, last) that lost records."""
    records: int = 0
    ranks: set[tuple[str, int]] = field(default_factory=set)

    def covers(self, frame: pd.DataFrame) -> npt.NDArray[np.bool_]:
        """Rows of the step table whose (group, step) lost records."""
        return spans_cover(frame, self.spans)

    def merged(self) -> list[tuple[int, int]]:
        """The step ranges of every group, as disjoint ranges in step order."""
        merged: list[tuple[int, int]] = []
        for first, last in sorted(span for spans in self.spans.values() for span in spans):
            if merged and first <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], last))
            else:
                merged.append((first, last))
        return merged

    def finding(self, run: str) -> Finding:
        merged = self.merged()
        count = sum(last - first + 1 for first, last in merged)
        listed = [step for first, last in merged for step in range(first, min(last, first + 1000) + 1)][:1000]
        shown = ", ".join(map(str, listed[:8])) + (f", … ({count} in all)" if count > 8 else "")
        return Finding(
            run=run,
            code=Code.RECORDS_DROPPED,
            severity=DEFAULT_SEVERITY[Code.RECORDS_DROPPED],
            steps=StepRange(merged[0][0], merged[-1][1], count),
            message=f"The recorder could not write {self.records} record(s) of {len(self.ranks)} rank(s) "
            f"(a full or read-only disk, or a value no audit can use) at step(s) {shown}; those "
            "steps are left out instead of being judged on part of their tokens.",
            fix="give the log folder room and check the training's warnings from tokaudit; the other "
            "steps were audited as usual",
            evidence={"records": self.records, "steps": listed},
        )


def setups_of(shards: Sequence[Shard]) -> dict[str, Provenance]:
    """Per run: what its shards' provenance says of how it was recorded, each fact from the first shard that says
    it (a launch is a shard's, never a run's)."""
    found: dict[str, dict[str, Any]] = {}
    notes: dict[str, set[tuple[int | None, int]]] = {}  # per run, each (launch, update) a recorder stopped inside
    for shard in shards:
        run = _run_of(shard)
        facts = found.setdefault(run, {})
        for name in (
            "trainer",
            "pipelined",
            "steps_inferred",
            "schedule_divisor",
            "launch_world_size",
            "class_weights",
        ):
            if getattr(shard.provenance, name) not in (None, False):  # a fact a shard states
                facts.setdefault(name, getattr(shard.provenance, name))
        if shard.provenance.unfinished is not None:
            notes.setdefault(run, set()).add((shard.provenance.launch, shard.provenance.unfinished))
    for run, redone in _redone(shards, notes).items():
        if kept := [step for _, step in notes[run] - redone]:
            found[run]["unfinished"] = max(kept)  # the run's last update stopped inside (a recorder's, the latest)
    return {run: Provenance(**facts) for run, facts in found.items()}


WEIGHT_COLUMNS = ("loss_sum", "backward_scalar", "token_weight_sum", "token_weight_min", "token_weight_max")
"""The columns a record's weight is read from: stored in a narrower float, they hold that float's bits at most."""

STORED_BITS = {"halffloat": HALF_PRECISION_BITS["float16"]}
"""Significant bits of the float types narrower than the default --rtol allows for (float32's 24 are within it)."""


def stored_precision(shards: Sequence[Shard]) -> dict[str, int]:
    """Per run, the fewest significant bits a file of it stores a weight column in (float16: 11), as `precision_bits`
    would say: a value stored so is rounded there, whatever it was computed in."""
    found: dict[str, int] = {}
    for shard in shards:
        stored = [STORED_BITS[kind] for name, kind in shard.signature if name in WEIGHT_COLUMNS and kind in STORED_BITS]
        if stored:
            run = _run_of(shard)
            found[run] = min(found.get(run, 64), *stored)
    return found


def _run_of(shard: Shard) -> str:
    """The run of a shard's records where its footer shows one (`Shard.run_group`, or its folder's where
    `run_override`), else its folder's default."""
    return shard.run_group[0] if shard.run_group is not None and not shard.run_override else shard.default_run


def unread_files(shards: Sequence[Shard], problems: Sequence[LogFormatError]) -> dict[str, list[str]]:
    """Per run, the Parquet files (and folders) that could not be read in a folder of its: a run folder
    (`partitions.run_folder`, above a Spark-style part's `column=value` folders) that holds a readable file of the
    run. A file whose folder holds none is no run's: its own line is all there is to say of it."""
    unread: dict[str, list[str]] = {}
    for problem in problems:
        if problem.path.endswith(".parquet"):
            unread.setdefault(str(run_folder(PurePosixPath(problem.path))), []).append(problem.path)
        elif problem.problem.startswith(UNREADABLE_FOLDER):  # (a `step=2/` folder of the run: any file of it)
            unread.setdefault(str(run_folder(PurePosixPath(problem.path, "x.parquet"))), []).append(problem.path)
    found: dict[str, list[str]] = {}
    if not unread:
        return found
    runs: dict[str, set[str]] = {}
    for shard in shards:
        if (folder := str(run_folder(PurePosixPath(shard.name)))) in unread:
            runs.setdefault(folder, set()).update(_runs_in(shard))
    for folder, files in unread.items():
        for file in files:
            # a `run_id=X/` folder above it names the one run it can hold (where that run is one of the folder's)
            given = dict(partition_folders(PurePosixPath(file))).get("run_id")
            held = runs.get(folder, set())
            for run in sorted({given} & held if given in held else held):
                found.setdefault(run, []).append(file)
    return found


def _runs_in(shard: Shard) -> set[str]:
    """The runs of a shard's records: the one its footer shows (`_run_of`), else its run_id column's values, read
    (the folder's own run for a null): a file of several runs, or of one run over several groups."""
    if shard.run_group is not None or shard.run_override or "run_id" not in shard.columns:
        return {_run_of(shard)}
    try:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        with shard.open() as source:
            values = pq.read_table(source, columns=["run_id"]).column("run_id")
        return {shard.default_run if run is None else str(run) for run in pc.unique(values).to_pylist()}
    except Exception:  # its own reading names what is wrong with it; here, the folder's run is the guess
        return {shard.default_run}


def _redone(
    shards: Sequence[Shard], notes: dict[str, set[tuple[int | None, int]]]
) -> dict[str, set[tuple[int | None, int]]]:
    """Per run with notes, those a later launch voided: it recorded the update again, and a rank's step two launches
    recorded is the later launch's alone (`engine.database`), whole where that launch stepped it."""
    redone: dict[str, set[tuple[int | None, int]]] = {run: set() for run in notes}
    for shard in shards:
        launch, steps, run = shard.provenance.launch, shard.step_range, _run_of(shard)
        if launch is None or steps is None or run not in notes:
            continue
        for note in notes[run]:
            if note[0] is not None and note[0] < launch and steps[0] <= note[1] <= steps[1]:
                redone[run].add(note)
    return redone


def unfinished_finding(run: str, step: int, cut: bool = False) -> Finding:
    """unfinished_update: the update a recorder closed inside, never stepped, left out of the checks. `cut`: no
    recorder said so; the run's last update is cut short and unsynchronized (`cut.unsynced_end`), which a loop that
    flushed and then stepped it unsynchronized leaves as well: a warning that the logs cannot tell."""
    seen = (
        "it holds fewer microbatches than the updates before it, and no rank's last of them synchronized "
        "gradients, as those of every update before it did: "
        if cut
        else ""
    )
    cannot = (
        " Nothing says it was applied, and a loop that flushed and then stepped a short last update without "
        "synchronizing (a bug) leaves the same records: the logs cannot tell."
        if cut
        else ""
    )
    return Finding(
        run=run,
        code=Code.UNFINISHED_UPDATE,
        severity=Severity.WARNING if cut else DEFAULT_SEVERITY[Code.UNFINISHED_UPDATE],
        steps=StepRange(step, step, 1),
        message=f"The run stopped inside update {step}: {seen}its records never reached an optimizer step (a job "
        "stopped or preempted, an error, or a loader that ended inside the update), so it holds part of its "
        f"microbatches at most and is not judged; the updates before it are.{cannot}",
        fix="nothing where the run was killed; else synchronize the last microbatch of a short last update (outside "
        "no_sync()) or drop that update"
        if cut
        else "nothing where the run was stopped; where a loader ends inside an update, let the trainer step the short "
        "last update or draw whole updates only",
        evidence={"step": step},
        undecidable=True if cut else None,
    )


def dropped_steps(shards: Sequence[Shard]) -> dict[str, DroppedRecords]:
    out: dict[str, DroppedRecords] = {}
    for shard in shards:
        note = shard.dropped
        if note is None:
            continue
        entry = out.setdefault(shard.default_run if shard.run_override else note["run"], DroppedRecords())
        entry.ranks.add((note["group"], note["rank"]))
        for first, last, records in note["steps"]:
            entry.records += records
            entry.spans.setdefault(note["group"], []).append((first, last))
    return out


def guessed_updates(run: str, findings: list[Finding], source: RunSteps, rtol: float) -> list[Finding]:
    """A run whose recorder was told no update's end (`Provenance.steps_inferred`): a uniform factor may be gradient
    accumulation read a microbatch at a time, and a per-microbatch mean reads as the token mean, so the logs cannot
    tell: update_ends_guessed says so, and the uniform factors say they cannot tell either. Where every step's
    tokens weigh alike (within `rtol`), no weighting names a denominator either: what one of them reads in a step's
    N or positions is a microbatch's count."""
    guessed = run_finding(
        run,
        Code.UPDATE_ENDS_GUESSED,
        source,
        "The recorder was told no update's end (no optimizer=, begin_step() or step=) and no backward ran "
        "under no_sync(), so it took each backward for an update. Under gradient accumulation every N judged "
        "here is a microbatch's: the token mean reads as uniform weights below 1/N, and a "
        "per-microbatch mean as the token mean. The logs cannot tell, so the run is not called correct.",
        CODE_DOCS[Code.UPDATE_ENDS_GUESSED].fix,
        {},
    )
    why = (
        "The updates' ends were guessed, a backward each (update_ends_guessed): under gradient accumulation each "
        "microbatch weighs N_micro/N, which this may be."
    )
    uniform = all(_alike(block, rtol) for block in source.blocks())
    return [*cannot_tell(findings, PARTIAL_UPDATE_FACTORS | (WEIGHTING if uniform else frozenset()), why), guessed]


def class_weighted(findings: list[Finding], source: RunSteps, rtol: float) -> list[Finding]:
    """A run whose cross-entropy weighed its classes (`Provenance.class_weights`): its mean over Σw weighs every token
    N/Σw of 1/N, a factor the labels set, which scale_mismatch may be (and, where every step's tokens weigh alike, a
    weighting): those say the logs cannot tell. A factor of W, a power of two or one λ over a span is none of it."""
    why = (
        "The loss weighs its classes (cross_entropy(weight=...)): its mean divides by the class weights' sum Σw, "
        "which no record holds, not by N, and weighs every token N/Σw of 1/N, which this may be."
    )
    uniform = all(_alike(block, rtol) for block in source.blocks())
    return cannot_tell(findings, {Code.SCALE_MISMATCH} | (WEIGHTING if uniform else frozenset()), why)


def _alike(block: pd.DataFrame, rtol: float) -> bool:
    """Whether every step of the block weighs its tokens alike: its heaviest and lightest within rtol."""
    low, high = block.token_weight_low.to_numpy(float), block.token_weight_high.to_numpy(float)
    return not bool(np.any(high - low > rtol * np.maximum(np.abs(high), np.abs(low))))


def within_roundings(findings: list[Finding], bits: int | None) -> list[Finding]:
    """Weights no further apart than two roundings at the run's precision make (p bits, u = 2⁻ᵖ): a weight b/S rounds
    twice where the loss b divides was itself rounded to p bits and S was logged from a finer sum (a bfloat16 loss
    backpropagated as S_bf16·W/N, S summed in float32), so two weights of a right run may be 4u = 2^(2−p) apart,
    twice the 2u a run is judged at (`judged_rtol`), and a small mistake (S/(n+1) at n ≈ 100) reads the same. Those
    findings say the logs cannot tell: never incorrect for a rounding, never correct for a mistake."""
    p = 24 if bits is None else bits  # (float32's, where the records do not say: the log format's rule)
    band = 2.0 ** (2 - p)
    why = (
        f"Its weights are within {band:.3g} of each other: two roundings at {p} bits "
        "(a loss rounded before b divides it, S logged from a finer sum) make as much, so the logs cannot tell a "
        "rounding from a small mistake."
    )

    def rounded(finding: Finding) -> bool:
        # the tokens' weights within the band of each other, and of the token mean's 1/N (q = e·N near 1): a
        # denominator far off (S/T at T ≈ 2n, q ≈ 0.5) is no rounding, however alike its weights; a uniform factor
        # (scale_mismatch, world_size_mismatch: each step's weights alike) by the range of its steps' q
        evidence = finding.evidence
        if finding.code in PARTIAL_UPDATE_FACTORS and "distortion_range" in evidence:
            return all(abs(value - 1) <= band for value in evidence["distortion_range"])
        q = [evidence.get(side, {}).get("distortion", math.inf) for side in ("heaviest", "lightest")]
        alike = evidence.get("weight_ratio", math.inf) <= 1 + band
        return finding.code in WEIGHTING and alike and all(abs(value - 1) <= band for value in q)

    return cannot_tell(findings, (), why, where=rounded)


def apply_policy(findings: list[Finding], min_ratio: float | None) -> list[Finding]:
    """--min-ratio: a weighting finding below the ratio a CI gate accepts is information, in the listing and in what
    fails the command; the verdict reads it as found."""
    kept = []
    for finding in findings:
        ratio = finding.evidence.get("weight_ratio")
        if min_ratio is not None and finding.code in WEIGHTING and isinstance(ratio, float) and ratio < min_ratio:
            finding = replace(
                finding,
                severity=Severity.INFO,
                message=f"{finding.message} (Below --min-ratio {min_ratio:g}: information only.)",
            )
        kept.append(finding)
    return kept


def deciding(findings: Sequence[Finding]) -> list[Finding]:
    """The findings a verdict reads: warnings and errors about the gradient. Findings about the logged loss
    (REPORTING) are the run's `reporting`, and repeated records its warning: copies are not evidence, unless they
    say the logs cannot tell (`with_replaced`)."""
    return [
        f
        for f in findings
        if f.severity.rank >= Severity.WARNING.rank
        and f.code not in REPORTING
        and (f.code != Code.DUPLICATE_RECORDS or f.undecidable)
    ]


def verdict_of(findings: Sequence[Finding], judged: bool) -> Verdict:
    """Incorrect when a warning or error about the gradient says so; inconclusive when the only ones say the
    logs cannot tell (or the counts are balanced, or nothing could be judged); correct otherwise. Findings about
    the logged loss (REPORTING) are the run's `reporting`, and repeated records its warning, never its verdict."""
    serious = deciding(findings)
    if any(not (f.code in UNDECIDABLE if f.undecidable is None else f.undecidable) for f in serious):
        return "incorrect"
    if serious or any(f.code == Code.BALANCED_COUNTS for f in findings) or not judged:
        return "inconclusive"
    return "correct"


SUMMARY_BLOCK = 1 << 16
"""Steps `run_summary` reads at a time: its temporaries stay a few MB whatever the number of steps."""


def run_summary(
    run: str,
    source: RunSteps,
    findings: list[Finding],
    segments: list[Segment],
    omitted: int = 0,
    pooled: bool = False,
    listed: list[Finding] | None = None,
) -> RunSummary:
    """`pooled`: the run's terms are one objective (`checks.objective`): a token's q = e·N counts N over them.
    `listed`: the findings shown, where --ignore left some of `findings` out or --min-ratio made some information (their
    own verdict gates the exit)."""
    # The run's parts read a block of steps at a time, never a filtered copy of the table (millions of
    # steps) nor a Python float per step. Parts hold disjoint ranges of steps: distinct steps add up.
    weights = _Weights()
    rows = steps = skipped_steps = reported = 0
    ranks = _Ranks()
    microbatches = -math.inf
    divisors: set[float] = set()
    sizes: set[int] = set()
    for part in source.parts():
        sizes.update(world_sizes(part))
        rows += int(part.records.sum())
        reported += int(part.reported.sum())  # records that carry a logged loss
        steps += _count_distinct(part.step.to_numpy())
        skipped_steps += _count_distinct(part.step.to_numpy()[part.skipped_true.to_numpy() > 0])
        ranks.add(part)
        microbatches = max(microbatches, float(part.microbatches_high.max()))
        both = np.concatenate([distinct(part.divisor_low).astype(float), distinct(part.divisor_high).astype(float)])
        divisors.update(float(d) for d in both[~np.isnan(both)])
        weights.add(part, pooled)
    judged, max_ratio = weights.judged, weights.max_ratio()
    judged_ranks = not any(f.code == Code.RANKS_NOT_RECORDED for f in findings)  # else every N is partial
    # q = e·N needs D: where the reduction's divisor could not be seen, the finding gives q under each reading
    seen_divisor = not any(f.code == Code.UNKNOWN_DIVISOR for f in findings)
    weighted = weights.weighted_any and judged_ranks and seen_divisor
    weight_range = (weights.q_low.value(), -weights.q_high.value()) if weighted else None
    main = [s for s in segments if s.term == source.terms[0]]
    return RunSummary(
        run=run,
        rows=rows,
        steps=steps,
        ranks=ranks.count(),
        world_size=sorted(sizes),
        groups=len(source.groups),
        verdict=verdict_of(findings, judged),
        normalization=max(main, key=lambda s: s.steps, default=None),
        segments=segments,
        decided_by=sorted({f.code.value for f in deciding(findings)}),
        gate_verdict=None if listed is None or listed == list(findings) else verdict_of(listed, judged),
        max_weight_ratio=max_ratio if judged_ranks else math.nan,  # (some ranks' records alone: no step's ratio)
        microbatches=max(int(microbatches), 0) if rows else 0,
        terms=source.terms,
        skipped_steps=skipped_steps,
        divisors=sorted(divisors) if seen_divisor else [],  # else what the records hold is the default W
        weight_range=weight_range,
        segments_omitted=omitted,
        normalization_judged=judged_ranks,
        reporting=_reporting(findings, reported, judged_ranks),
    )


class _Ranks:
    """The ranks that recorded some step of a run: below 64, the ranks set in any step's `rank_mask`; past that,
    the most ranks one step holds (a run of a rank's records alone holds 1 rank, not its number + 1)."""

    def __init__(self) -> None:
        self.mask, self.highest, self.most = 0, -1, 0

    def add(self, part: pd.DataFrame) -> None:
        self.mask |= int(np.bitwise_or.reduce(np.nan_to_num(part.rank_mask.to_numpy()).astype(np.uint64)))
        self.highest = max(self.highest, int(part.rank_max.max()))
        self.most = max(self.most, int(part.ranks.max()))

    def count(self) -> int:
        return self.mask.bit_count() if self.highest < 64 else self.most


class _Weights:
    """The token weights of a run's parts, `SUMMARY_BLOCK` steps at a time: whether any step with valid tokens
    is weighted (`judged`), the heaviest token over the lightest, and the range of q = e·N."""

    def __init__(self) -> None:
        self.judged = self.ratio_seen = self.unbounded = self.ratios_exist = self.weighted_any = False
        self.ratio = -math.inf
        self.q_low, self.q_high = _Extreme(), _Extreme()

    def add(self, part: pd.DataFrame, pooled: bool) -> None:
        weighted_all = judged_steps(part)  # (an update skipped changed no weight: its records are not weighed)
        self.weighted_any = self.weighted_any or bool(weighted_all.any())
        tokens_all = _tokens(part, pooled)
        low_all, high_all = part.token_weight_low.to_numpy(dtype=float), part.token_weight_high.to_numpy(dtype=float)
        for start in range(0, len(part), SUMMARY_BLOCK):
            block = slice(start, start + SUMMARY_BLOCK)
            weighted = weighted_all[block]
            tokens = tokens_all[block][weighted]
            self.judged = self.judged or bool((tokens > 0).any())
            low, high = low_all[block][weighted], high_all[block][weighted]
            positive = low > 0
            self.unbounded = self.unbounded or bool((low <= 0).any())
            if positive.any():
                # the heaviest token over the lightest, NaN skipped (pandas' max)
                self.ratios_exist = True
                ratios = weight_ratio(low[positive], high[positive])
                ratios = ratios[~np.isnan(ratios)]
                if len(ratios):
                    self.ratio_seen, self.ratio = True, max(self.ratio, float(ratios.max()))
            # q = e·N per token: the probe's extremes where recorded, else the records' mean weights
            for q in (low * tokens, high * tokens):
                self.q_low.add(q)
                self.q_high.add(-q)

    def max_ratio(self) -> float:
        """The heaviest token over the lightest: 1 where no lightest weight is positive, NaN where no ratio is a
        number, infinite where a lightest weight is 0 or less."""
        max_ratio = (self.ratio if self.ratio_seen else math.nan) if self.ratios_exist else 1.0
        if self.unbounded:
            max_ratio = math.inf
        return max_ratio


def _tokens(part: pd.DataFrame, pooled: bool) -> Any:
    """Each row's N: its (group, term, step)'s, or, where the terms are `pooled`, its (group, step)'s over them."""
    if not pooled:
        return part.tokens.to_numpy()
    return pooled_sums(part, ["tokens"]).tokens.to_numpy()


def _reporting(findings: list[Finding], reported: int, judged: bool = True) -> Reporting:
    """The logged loss against the token mean, from the findings about it and the records that carry one; "unjudged"
    where every step's N is partial (not `judged`: ranks not recorded)."""
    if {f.code for f in findings} & REPORTING:
        return "differs"
    return "absent" if not reported else "matches" if judged else "unjudged"


class _Extreme:
    """The lowest value seen over blocks, NaN skipped; NaN when none was a number (pandas' min)."""

    def __init__(self) -> None:
        self.low = math.inf
        self.seen = False

    def add(self, values: npt.NDArray[np.float64]) -> None:
        values = values[~np.isnan(values)]
        if len(values):
            self.low, self.seen = min(self.low, float(values.min())), True

    def value(self) -> float:
        return self.low if self.seen else math.nan


def _count_distinct(values: npt.NDArray[Any]) -> int:
    """How many distinct values: the length of an increasing column (one group's steps) without a hash."""
    if len(values) < 2 or bool((values[1:] > values[:-1]).all()):
        return len(values)
    return len(pd.unique(values))
