"""The audit: load → aggregate per step → checks → AuditReport. Returns data, never prints."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb
import numpy as np
import numpy.typing as npt
import pandas as pd
import pyarrow.parquet as pq
from pandas.api.types import union_categoricals

from tokaudit.checks import RunSteps, check_run, distinct, without_miscounted, world_sizes
from tokaudit.codes import DEFAULT_RTOL, DEFAULT_SEVERITY, UNDECIDABLE, Code, Severity
from tokaudit.engine import EXTREME_COLUMNS, Engine, Spilled, extremes_at
from tokaudit.normalization import Denominator, name_ranks
from tokaudit.errors import LogFormatError, UsageError
from tokaudit.loading import Loading, LogSet, cores, load
from tokaudit.reader import Shard, inspect_shard
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
              threads: int | None = None, started: Loading | None = None, loaded: LogSet | None = None
              ) -> tuple[LogSet, Engine | None, pd.DataFrame]:
    """`open_log_parts` with the step table whole."""
    logset, engine, steps = open_log_parts(paths, rtol, progress, only_steps, threads, started, loaded=loaded)
    assert isinstance(steps, pd.DataFrame)
    return logset, engine, steps


def load_logs(paths: Sequence[str | os.PathLike[str]], started: Loading | None = None, threads: int | None = None
              ) -> LogSet:
    """The logs' footers validated (`load(paths, thorough=False)`): the load already under way (`started`),
    or one now."""
    # Footers are validated by as many processes as DuckDB has threads: every core unless told
    # (the trackers' audit beside training takes one, and so validates in its own process).
    return started.result() if started is not None else load(paths, thorough=False, workers=threads or cores())


def open_log_parts(paths: Sequence[str | os.PathLike[str]], rtol: float = DEFAULT_RTOL,
                   progress: Progress | None = None, only_steps: tuple[int, int] | None = None,
                   threads: int | None = None, started: Loading | None = None, evidence: bool = False,
                   spill: bool = False, loaded: LogSet | None = None
                   ) -> tuple[LogSet, Engine | None, pd.DataFrame | Spilled]:
    """Load, validate and aggregate. A shard DuckDB cannot decode, or whose values no audit can use, is
    reported and left out.

    Files are validated from their footers; a NaN divisor or scale, which no footer shows, is counted
    by the aggregation, and only the files holding one are then read in full to say where.
    `started`: this load of `paths` already under way (`start_loading(paths, False, ...)`). `evidence`:
    a log of at most EVIDENCE_ROWS records is aggregated with the evidence columns (`engine.EXTREME_COLUMNS`).
    `spill`: a table of more than `engine.SPILL_STEPS` steps is kept on disk a range at a time (`Spilled`,
    which the caller closes). `loaded`: the logs' footers already validated (`load(paths, thorough=False)`),
    which are then not validated again."""
    logset = loaded if loaded is not None else load_logs(paths, started, threads)
    shards = list(logset.shards)
    if only_steps is not None:
        # Files whose footer statistics put every step outside the range are not read at all.
        shards = [s for s in shards if s.may_hold(*only_steps)]
    problems = list(logset.problems)
    rows = sum(s.rows for s in shards)
    large = rows > PROGRESS_ROWS
    if progress and large:
        progress(f"reading {len(shards)} file(s), {rows:,} rows")
    while shards:
        try:
            engine = Engine.open(shards, only_steps=only_steps, threads=threads,
                                 extremes=evidence and rows <= EVIDENCE_ROWS)
            try:
                steps = engine.step_parts(rtol, progress if large else None, spill)
                if (steps.unusable_values.sum() > 0 if isinstance(steps, pd.DataFrame) else steps.unusable > 0):
                    unusable = _unusable(engine.unusable_files())
                    if unusable:
                        engine.close()
                        if isinstance(steps, Spilled):
                            steps.close()
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
    """The thorough check of the shards the aggregation found a NaN divisor or scale or T < n in: one line each."""
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
    return _audit(paths, rtol, runs, progress, live, ignored, min_ratio, keep_steps, threads, started)


def _audit(paths: Sequence[str | os.PathLike[str]], rtol: float, runs: Sequence[str], progress: Progress | None,
           live: bool, ignored: set[Code], min_ratio: float | None, keep_steps: bool, threads: int | None,
           started: Loading | None) -> AuditReport:
    logset, engine, steps = open_log_parts(paths, rtol, progress, threads=threads, started=started, evidence=True,
                                           spill=True)
    problems = [str(p) for p in logset.problems]
    if engine is None:
        return AuditReport(runs=[], findings=[], problems=problems, files=0)
    try:
        parts, names = table_parts(steps), table_runs(steps)
        spilled_names = None if isinstance(steps, pd.DataFrame) else steps.names
        present = sorted(str(name) for name in names)
        if runs:
            unknown = sorted(set(runs) - set(present))
            if unknown:
                raise UsageError(f"no run named {', '.join(map(repr, unknown))} in the logs "
                                 f"(runs: {', '.join(present)})")
            present = [run for run in present if run in runs]
        horizon = engine.complete_through() if live else None
        # The checks need only the step table: DuckDB's memory is given back before they run.
        duplicates = engine.duplicates
        engine.close()
        if horizon is not None and progress:
            left_out = sum(int((~_live(part, horizon)).sum()) for part in selected_runs(parts, present))
            if left_out:
                progress(f"--live: left out {left_out} step(s) not yet recorded by every rank")
        extremes = _Extremes(logset.shards, rtol, threads)
        summaries: list[RunSummary] = []
        findings: list[Finding] = []
        dropped = _dropped_steps(logset.shards)
        for run in present:
            lost = dropped.get(run)
            # Steps that lost records are not judged on the part of their tokens that was kept.
            source = _run_steps(parts, run, horizon, lost, spilled_names)
            if source is None:
                if lost and _run_steps(parts, run, horizon, None) is not None:
                    findings.append(lost.finding(run))
                    summaries.append(RunSummary(run=run, rows=0, steps=0, ranks=0, world_size=[], groups=0,
                                                verdict="inconclusive", normalization=None, segments=[],
                                                max_weight_ratio=1.0, microbatches=0))
                continue
            # Steps whose counts the probe contradicts are left out of the checks and the summary alike.
            source, miscounted = without_miscounted(source, rtol)
            run_findings, spans, omitted = check_run(run, source, rtol, duplicates.get(run), extremes)
            if lost:
                run_findings.append(lost.finding(run))
            if miscounted:
                run_findings.append(miscounted.finding(run))
            run_findings = _policy(run_findings, ignored, min_ratio)
            findings.extend(run_findings)
            value = {d: d.value for d in Denominator}
            segments = [Segment(s.first, s.last, s.steps, value[s.denominator], s.factor, s.group, s.term)
                        for s in spans]
            summaries.append(_summary(run, source, run_findings, segments, omitted))
        findings.sort(key=lambda f: (-f.severity.rank, f.run, f.term != UNNAMED, f.term, _CODE_ORDER[f.code], f.steps.first))
        kept = None
        if keep_steps:  # the same columns whatever the log's size
            kept = _joined([part if horizon is None else part[_live(part, horizon)]
                            for part in selected_runs(parts, present if runs else None)],
                           ordered=isinstance(steps, pd.DataFrame))
            kept = kept.drop(columns=[c for c in EXTREME_COLUMNS if c in kept.columns])
        return AuditReport(runs=summaries, findings=findings, problems=problems, files=len(logset.shards),
                           steps=kept)
    finally:
        engine.close()
        if isinstance(steps, Spilled):
            steps.close()


def _joined(frames: list[pd.DataFrame], ordered: bool) -> pd.DataFrame:
    """The parts of a table as one, as `Engine.step_table` joins its ranges: the names as categories, the
    rows by run, group, term and step. `ordered`: the parts are the engine's whole table (in that order)."""
    if ordered:
        return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if table.empty:
        return table
    for column in ("run", "grp", "term"):
        table[column] = union_categoricals([frame[column].astype(str).astype("category") for frame in frames],
                                           sort_categories=True)
    order = np.lexsort((table.step.to_numpy(), table.term.cat.codes, table.grp.cat.codes, table.run.cat.codes))
    return table.iloc[order].reset_index(drop=True)


def table_parts(table: pd.DataFrame | Spilled) -> Callable[[], Iterable[pd.DataFrame]]:
    """A step table's parts, read again at every call: a table in memory is one part."""
    return (lambda: [table]) if isinstance(table, pd.DataFrame) else table.parts


def table_runs(table: pd.DataFrame | Spilled) -> set[str]:
    """A step table's runs, read from no part of it where it is on disk (its names were noted as it was kept)."""
    return set(table.run.unique()) if isinstance(table, pd.DataFrame) else {run for run, _, _ in table.names}


def selected_runs(parts: Callable[[], Iterable[pd.DataFrame]], runs: list[str] | None) -> Iterator[pd.DataFrame]:
    """The parts' rows of these runs (all when None): a part of no other run as it is."""
    for part in parts():
        mine = None if runs is None else name_ranks(part.run, runs) >= 0  # each distinct name once
        yield part if mine is None or mine.all() else part[mine].reset_index(drop=True)


def _live(part: pd.DataFrame, horizon: dict[tuple[str, str], int]) -> npt.NDArray[np.bool_]:
    """`--live`: the rows of steps every rank of their run and group has recorded. Each distinct (run,
    group) is looked up once: this runs on every part at every pass."""
    codes, pairs = pd.MultiIndex.from_arrays([part.run, part.grp]).factorize()
    limit = np.array([horizon.get((str(run), str(group)), -1) for run, group in pairs], dtype=np.int64)
    keep: npt.NDArray[np.bool_] = part.step.to_numpy() <= limit[codes]
    return keep


def _run_steps(parts: Callable[[], Iterable[pd.DataFrame]], run: str,
               horizon: dict[tuple[str, str], int] | None, lost: _Dropped | None,
               names: set[tuple[str, str, str]] | None = None) -> RunSteps | None:
    """One run's table in parts, its steps not yet complete (`--live`) and those that lost records left out;
    None when nothing is left. The table itself when it is one part of one run and nothing is left out.
    `names`: every (run, group, term) of the table, which spares a pass when nothing is left out."""
    def selected() -> Iterator[pd.DataFrame]:
        for rows in selected_runs(parts, [run]):
            keep = np.ones(len(rows), dtype=bool)
            if horizon is not None:
                keep &= _live(rows, horizon)
            if lost:
                keep &= ~lost.covers(rows)
            if not keep.all():
                rows = rows[keep].reset_index(drop=True)
            if len(rows):
                yield rows

    groups: set[str] = set()
    terms: set[str] = set()
    if names is not None and horizon is None and not lost:
        groups = {g for r, g, _ in names if r == run}
        terms = {t for r, _, t in names if r == run}
    for rows in selected() if not groups else ():
        groups.update(str(g) for g in rows.grp.unique())
        terms.update(str(t) for t in rows.term.unique())
    if not groups:
        return None
    return RunSteps(selected, sorted(groups), sorted(terms, key=lambda t: (t != UNNAMED, t)))


@dataclass
class _Extremes:
    """Where the heaviest and the lightest token of an evidence step were (`engine.EXTREME_COLUMNS`),
    aggregated for that step alone when a finding asks: a few steps, instead of every step's."""

    shards: Sequence[Shard]
    rtol: float
    threads: int | None
    found: dict[tuple[int, tuple[str, str, str]], pd.DataFrame] = field(default_factory=dict)

    def __call__(self, row: Any) -> Any:
        step = int(row.step)
        names = (str(row.run), str(row.grp), str(row.term))
        if (step, names) not in self.found:
            # Only the files that may hold this (run, group, term): of a run of 16 data-parallel groups, a
            # sixteenth of the step's records, read again for each group's finding.
            shards = [s for s in self.shards if s.names is None or s.names == names]
            try:
                self.found[step, names] = extremes_at(shards, step, self.rtol, self.threads)
            except duckdb.Error as error:
                raise LogFormatError(self._where(), f"could not be read again for the evidence of step {step} "
                                                    f"({str(error).splitlines()[0][:160]})") from None
        table = self.found[step, names]
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


def _summary(run: str, source: RunSteps, findings: list[Finding], segments: list[Segment],
             omitted: int = 0) -> RunSummary:
    # The run's parts read a block of steps at a time, never a filtered copy of the table (millions of
    # steps) nor a Python float per step. Parts hold disjoint ranges of steps: distinct steps add up.
    judged = False
    ratio_seen, ratio, unbounded = False, -math.inf, False
    ratios_exist = weighted_any = False
    q_low, q_high = _Extreme(), _Extreme()
    rows = steps = skipped_steps = 0
    ranks, microbatches = -1, -math.inf
    divisors: set[float] = set()
    sizes: set[int] = set()
    for part in source.parts():
        sizes.update(world_sizes(part))
        rows += int(part.records.sum())
        steps += _count_distinct(part.step.to_numpy())
        skipped_steps += _count_distinct(part.step.to_numpy()[part.skipped_true.to_numpy() > 0])
        ranks = max(ranks, int(part.rank_max.max()))
        microbatches = max(microbatches, float(part.m_high.max()))
        both = np.concatenate([distinct(part.d_low).astype(float), distinct(part.d_high).astype(float)])
        divisors.update(float(d) for d in both[~np.isnan(both)])
        weighted_all = part.weighted_records.to_numpy() > 0
        weighted_any = weighted_any or bool(weighted_all.any())
        tokens_all = part.tokens.to_numpy()
        low_all, high_all = part.tok_low.to_numpy(dtype=float), part.tok_high.to_numpy(dtype=float)
        for start in range(0, len(part), SUMMARY_BLOCK):
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
    weight_range = (q_low.value(), -q_high.value()) if weighted_any else None
    terms = source.terms
    main = [s for s in segments if s.term == terms[0]]
    normalization = max(main, key=lambda s: s.steps) if main else None
    return RunSummary(run=run, rows=rows, steps=steps, ranks=ranks + 1, world_size=sorted(sizes), groups=len(source.groups),
                      verdict=verdict_of(findings, judged), normalization=normalization, segments=segments,
                      max_weight_ratio=max_ratio, microbatches=max(int(microbatches), 0) if rows else 0,
                      terms=terms, skipped_steps=skipped_steps, divisors=sorted(divisors),
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
