"""The audit: load → aggregate per step → checks → AuditReport. Returns data, never prints."""

from __future__ import annotations

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

from tokaudit._checks import RunSteps, check_run, main_term_first, one_objective, without_miscounted
from tokaudit.codes import DEFAULT_RTOL, Code, code_named
from tokaudit._engine import EVIDENCE, Duplicates, Engine, Spilled, extremes_at, sweep_scratch
from tokaudit.errors import LogFormatError, UsageError
from tokaudit._cluster import Cluster
from tokaudit._loading import Loading, LogSet, cores, load, start_loading
from tokaudit._normalization import Denominator, name_ranks
from tokaudit._reader import Shard, inspect_shard
from tokaudit._report import AuditReport, Finding, RunSummary, Segment
from tokaudit._schema import UNNAMED, Provenance
from tokaudit._summary import DroppedRecords, apply_policy, dropped_steps, run_summary, setups_of


Progress = Callable[[str], None]

PROGRESS_ROWS = 1_000_000
"""Logs larger than this say on stderr what is being read."""

EVIDENCE_ROWS = 1_000_000
"""Logs of at most this many records aggregate every step's evidence columns (`engine.EVIDENCE`:
where its heaviest and lightest token were) in the one query: a little more of a short query, where each
finding's step aggregated again alone costs a DuckDB connection and a query of its own. Larger logs
aggregate them for a finding's step only (`_Extremes`): over every step they would cost a tenth of the
query and 48 bytes a step."""

_CODE_ORDER = {code: index for index, code in enumerate(Code)}

def open_logs(paths: Sequence[str | os.PathLike[str]],
              progress: Progress | None = None, only_steps: tuple[int, int] | None = None,
              threads: int | None = None, started: Loading | None = None, loaded: LogSet | None = None
              ) -> tuple[LogSet, Engine | None, pd.DataFrame]:
    """`open_log_parts` with the step table whole."""
    logset, engine, steps = open_log_parts(paths, progress, only_steps, threads, started, loaded=loaded)
    assert isinstance(steps, pd.DataFrame)
    return logset, engine, steps

def load_logs(paths: Sequence[str | os.PathLike[str]], started: Loading | None = None, threads: int | None = None,
              cluster: Cluster | None = None) -> LogSet:
    """The logs' footers validated (`load(paths, thorough=False)`): the load already under way (`started`),
    or one now."""
    # Footers are validated by as many processes as DuckDB has threads: every core unless told
    # (the trackers' audit beside training takes one, and so validates in its own process).
    if cluster is not None:  # the footers read on its workers
        with started or start_loading(paths, thorough=False) as found:
            return cluster.load(found)
    return started.result() if started is not None else load(paths, thorough=False, workers=threads or cores())

def open_log_parts(paths: Sequence[str | os.PathLike[str]],
                   progress: Progress | None = None, only_steps: tuple[int, int] | None = None,
                   threads: int | None = None, started: Loading | None = None, evidence: bool = False,
                   spill: bool = False, loaded: LogSet | None = None, cluster: Cluster | None = None
                   ) -> tuple[LogSet, Engine | None, pd.DataFrame | Spilled]:
    """Load, validate and aggregate. A shard DuckDB cannot decode, or whose values no audit can use, is
    reported and left out.

    Files are validated from their footers; a NaN divisor or scale, which no footer shows, is counted
    by the aggregation, and only the files holding one are then read in full to say where.
    `started`: this load of `paths` already under way (`start_loading(paths, False, ...)`). `evidence`:
    a log of at most EVIDENCE_ROWS records is aggregated with the evidence columns (`engine.EVIDENCE`).
    `spill`: a table of more than `engine.SPILL_STEPS` steps is kept on disk a range at a time (`Spilled`,
    which the caller closes). `loaded`: the logs' footers already validated (`load(paths, thorough=False)`),
    which are then not validated again. `cluster`: the footers and the step ranges are read and aggregated on its
    workers (`tokaudit._cluster`)."""
    logset = loaded if loaded is not None else load_logs(paths, started, threads, cluster)
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
                                 extremes=evidence and rows <= EVIDENCE_ROWS, ranges_map=cluster.map if cluster else None)
            try:
                steps = engine.step_parts(progress if large else None, spill)
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
        except duckdb.InterruptException:
            raise KeyboardInterrupt from None  # Ctrl-C inside a query: the user's, never a shard's fault
        except duckdb.Error as error:
            broken = _undecodable(shards)
            if not broken and isinstance(error, duckdb.OutOfMemoryException):
                # every file decodes: the limit is too small for this log, which is no file's fault
                raise UsageError(f"DuckDB ran out of memory under its limit ({str(error).splitlines()[0][:200]}); "
                                 "raise TOKAUDIT_MEMORY_LIMIT (default 512MB) or lower TOKAUDIT_CHUNK_ROWS") from None
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
          threads: int | None = None, ray: str | None = None) -> AuditReport:
    """Audit every run under `paths`. Unreadable files become `problems`; the rest is still audited.

    `live`: the logs are still being written, so steps after the last one every rank has recorded
    are left out instead of being reported as missing ranks. `ignore`: finding codes to leave out.
    `min_ratio`: a weighting finding whose heaviest token weighs less than this many times the
    lightest is information, not an error (verdicts follow). `keep_steps`: keep the per-step table
    in `report.steps`. `threads`: DuckDB's worker threads (default: every core); an audit running
    beside training (the trackers' audit) takes one. `ray`: the address of a Ray cluster (`auto`: one running on
    this machine) whose workers read the footers and aggregate the step ranges (`tokaudit._cluster`; the report is
    the one process's, bit for bit).
    """
    return audit_started(paths, None, None, rtol, runs, progress, live, ignore, min_ratio, keep_steps, threads, ray)

def audit_started(paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str], started: Loading | None,
                  then: Callable[[AuditReport, AuditedLog], None] | None, rtol: float = DEFAULT_RTOL,
                  runs: Sequence[str] = (), progress: Progress | None = None, live: bool = False,
                  ignore: Sequence[str | Code] = (), min_ratio: float | None = None, keep_steps: bool = False,
                  threads: int | None = None, ray: str | None = None) -> AuditReport:
    """`audit`, as the command line runs it: `started`, the validation of `paths` already under way
    (`start_loading(paths, thorough=False, ...)`, which it starts before it imports the auditor); `then`, called
    with the report and what it was computed from before that is closed (the HTML report's figures,
    `figures.run_figures`, drawn from the same aggregation)."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    if not (0 < rtol < 1):
        raise UsageError(f"--rtol must be between 0 and 1, got {rtol}")
    if min_ratio is not None and not min_ratio >= 1:
        raise UsageError(f"--min-ratio must be at least 1, got {min_ratio}")
    try:
        ignored = {code_named(code) for code in ignore}
    except ValueError as error:
        raise UsageError(f"--ignore: {error}; `tokaudit explain` lists the codes") from None
    cluster = Cluster.connect(ray) if ray is not None else None
    try:
        return _audit(paths, rtol, runs, progress, live, ignored, min_ratio, keep_steps, threads, started, then, cluster)
    finally:
        if cluster is not None:
            cluster.close()

def _audit(paths: Sequence[str | os.PathLike[str]], rtol: float, runs: Sequence[str], progress: Progress | None,
           live: bool, ignored: set[Code], min_ratio: float | None, keep_steps: bool, threads: int | None,
           started: Loading | None, then: Callable[[AuditReport, AuditedLog], None] | None,
           cluster: Cluster | None) -> AuditReport:
    sweep_scratch()  # what audits killed before their clean-up left behind
    logset, engine, steps = open_log_parts(paths, progress, threads=threads, started=started, evidence=True,
                                           spill=True, cluster=cluster)
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
        duplicates, precision = engine.duplicates, engine.precision
        engine.close()
        if horizon is not None and progress:
            left_out = sum(int((~_live(part, horizon)).sum()) for part in selected_runs(parts, present))
            if left_out:
                progress(f"--live: left out {left_out} step(s) not yet recorded by every rank")
        extremes = _Extremes(logset.shards, threads)
        summaries: list[RunSummary] = []
        findings: list[Finding] = []
        dropped = dropped_steps(logset.shards)
        setups = setups_of(logset.shards)
        of_run = runs_apart(steps, parts, present)
        for run in present:
            lost = dropped.get(run)
            source = _run_steps(of_run(run), run, horizon, lost, spilled_names)
            had_steps = source is not None or (
                lost is not None and _run_steps(of_run(run), run, horizon, None) is not None)
            run_findings, summary = _audit_run(run, source, lost, had_steps, (rtol, precision.get(run)),
                                               duplicates.get(run), extremes, ignored, min_ratio, setups.get(run, Provenance()))
            findings.extend(run_findings)
            if summary is not None:
                summaries.append(summary)
        findings.sort(key=lambda f: (-f.severity.rank, f.run, f.term != UNNAMED, f.term, _CODE_ORDER[f.code], f.steps.first))
        kept = _kept(parts, present if runs else None, horizon, ordered=isinstance(steps, pd.DataFrame)) \
            if keep_steps else None
        report = AuditReport(runs=summaries, findings=findings, problems=problems, files=len(logset.shards),
                             steps=kept, ignored=sorted(code.value for code in ignored))
        if then is not None:
            then(report, AuditedLog(logset.shards, duplicates, steps))
        return report
    finally:
        engine.close()
        if isinstance(steps, Spilled):
            steps.close()

@dataclass(frozen=True)
class AuditedLog:
    """What an audit was computed from, handed to `audit_started`'s `then` before it is closed."""

    shards: list[Shard]
    """The shards audited (those no audit could use left out)."""
    duplicates: dict[str, Duplicates]
    """The repeated keys the aggregation found and left out (`Engine.duplicates`)."""
    steps: pd.DataFrame | Spilled
    """The step table of every run, whole or on disk a range at a time."""

def _kept(parts: Callable[[], Iterable[pd.DataFrame]], runs: list[str] | None,
          horizon: dict[tuple[str, str], int] | None, ordered: bool) -> pd.DataFrame:
    """`keep_steps`' table of these runs (all when None): the same columns whatever the log's size."""
    kept = _joined([part if horizon is None else part[_live(part, horizon)] for part in selected_runs(parts, runs)],
                   ordered=ordered)
    return kept.drop(columns=[c for c in EVIDENCE if c in kept.columns])

def _audit_run(run: str, source: RunSteps | None, lost: DroppedRecords | None, had_steps: bool,
               tolerance: tuple[float, int | None], duplicates: Duplicates | None,
               extremes: _Extremes, ignored: set[Code], min_ratio: float | None, provenance: Provenance
               ) -> tuple[list[Finding], RunSummary | None]:
    """One run's findings and summary. `source`: its steps, less those whose records were dropped (`lost`);
    `had_steps`: whether it had any before they were left out. `tolerance`: --rtol and the fewest significant
    bits the run's records were computed in (None: not said), which set the tolerance it is judged at."""
    bits = tolerance[1]
    rtol = judged_rtol(*tolerance)
    if source is None:
        # Steps that lost records are not judged on the part of their tokens that was kept.
        if lost and had_steps:
            return [lost.finding(run)], RunSummary(run=run, rows=0, steps=0, ranks=0, world_size=[], groups=0,
                                                   verdict="inconclusive", normalization=None, segments=[],
                                                   max_weight_ratio=1.0, microbatches=0, precision_bits=bits,
                                                   rtol=rtol)
        return [], None
    # Steps whose counts the probe contradicts are left out of the checks and the summary alike.
    source, miscounted = without_miscounted(source, rtol)
    objective = one_objective(source, rtol)
    run_findings, spans, omitted = check_run(run, source, rtol, duplicates, extremes, provenance, objective)
    if lost:
        run_findings.append(lost.finding(run))
    if miscounted:
        run_findings.append(miscounted.finding(run))
    # The verdict is a claim about the gradient: it reads every finding. --ignore leaves some out of the listing
    # and of what fails the command (`gate_verdict`), never out of the verdict.
    run_findings = apply_policy(run_findings, min_ratio)
    listed = [f for f in run_findings if f.code not in ignored]
    value = {d: d.value for d in Denominator}
    segments = [Segment(s.first, s.last, s.steps, value[s.denominator], s.factor, s.group, s.term) for s in spans]
    summary = run_summary(run, source, run_findings, segments, omitted, pooled=objective is not None, listed=listed)
    return listed, replace(summary, precision_bits=bits, rtol=rtol, terms_pooled=objective is not None,
                           ignored=sorted({f.code.value for f in run_findings if f.code in ignored}))


def judged_rtol(rtol: float, bits: int | None) -> float:
    """The tolerance a run is judged at: --rtol, or what its coarsest precision rounds, whichever is larger.
    A value computed in p significant bits is off by up to u = 2⁻ᵖ from its last rounding (b, or the probe's
    ∂b/∂ℓ), and a ratio of two such weights by 2u = 2^(1−p): 2⁻⁷ in bfloat16, 2⁻¹⁰ in float16, 2⁻²³ in float32
    (below the default --rtol). No wider: a weight off by more than its rounding is a finding, not noise."""
    return rtol if bits is None else max(rtol, 2.0 ** (1 - bits))

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

def runs_apart(table: pd.DataFrame | Spilled, parts: Callable[[], Iterable[pd.DataFrame]], runs: list[str]
               ) -> Callable[[str], Callable[[], Iterable[pd.DataFrame]]]:
    """Per run, its parts of the table (`parts`): a table in memory is split once, by run, so that the checks'
    many passes over one run each read that run's rows, not the whole table's; one on disk is read as it is."""
    if not isinstance(table, pd.DataFrame):
        return lambda run: parts
    apart = {run: next(selected_runs(parts, [run])) for run in runs}
    return lambda run: (lambda: [apart[run]])

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
               horizon: dict[tuple[str, str], int] | None, lost: DroppedRecords | None,
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
    return RunSteps(selected, sorted(groups), main_term_first(terms))

@dataclass
class _Extremes:
    """Where the heaviest and the lightest token of an evidence step were (`engine.EVIDENCE`),
    aggregated for that step alone when a finding asks: a few steps, instead of every step's."""

    shards: Sequence[Shard]
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
                self.found[step, names] = extremes_at(shards, step, self.threads)
            except duckdb.InterruptException:
                raise KeyboardInterrupt from None
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
