"""The audit: load → aggregate per step → checks → AuditReport. Returns data, never prints."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb
import numpy as np
import numpy.typing as npt
import pandas as pd
import pyarrow.parquet as pq

from tokaudit.checks import check_run, distinct, loss_terms, world_sizes
from tokaudit.codes import DEFAULT_RTOL, DEFAULT_SEVERITY, UNDECIDABLE, Code, Severity
from tokaudit.engine import EXTREME_COLUMNS, Engine, extremes_at
from tokaudit.normalization import Denominator
from tokaudit.errors import LogFormatError, UsageError
from tokaudit.reader import Loading, LogSet, Shard, cores, inspect_shard, load
from tokaudit.report import AuditReport, Finding, RunSummary, Segment, StepRange, Verdict
from tokaudit.schema import UNNAMED

Progress = Callable[[str], None]

PROGRESS_ROWS = 1_000_000
"""Logs larger than this say on stderr what is being read."""

EVIDENCE_ROWS = 1_000_000
"""Logs of at most this many records aggregate every step's evidence columns (`engine.EXTREME_COLUMNS`:
where its heaviest and lightest token were) in the one query: a tenth more of a query that takes a
fraction of a second, where each finding's step aggregated again alone costs a DuckDB connection and a
query of its own (0.1 to 0.25 s; 0.45 s of the 2.2 s of `tokaudit check sample_logs/`). Larger logs
aggregate them for a finding's step only (`_Extremes`): over every step they would cost a tenth of the
query and 48 bytes a step."""

_CODE_ORDER = {code: index for index, code in enumerate(Code)}


def open_logs(paths: Sequence[str | os.PathLike[str]], rtol: float = DEFAULT_RTOL,
              progress: Progress | None = None, only_steps: tuple[int, int] | None = None,
              threads: int | None = None, started: Loading | None = None, evidence: bool = False
              ) -> tuple[LogSet, Engine | None, pd.DataFrame]:
    """Load, validate and aggregate. A shard DuckDB cannot decode, or whose values no audit can use, is
    reported and left out.

    Files are validated from their footers; a NaN divisor or scale, which no footer shows, is counted
    by the aggregation, and only the files holding one are then read in full to say where.
    `started`: this load of `paths` already under way (`start_loading(paths, False, ...)`). `evidence`:
    a log of at most EVIDENCE_ROWS records is aggregated with the evidence columns (`engine.EXTREME_COLUMNS`)."""
    # Footers are validated by as many processes as DuckDB has threads: every core unless told
    # (the trackers' audit beside training takes one, and so validates in its own process).
    logset = started.result() if started is not None else load(paths, thorough=False, workers=threads or cores())
    shards = list(logset.shards)
    if only_steps is not None:
        # Files whose footer statistics put every step outside the range are not read at all.
        shards = [s for s in shards if s.may_hold(*only_steps)]
    problems = list(logset.problems)
    rows = sum(s.rows for s in shards)
    large = rows > PROGRESS_ROWS
    if progress and large:
        progress(f"reading {len(shards)} file(s), {sum(s.rows for s in shards):,} rows")
    while shards:
        try:
            engine = Engine.open(shards, only_steps=only_steps, threads=threads,
                                 extremes=evidence and rows <= EVIDENCE_ROWS)
            try:
                steps = engine.step_table(rtol, progress if large else None)
                if len(steps) and steps.unusable_values.sum() > 0:
                    unusable = _unusable(engine.unusable_files())
                    if unusable:
                        engine.close()
                        problems.extend(unusable.values())
                        shards = [s for s in shards if s.path not in unusable]
                        continue
                return LogSet(shards, problems), engine, steps
            except duckdb.Error:
                engine.close()
                raise
        except duckdb.Error as error:
            broken = _undecodable(shards)
            if not broken and isinstance(error, duckdb.OutOfMemoryException):
                # every file decodes: the limit is too small for this log, which is no file's fault
                raise UsageError(f"DuckDB ran out of memory under its limit ({str(error).splitlines()[0][:200]}); "
                                 "raise TOKAUDIT_MEMORY_LIMIT (default 768MB) or lower TOKAUDIT_CHUNK_ROWS") from None
            if not broken:
                raise LogFormatError(", ".join(s.name for s in shards[:3]),
                                     f"cannot be aggregated ({str(error).splitlines()[0][:200]})") from None
            problems.extend(broken.values())
            shards = [s for s in shards if s.path not in broken]
    return LogSet(shards, problems), None, pd.DataFrame()


def _unusable(shards: list[Shard]) -> dict[object, LogFormatError]:
    """The thorough check of the shards the aggregation found a NaN divisor or scale in: one line each."""
    found: dict[object, LogFormatError] = {}
    for shard in shards:
        try:
            inspect_shard(shard.path, shard.store, thorough=True)
        except LogFormatError as error:
            found[shard.path] = error
    return found


def _undecodable(shards: list[Shard]) -> dict[object, LogFormatError]:
    """Shards whose footer reads but whose data pages do not (corruption inside the file)."""
    broken: dict[object, LogFormatError] = {}
    for shard in shards:
        try:
            pq.read_table(shard.open())
        except Exception as error:
            broken[shard.path] = LogFormatError(shard.name, f"corrupt data ({str(error).splitlines()[0][:160]})")
    return broken


def audit(paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str], rtol: float = DEFAULT_RTOL,
          runs: Sequence[str] = (), progress: Progress | None = None, live: bool = False,
          ignore: Sequence[str | Code] = (), min_ratio: float | None = None, keep_steps: bool = False,
          threads: int | None = None, started: Loading | None = None) -> AuditReport:
    """Audit every run under `paths`. Unreadable files become `problems`; the rest is still audited.

    `live`: the logs are still being written, so steps after the last one every rank has recorded
    are left out instead of being reported as missing ranks. `ignore`: finding codes to leave out.
    `min_ratio`: a weighting finding whose heaviest token weighs less than this many times the
    lightest is information, not an error (verdicts follow). `keep_steps`: keep the per-step table
    in `report.steps`. `threads`: DuckDB's worker threads (default: every core); an audit running
    beside training (the trackers' audit) takes one. `started`: the validation of `paths` already
    under way (`start_loading(paths, thorough=False, workers=cores())`, which the command line starts
    before it imports the auditor).
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if not (0 < rtol < 1):
        raise UsageError(f"--rtol must be between 0 and 1, got {rtol}")
    if min_ratio is not None and not min_ratio >= 1:
        raise UsageError(f"--min-ratio must be at least 1, got {min_ratio}")
    try:
        ignored = {Code(code) for code in ignore}
    except ValueError as error:
        raise UsageError(f"--ignore: {error}; `tokaudit explain` lists the codes") from None
    logset, engine, steps = open_logs(paths, rtol, progress, threads=threads, started=started, evidence=True)
    problems = [str(p) for p in logset.problems]
    if engine is None:
        return AuditReport(runs=[], findings=[], problems=problems, files=0)
    try:
        if runs:
            unknown = sorted(set(runs) - set(steps.run.unique()))
            if unknown:
                raise UsageError(f"no run named {', '.join(map(repr, unknown))} in the logs "
                                 f"(runs: {', '.join(sorted(set(steps.run.unique())))})")
            steps = steps[steps.run.isin(runs)]
        if live:
            steps = _complete_steps(steps, engine.complete_through(), progress)
        # The checks need only the step table: DuckDB's memory is given back before they run.
        duplicates = engine.duplicates
        engine.close()
        extremes = _Extremes(logset.shards, rtol, threads)
        summaries: list[RunSummary] = []
        findings: list[Finding] = []
        dropped = _dropped_steps(logset.shards)
        # One run (the usual log) is the table itself: no copy of a table that can hold millions of steps.
        by_run = [(steps.run.iloc[0], steps)] if len(steps) and steps.run.nunique() == 1 else \
            steps.groupby("run", sort=True, observed=True)
        for run, frame in by_run:
            run = str(run)
            frame = frame.reset_index(drop=True)
            lost = dropped.get(run)
            if lost:
                # Steps that lost records are not judged on the part of their tokens that was kept.
                frame = frame[~lost.covers(frame)].reset_index(drop=True)
                if frame.empty:
                    findings.append(lost.finding(run))
                    summaries.append(RunSummary(run=run, rows=0, steps=0, ranks=0, world_size=[], groups=0,
                                                verdict="inconclusive", normalization=None, segments=[],
                                                max_weight_ratio=1.0, microbatches=0))
                    continue
            run_findings, spans, omitted = check_run(run, frame, rtol, duplicates.get(run), extremes)
            if lost:
                run_findings.append(lost.finding(run))
            run_findings = _policy(run_findings, ignored, min_ratio)
            findings.extend(run_findings)
            value = {d: d.value for d in Denominator}
            segments = [Segment(s.first, s.last, s.steps, value[s.denominator], s.factor, s.group, s.term)
                        for s in spans]
            summaries.append(_summary(run, frame, run_findings, segments, omitted))
        findings.sort(key=lambda f: (-f.severity.rank, f.run, f.term != UNNAMED, f.term, _CODE_ORDER[f.code], f.steps.first))
        if keep_steps:  # the same columns whatever the log's size
            steps = steps.drop(columns=[c for c in EXTREME_COLUMNS if c in steps.columns])
        return AuditReport(runs=summaries, findings=findings, problems=problems, files=len(logset.shards),
                           steps=steps if keep_steps else None)
    finally:
        engine.close()


@dataclass
class _Extremes:
    """Where the heaviest and the lightest token of an evidence step were (`engine.EXTREME_COLUMNS`),
    aggregated for that step alone when a finding asks: a few steps, instead of every step's."""

    shards: Sequence[Shard]
    rtol: float
    threads: int | None
    found: dict[int, pd.DataFrame] = field(default_factory=dict)

    def __call__(self, row: Any) -> Any:
        step = int(row.step)
        if step not in self.found:
            try:
                self.found[step] = extremes_at(self.shards, step, self.rtol, self.threads)
            except duckdb.Error as error:
                raise LogFormatError(self._where(), f"could not be read again for the evidence of step {step} "
                                                    f"({str(error).splitlines()[0][:160]})") from None
        table = self.found[step]
        match = table[(table.run.astype(str) == str(row.run)) & (table.grp.astype(str) == str(row.grp))
                      & (table.term.astype(str) == str(row.term))]
        if match.empty:  # a shard removed or rewritten since it was aggregated
            raise LogFormatError(self._where(), f"changed while it was audited: step {step} of run {row.run!r} is "
                                                "no longer there; audit it again")
        return match.iloc[0]

    def _where(self) -> str:
        return ", ".join(s.name for s in self.shards[:3]) + (", …" if len(self.shards) > 3 else "")


@dataclass
class _Dropped:
    """Records one run's recorders could not keep, from their shards' footers."""

    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per group, the step ranges (first, last) that lost records."""
    records: int = 0
    ranks: set[tuple[str, int]] = field(default_factory=set)

    def covers(self, frame: pd.DataFrame) -> npt.NDArray[np.bool_]:
        """Rows of the step table whose (group, step) lost records."""
        hit = np.zeros(len(frame), dtype=bool)
        groups, steps = frame.grp.astype(str).to_numpy(), frame.step.to_numpy()
        for group, spans in self.spans.items():
            mine = groups == group
            for first, last in spans:
                hit |= mine & (steps >= first) & (steps <= last)
        return hit

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
        return Finding(run=run, code=Code.RECORDS_DROPPED, severity=DEFAULT_SEVERITY[Code.RECORDS_DROPPED],
                       steps=StepRange(merged[0][0], merged[-1][1], count),
                       message=f"The recorder could not write {self.records} record(s) of {len(self.ranks)} rank(s) "
                               f"(a full or read-only disk, or a value no audit can use) at step(s) {shown}; those "
                               "steps are left out instead of being judged on part of their tokens.",
                       fix="give the log folder room and check the training's warnings from tokaudit; the other "
                           "steps were audited as usual",
                       evidence={"records": self.records, "steps": listed})


def _dropped_steps(shards: Sequence[Shard]) -> dict[str, _Dropped]:
    out: dict[str, _Dropped] = {}
    for shard in shards:
        note = shard.dropped
        if note is None:
            continue
        entry = out.setdefault(note["run"], _Dropped())
        entry.ranks.add((note["group"], note["rank"]))
        for first, last, records in note["steps"]:
            entry.records += records
            entry.spans.setdefault(note["group"], []).append((first, last))
    return out


def _complete_steps(steps: pd.DataFrame, horizon: dict[tuple[str, str], int], progress: Progress | None
                    ) -> pd.DataFrame:
    limit = [horizon.get((str(run), str(group)), -1) for run, group in zip(steps.run, steps.grp, strict=True)]
    keep = steps.step <= pd.Series(limit, index=steps.index)
    if progress and (~keep).any():
        progress(f"--live: left out {int((~keep).sum())} step(s) not yet recorded by every rank")
    return steps[keep].reset_index(drop=True)


_WEIGHTING = frozenset({Code.LOCAL_MEAN, Code.PER_MICRO_DENOMINATOR, Code.PADDED_DENOMINATOR,
                        Code.UNEXPLAINED_WEIGHTING})


def _policy(findings: list[Finding], ignored: set[Code], min_ratio: float | None) -> list[Finding]:
    """--ignore and --min-ratio: what a CI gate chose to accept, applied before the verdict."""
    kept = []
    for finding in findings:
        if finding.code in ignored:
            continue
        ratio = finding.evidence.get("weight_ratio")
        if min_ratio is not None and finding.code in _WEIGHTING and isinstance(ratio, float) and ratio < min_ratio:
            finding = replace(finding, severity=Severity.INFO,
                              message=f"{finding.message} (Below --min-ratio {min_ratio:g}: information only.)")
        kept.append(finding)
    return kept


def verdict_of(findings: Sequence[Finding], judged: bool) -> Verdict:
    """SPEC §4: incorrect when a warning or error says so; inconclusive when the only ones say the logs
    cannot tell (or the counts are balanced, or nothing could be judged); correct otherwise."""
    serious = [f for f in findings if f.severity.rank >= Severity.WARNING.rank]
    if any(f.code not in UNDECIDABLE for f in serious):
        return "incorrect"
    if serious or any(f.code == Code.BALANCED_COUNTS for f in findings) or not judged:
        return "inconclusive"
    return "correct"


SUMMARY_BLOCK = 1 << 16
"""Steps `_summary` reads at a time: its temporaries stay a few MB whatever the number of steps."""


def _summary(run: str, frame: pd.DataFrame, findings: list[Finding], segments: list[Segment],
             omitted: int = 0) -> RunSummary:
    # Columns read a block of steps at a time, never a filtered copy of the table (millions of steps)
    # nor a Python float per step; a column held as one value is read as that value.
    weighted_all = frame.weighted_records.to_numpy() > 0
    tokens_all = frame.tokens.to_numpy()
    low_all, high_all = frame.tok_low.to_numpy(dtype=float), frame.tok_high.to_numpy(dtype=float)
    judged = False
    ratio_seen, ratio, unbounded = False, -math.inf, False
    ratios_exist = False
    q_low, q_high = _Extreme(), _Extreme()
    for start in range(0, len(frame), SUMMARY_BLOCK):
        block = slice(start, start + SUMMARY_BLOCK)
        weighted = weighted_all[block]
        tokens = tokens_all[block][weighted]
        judged = judged or bool((tokens > 0).any())
        low, high = low_all[block][weighted], high_all[block][weighted]
        positive = low > 0
        unbounded = unbounded or bool((low <= 0).any())
        if positive.any():
            # the heaviest token over the lightest, NaN skipped (pandas' max)
            ratios_exist = True
            ratios = high[positive] / low[positive]
            ratios = ratios[~np.isnan(ratios)]
            if len(ratios):
                ratio_seen, ratio = True, max(ratio, float(ratios.max()))
        # q = e·N per token: the probe's extremes where recorded, else the records' mean weights
        for q in (low * tokens, high * tokens):
            q_low.add(q)
            q_high.add(-q)
    max_ratio = (ratio if ratio_seen else math.nan) if ratios_exist else 1.0
    if unbounded:
        max_ratio = math.inf
    weight_range = (q_low.value(), -q_high.value()) if bool(weighted_all.any()) else None
    terms = loss_terms(frame)
    main = [s for s in segments if s.term == terms[0]]
    normalization = max(main, key=lambda s: s.steps) if main else None
    sizes = world_sizes(frame)
    skipped_steps = frame.step.to_numpy()[frame.skipped_true.to_numpy() > 0]
    both = np.concatenate([distinct(frame.d_low).astype(float), distinct(frame.d_high).astype(float)])
    divisors = [float(d) for d in np.unique(both[~np.isnan(both)])]
    return RunSummary(run=run, rows=int(frame.records.sum()), steps=_count_distinct(frame.step.to_numpy()),
                      ranks=int(frame.rank_max.max()) + 1, world_size=sizes, groups=int(frame.grp.nunique()),
                      verdict=verdict_of(findings, judged), normalization=normalization, segments=segments,
                      max_weight_ratio=max_ratio, microbatches=int(frame.m_high.max()),
                      terms=terms, skipped_steps=_count_distinct(skipped_steps), divisors=divisors,
                      weight_range=weight_range, segments_omitted=omitted)


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
