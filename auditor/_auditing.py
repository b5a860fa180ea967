"""The audit: load → aggregate per step → checks → AuditReport. Returns data, never prints."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from tokaudit._checks import (
    WEIGHED_WRONG,
    Replaced,
    check_run,
    one_objective,
    with_other_ranks,
    with_replaced,
    with_unread_files,
)
from tokaudit._checks import RunSteps, without_miscounted
from tokaudit.codes import DEFAULT_RTOL, Code, Severity
from tokaudit._settings import BOUNDS, code_named, within
from tokaudit._engine import Duplicates, Spilled, extremes_at, rounded_precision, sweep_scratch
from tokaudit.errors import LogFormatError, UsageError, first_line
from tokaudit._cluster import Cluster
from tokaudit._loading import Loading, LogSet
from tokaudit._opening import Progress, open_log_parts
from tokaudit._normalization import Denominator
from tokaudit._reader import Shard
from tokaudit._report import AuditReport, Finding, RunSummary, Segment
from tokaudit._schema import UNNAMED, Provenance
from tokaudit._cut import unsynced_end
from tokaudit._ends import FooterEnds, both_ends, recorded_end, uneven_ends
from tokaudit._step_parts import kept_steps, live_rows, run_steps, runs_apart, selected_runs, table_parts, table_runs
from tokaudit._summary import DroppedRecords, apply_policy, dropped_steps, run_summary, setups_of, stored_precision
from tokaudit._summary import class_weighted, guessed_updates, unfinished_finding, unread_files, within_roundings


_CODE_ORDER = {code: index for index, code in enumerate(Code)}


def audit(
    paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    rtol: float = DEFAULT_RTOL,
    runs: Sequence[str] = (),
    progress: Progress | None = None,
    live: bool = False,
    ignore: Sequence[str | Code] = (),
    min_ratio: float | None = None,
    keep_steps: bool = False,
    threads: int | None = None,
    ray: str | None = None,
) -> AuditReport:
    """Audit every run under `paths`. Unreadable files become `problems`; the rest is still audited.

    `progress`: told what the audit reads, as a line of text or, while it aggregates, an `Aggregating` (its `done`,
    0 to 1; `str()` of it, a line) as each step range starts and about five times a second as it runs.
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


def audit_started(
    paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    started: Loading | None,
    then: Callable[[AuditReport, AuditedLog], None] | None,
    rtol: float = DEFAULT_RTOL,
    runs: Sequence[str] = (),
    progress: Progress | None = None,
    live: bool = False,
    ignore: Sequence[str | Code] = (),
    min_ratio: float | None = None,
    keep_steps: bool = False,
    threads: int | None = None,
    ray: str | None = None,
) -> AuditReport:
    """`audit`, as the command line runs it: `started`, the validation of `paths` already under way
    (`start_loading(paths, thorough=False, ...)`, which it starts before it imports the auditor); `then`, called
    with the report and what it was computed from before that is closed (the HTML report's figures,
    `figures.run_figures`, drawn from the same aggregation)."""
    # one path, run or code given alone is one, not a sequence of its characters
    paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not paths:  # (an empty glob's list: nothing read would pass a gate on the verdicts)
        raise UsageError("no path to audit: give a folder, a file or a URL")
    runs, ignore = [runs] if isinstance(runs, str) else runs, [ignore] if isinstance(ignore, str) else ignore
    if isinstance(rtol, bool) or not isinstance(rtol, int | float) or not within("rtol", rtol):
        raise UsageError(f"--rtol must be {BOUNDS['rtol']} (a relative tolerance, 1e-4 by default), got {rtol!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024):
        raise UsageError(f"threads must be a whole number from 1 to 1024 (None: every core), got {threads!r}")
    if min_ratio is not None and not within("min-ratio", min_ratio):
        raise UsageError(f"--min-ratio must be a finite number {BOUNDS['min-ratio']}, got {min_ratio}")
    try:
        ignored = {code_named(code) for code in ignore}
    except ValueError as error:
        raise UsageError(f"--ignore: {error}; `tokaudit explain` lists the codes") from None
    cluster = Cluster.connect(ray) if ray is not None else None
    try:
        judging = _Judging(rtol, ignored, min_ratio)
        # A log's NaN, inf or 1e308 is data the checks look for and weigh, not a fault of their arithmetic: numpy's
        # warnings about them would be lines of tokaudit's source among the report's.
        with np.errstate(all="ignore"):
            return _audit(paths, judging, runs, progress, live, keep_steps, threads, started, then, cluster)
    finally:
        if cluster is not None:
            cluster.close()


def _audit(
    paths: Sequence[str | os.PathLike[str]],
    judging: _Judging,
    runs: Sequence[str],
    progress: Progress | None,
    live: bool,
    keep_steps: bool,
    threads: int | None,
    started: Loading | None,
    then: Callable[[AuditReport, AuditedLog], None] | None,
    cluster: Cluster | None,
) -> AuditReport:
    sweep_scratch()  # what audits killed before their clean-up left behind
    logset, engine, steps = open_log_parts(
        paths, progress, threads=threads, started=started, evidence=True, spill=True, cluster=cluster
    )
    problems = [str(p) for p in logset.problems]
    if engine is None:
        return AuditReport(runs=[], findings=[], problems=problems, files=0)
    try:
        parts, names = table_parts(steps), table_runs(steps)
        named = None if isinstance(steps, pd.DataFrame) else steps.names  # on disk: its names, noted as kept
        present = _asked(names, runs)
        horizon = engine.complete_through() if live else None
        # The checks need only the step table: DuckDB's memory is given back before they run.
        duplicates, precision = engine.duplicates, dict(engine.precision)
        precision.update({r: min(precision.get(r, b), b) for r, b in stored_precision(logset.shards).items()})
        rounded = rounded_precision(engine.rounded)
        engine.close()
        if horizon is not None and progress:
            _say_left_out(parts, present, horizon, progress)
        # where no step lacks a synchronization, no run ended inside an update unsynced (`unsynced_end`): no pass
        unsynced = steps.unsynced > 0 if isinstance(steps, Spilled) else bool((steps.unsynced_ranks > 0).any())
        judge = _RunJudge.of(logset, judging, horizon, named, duplicates, precision, threads, rounded, unsynced)
        summaries, findings = judge.runs(present, runs_apart(steps, parts, present))
        asked = present if runs else None
        kept = kept_steps(parts, asked, horizon, ordered=isinstance(steps, pd.DataFrame)) if keep_steps else None
        report = AuditReport(
            runs=summaries,
            findings=findings,
            problems=problems,
            files=len(logset.shards),
            steps=kept,
            ignored=sorted(code.value for code in judging.ignored),
        )
        if then is not None:
            then(report, AuditedLog(logset.shards, duplicates, steps))
        return report
    finally:
        engine.close()
        if isinstance(steps, Spilled):
            steps.close()


def _say_left_out(
    parts: Callable[[], Iterable[pd.DataFrame]],
    present: list[str],
    horizon: dict[tuple[str, str], int],
    progress: Progress,
) -> None:
    """`--live`: how many steps of these runs are left out, not yet recorded by every rank."""
    left_out = sum(int((~live_rows(part, horizon)).sum()) for part in selected_runs(parts, present))
    if left_out:
        progress(f"--live: left out {left_out} step(s) not yet recorded by every rank")


def _asked(names: set[str], runs: Sequence[str]) -> list[str]:
    """The runs to audit, in order: those asked for (all when none is), each of them in the logs."""
    present = sorted(str(name) for name in names)
    if runs:
        unknown = sorted(set(runs) - set(present))
        if unknown:
            raise UsageError(f"no run named {', '.join(map(repr, unknown))} in the logs (runs: {', '.join(present)})")
        present = [run for run in present if run in runs]
    return present


@dataclass(frozen=True)
class AuditedLog:
    """What an audit was computed from, handed to `audit_started`'s `then` before it is closed."""

    shards: list[Shard]
    """The shards audited (those no audit could use left out)."""
    duplicates: dict[str, Duplicates]
    """The repeated keys the aggregation found and left out (`Engine.duplicates`)."""
    steps: pd.DataFrame | Spilled
    """The step table of every run, whole or on disk a range at a time."""


@dataclass(frozen=True)
class _Judging:
    """How the runs are judged and listed: --rtol, --ignore and --min-ratio."""

    rtol: float
    ignored: set[Code]
    min_ratio: float | None


@dataclass(frozen=True)
class _RunJudge:
    """What every run of one audit is judged with: the audit's choices, and what the aggregation and the footers
    found, per run."""

    judging: _Judging
    horizon: dict[tuple[str, str], int] | None
    """`--live`: per (run, group), the last step every rank has recorded."""
    names: set[tuple[str, str, str]] | None
    """Every (run, group, term) of a table kept on disk (noted as it was kept): spares a pass."""
    duplicates: dict[str, Duplicates]
    """The repeated keys the aggregation left out (`Engine.duplicates`)."""
    precision: dict[str, int]
    """The fewest significant bits the records say they were computed in (`Engine.precision`)."""
    dropped: dict[str, DroppedRecords]
    """The records the recorder could not write (`dropped_steps`)."""
    setups: dict[str, Provenance]
    extremes: _Extremes
    ends: FooterEnds | None
    """Where the footers say each run's ranks stopped (`uneven_ends`); the others' ends are read from their records
    (`recorded_end`). None with --live, which leaves every step not yet complete out."""
    unread: dict[str, list[str]]
    """The files in each run's folder that could not be read (`unread_files`)."""
    replaced: dict[str, Replaced]
    """Per run a later launch of which recorded steps again: its earlier launches' records judged alone (`_replaced`)."""
    rounded: dict[str, int]
    """Per run: the bits every backward scalar of rank 0 holds, bfloat16's or float16's (`rounded_precision`), read
    where the run says nothing of its precision. Round numbers hold them too (integer losses), so they make no error vanish
    at that precision: they make one within two of its roundings say the logs cannot tell (`within_roundings`)."""
    unsynced: bool
    """Some step of the log lacks a synchronization: a run may have ended inside its last update (`unsynced_end`)."""

    @classmethod
    def of(
        cls,
        logset: LogSet,
        judging: _Judging,
        horizon: dict[tuple[str, str], int] | None,
        names: set[tuple[str, str, str]] | None,
        duplicates: dict[str, Duplicates],
        precision: dict[str, int],
        threads: int | None,
        rounded: dict[str, int],
        unsynced: bool,
    ) -> _RunJudge:
        """The judge of an audit's runs, with what the footers of its shards say."""
        shards = logset.shards
        return cls(
            judging,
            horizon,
            names,
            duplicates,
            precision,
            dropped_steps(shards),
            setups_of(shards),
            _Extremes(shards, threads),
            None if horizon is not None else uneven_ends(shards),  # --live: steps not yet complete are left out
            unread_files(shards, logset.problems),
            _replaced(shards, duplicates, judging, threads),
            rounded,
            unsynced,
        )

    def runs(
        self, present: list[str], of_run: Callable[[str], Callable[[], Iterable[pd.DataFrame]]]
    ) -> tuple[list[RunSummary], list[Finding]]:
        """Each run's summary, and every run's findings, the most severe first."""
        summaries: list[RunSummary] = []
        findings: list[Finding] = []
        for run in present:
            run_findings, summary = self.run(run, of_run(run))
            findings.extend(run_findings)
            if summary is not None:
                summaries.append(summary)
        findings = with_other_ranks(findings)
        findings.sort(
            key=lambda f: (-f.severity.rank, f.run, f.term != UNNAMED, f.term, _CODE_ORDER[f.code], f.steps.first)
        )
        return summaries, findings

    def run(self, run: str, parts: Callable[[], Iterable[pd.DataFrame]]) -> tuple[list[Finding], RunSummary | None]:
        """One run's findings and summary, judged at the tolerance its precision allows (`judged_rtol`). Its steps
        that lost records are left out, and not judged on the part of their tokens that was kept."""
        bits, lost = self.precision.get(run), self.dropped.get(run)
        rtol = judged_rtol(self.judging.rtol, bits)
        # the update the run stopped inside (its recorder said so) is left out, unless it is all there is
        stopped, ended = self.setups.get(run, Provenance()).unfinished, None
        cut = False  # or as its records show it: its last update cut short, unsynchronized, never said applied
        if stopped is None and self.unsynced:
            stopped = unsynced_end(selected_runs(parts, [run]))
            cut = stopped is not None
        if self.ends is not None:  # the groups the footers leave unsettled: from the records
            from_records = recorded_end(run, lambda: selected_runs(parts, [run]), self.ends)
            ended = both_ends(self.ends.found.get(run), from_records)
        source = run_steps(parts, run, self.horizon, lost, self.names, stopped, ended)
        whole = (
            run_steps(parts, run, self.horizon, lost, self.names) if source is None and stopped is not None else None
        )
        if whole is not None and stopped is not None:
            # the run stopped inside its only update: part of its microbatches, never stepped, is nothing to judge
            said = [unfinished_finding(run, stopped, cut)]
            said = with_unread_files(run, said, self.unread[run], whole) if run in self.unread else said
            return said, _unjudged_summary(run, bits, rtol)
        if source is None and ended is not None:
            ended, source = None, run_steps(parts, run, self.horizon, lost, self.names)
        if source is None:
            had_steps = lost is not None and run_steps(parts, run, self.horizon, None) is not None
            return ([lost.finding(run)], _unjudged_summary(run, bits, rtol)) if lost and had_steps else ([], None)
        # Steps whose counts the probe contradicts are left out of the checks and the summary alike.
        source, miscounted = without_miscounted(source, rtol)
        objective = one_objective(source, rtol)
        run_findings, spans, omitted = check_run(
            run, source, rtol, self.duplicates.get(run), self.extremes, self._provenance(run), objective
        )
        if lost:
            run_findings.append(lost.finding(run))
        if miscounted:
            run_findings.append(miscounted.finding(run))
        if stopped is not None:
            run_findings.append(unfinished_finding(run, stopped, cut))
        if ended is not None:
            run_findings.append(ended.finding(run))
        run_findings = self._cannot_tell(run, run_findings, source, bits)
        # The verdict is a claim about the gradient: it reads every finding as found. --min-ratio makes some
        # information and --ignore leaves some out, in the listing and in what fails the command (`gate_verdict`),
        # never in the verdict.
        gated = apply_policy(run_findings, self.judging.min_ratio)
        listed = [f for f in gated if f.code not in self.judging.ignored]
        value = {d: d.value for d in Denominator}
        segments = [Segment(s.first, s.last, s.steps, value[s.denominator], s.factor, s.group, s.term) for s in spans]
        summary = run_summary(run, source, run_findings, segments, omitted, pooled=objective is not None, listed=listed)
        return listed, replace(
            summary,
            precision_bits=bits,
            rtol=rtol,
            terms_pooled=objective is not None,
            ignored=sorted({f.code.value for f in run_findings if f.code in self.judging.ignored}),
        )

    def _provenance(self, run: str) -> Provenance:
        """What the run's shards say of how it was recorded, with the ranks closed while the others went on."""
        joined = self.ends.joined.get(run, ()) if self.ends is not None else ()
        return replace(self.setups.get(run, Provenance()), joined=joined)

    def _cannot_tell(self, run: str, findings: list[Finding], source: RunSteps, bits: int | None) -> list[Finding]:
        """The run's findings with what the logs cannot tell said so: updates' ends guessed, files unread, an earlier
        launch replaced, weights apart by no more than the run's precision rounds twice."""
        if self.setups.get(run, Provenance()).steps_inferred:
            findings = guessed_updates(run, findings, source, judged_rtol(self.judging.rtol, bits))
        if self.setups.get(run, Provenance()).class_weights:
            findings = class_weighted(findings, source, judged_rtol(self.judging.rtol, bits))
        if run in self.unread:
            findings = with_unread_files(run, findings, self.unread[run], source)
        if run in self.replaced:
            findings = with_replaced(findings, self.replaced[run])
        # a run that says no precision is judged at float32's; its b may still have been rounded coarser
        return within_roundings(findings, bits if bits is not None else self.rounded.get(run))


def _replaced(
    shards: list[Shard], duplicates: dict[str, Duplicates], judging: _Judging, threads: int | None
) -> dict[str, Replaced]:
    """Per run whose steps were recorded again with other values (the later published kept, `publication_order`):
    the normalization errors of the copies left out, judged alone by an audit of the files that hold them (their
    steps may lack a rank that stopped first, so only what says their tokens were weighed wrong counts)."""
    found: dict[str, Replaced] = {}
    where = {
        str(s.path): str(s.path) if s.store is None else s.store.url(s.path) for s in shards
    }  # (a URL for a store)
    for run, repeated in duplicates.items():
        earlier = [where[path] for path in repeated.left_out if path in where]
        if repeated.identical or repeated.one_file or not earlier:
            continue
        report = audit(earlier, rtol=judging.rtol, threads=threads)
        wrong = {f.code.value for f in report.findings if f.run == run and _weighed_wrong(f)}
        contiguous = repeated.steps == repeated.last - repeated.first + 1
        steps = (repeated.first, repeated.last) if contiguous else None
        unread = bool(report.problems)
        found[run] = Replaced(tuple(sorted(wrong)), ordered=not repeated.unlaunched, steps=steps, unread=unread)
    return found


def _weighed_wrong(finding: Finding) -> bool:
    """A finding of records judged alone that says they weigh their tokens wrong, or may: a normalization's error,
    or one the logs cannot tell (an earlier launch's own copies, judged alone in turn, that weigh them wrong)."""
    may = finding.undecidable and (finding.code in WEIGHED_WRONG or finding.code is Code.DUPLICATE_RECORDS)
    return may or (finding.severity is Severity.ERROR and finding.code in WEIGHED_WRONG)


def _unjudged_summary(run: str, bits: int | None, rtol: float) -> RunSummary:
    """The summary of a run none of whose steps is judged (each lost records, or the run stopped inside its only
    update): inconclusive."""
    return RunSummary(
        run=run,
        rows=0,
        steps=0,
        ranks=0,
        world_size=[],
        groups=0,
        verdict="inconclusive",
        normalization=None,
        segments=[],
        max_weight_ratio=1.0,
        microbatches=0,
        precision_bits=bits,
        rtol=rtol,
    )


def judged_rtol(rtol: float, bits: int | None) -> float:
    """The tolerance a run is judged at: --rtol, or what its coarsest precision rounds, whichever is larger.
    A value computed in p significant bits is off by up to u = 2⁻ᵖ from its last rounding (b, or the probe's
    ∂b/∂ℓ), and a ratio of two such weights by 2u = 2^(1−p): 2⁻⁷ in bfloat16, 2⁻¹⁰ in float16, 2⁻²³ in float32
    (below the default --rtol). No wider: a weight off by more than its rounding is a finding, not noise. A run whose
    records do not say is float32's (the log format's rule), so no --rtol judges it finer than float32 rounds."""
    return max(rtol, 2.0 ** (1 - (24 if bits is None else bits)))


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
                raise LogFormatError(
                    self._where(),
                    f"could not be read again for the evidence of step {step} ({first_line(error)})",
                ) from None
        table = self.found[step, names]
        match = table[
            (table.run.astype(str) == str(row.run))
            & (table.grp.astype(str) == str(row.grp))
            & (table.term.astype(str) == str(row.term))
        ]
        if match.empty:  # a shard removed or rewritten since it was aggregated
            raise LogFormatError(
                self._where(),
                f"changed while it was audited: step {step} of run {row.run!r} is no longer there; audit it again",
            )
        return match.iloc[0]

    def _where(self) -> str:
        return ", ".join(s.name for s in self.shards[:3]) + (", …" if len(self.shards) > 3 else "")
