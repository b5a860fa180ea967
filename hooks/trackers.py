"""Experiment trackers: rank 0 audits the log and logs the verdict, max weight ratio and findings.

    rec = Recorder("runs", run_id="exp1", model=ddp, optimizer=opt,
                   trackers=[writer, wandb.run, mlflow.active_run()], audit_every=500)

At `close()` (and, with `audit_every=K`, every K steps) global rank 0 runs `tokaudit.audit(...,
live=True)` on the run's folder in a daemon thread and logs `audit_metrics` to each tracker: a
torch/tensorboardX `SummaryWriter`, a Weights & Biases run, an MLflow run (`mlflow.active_run()`,
or `MLflowTracker(run_id, client)`), a Lightning logger, an Accelerate `Accelerator` (its
`init_trackers` trackers), or any object with `log_audit(metrics, step)`. The training step never
waits for an audit; an audit or a tracker that fails warns once and training goes on.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tokaudit._storage import is_url
from tokaudit.hooks._output import shell_word, shown

if TYPE_CHECKING:
    from tokaudit import AuditReport, Finding

VERDICT_VALUES: dict[str, int] = {"correct": 0, "inconclusive": 1, "incorrect": 2}
"""The verdict as a number, for charts and alerts: higher is worse (like finding severities)."""

TEXT_LIMIT = 4000
"""Characters of findings text logged (MLflow keeps tag values up to 8000)."""

WAIT_FOR_RANKS_S = 20.0
"""How long an audit retries while another rank's shards of the audited steps are not on disk yet."""

CLOSE_TIMEOUT_S = 30.0
"""The most `Recorder.close()` waits for the final audit and its logging."""

RETRY_S = 0.5

Warn = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class AuditMetrics:
    """One run's audit, flattened for experiment trackers."""

    run: str
    """The audited run id."""
    scalars: dict[str, float]
    """Numbers: `{prefix}/verdict` (see VERDICT_VALUES), `{prefix}/max_weight_ratio`, `{prefix}/steps`
    (steps audited), `{prefix}/findings` (findings of every severity) and `{prefix}/code/<code>` (how
    many findings carry each code present)."""
    text: dict[str, str]
    """Text, for trackers that keep it: `{prefix}/verdict_text` and `{prefix}/findings_text` (one line
    per finding, most severe first, as the log says it: run ids and messages are not markup)."""


def audit_metrics(report: AuditReport, run: str | None = None, prefix: str = "tokaudit") -> AuditMetrics:
    """The metrics of `run` (default: the report's only run).

    Keys do not hold the run id, so one chart compares the same metric across experiments; give
    `prefix=f"tokaudit/{run}"` to log several runs of one report to one tracker run.
    """
    summaries = {summary.run: summary for summary in report.runs}
    if run is None:
        if len(summaries) != 1:
            raise ValueError(f"the report holds {len(summaries)} runs; name one: audit_metrics(report, run=...)")
        (run,) = summaries
    if run not in summaries:
        raise ValueError(f"no run named {run!r} in the report (runs: {', '.join(map(repr, sorted(summaries)))})")
    summary = summaries[run]
    findings = [f for f in report.findings if f.run == run]
    scalars = {
        f"{prefix}/verdict": float(VERDICT_VALUES[summary.verdict]),
        f"{prefix}/max_weight_ratio": float(summary.max_weight_ratio),
        f"{prefix}/steps": float(summary.steps),
        f"{prefix}/findings": float(len(findings)),
    }
    for code, count in sorted(Counter(f.code.value for f in findings).items()):
        # Not `{prefix}/findings/<code>`: MLflow's file store keeps a metric as a file, so a key
        # cannot also be the folder of others.
        scalars[f"{prefix}/code/{code}"] = float(count)
    text = {f"{prefix}/verdict_text": summary.verdict, f"{prefix}/findings_text": _findings_text(findings)}
    return AuditMetrics(run=run, scalars=scalars, text=text)


def _findings_text(findings: Sequence[Finding]) -> str:
    if not findings:
        return "no findings"
    lines: list[str] = []
    used = 0
    for index, finding in enumerate(findings):
        steps = finding.steps
        line = (
            f"{finding.severity.value} {finding.code.value} steps {steps.first}–{steps.last} ({steps.count}): "
            f"{finding.message}"
        )
        if used + len(line) > TEXT_LIMIT and lines:
            lines.append(f"… and {len(findings) - index} more finding(s): `tokaudit check` lists them all")
            break
        lines.append(line[:TEXT_LIMIT])
        used += len(line) + 1
    return "\n".join(lines)


@runtime_checkable
class Tracker(Protocol):
    """Anything the audit can be logged to."""

    def log_audit(self, metrics: AuditMetrics, step: int) -> None:
        """Log one audit made at training step `step`."""


class TensorBoardTracker:
    """A `SummaryWriter` (torch.utils.tensorboard or tensorboardX): add_scalar and add_text at `step`."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log_audit(self, metrics: AuditMetrics, step: int) -> None:
        # A writer the trainer closed at train end (transformers' TensorBoardCallback does) reopens a
        # new event file on the next add_*; close it again after, as it was found.
        closed = getattr(self.writer, "all_writers", ()) is None
        folder = getattr(self.writer, "log_dir", None)
        if closed and isinstance(folder, str) and not is_url(folder) and not os.access(folder, os.W_OK):
            # reopened there, its writer thread would fail on every event, each a traceback on stderr
            raise OSError(f"cannot write to {folder}")
        for key, value in metrics.scalars.items():
            self.writer.add_scalar(key, value, step)
        for key, text in metrics.text.items():
            self.writer.add_text(key, _literal_markdown(text), step)
        self.writer.flush()
        if closed:
            self.writer.close()


def _literal_markdown(text: str) -> str:
    """TensorBoard renders text as Markdown: an indented code block shows every line as written."""
    return "\n".join("    " + line for line in text.splitlines() or [""])


class WandbTracker:
    """A Weights & Biases run: the numbers into the history, the text into the summary."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log_audit(self, metrics: AuditMetrics, step: int) -> None:
        # commit=False: the numbers join the row the trainer commits next (or the last one, at
        # finish) and never advance W&B's step, which a trainer logging with step=... relies on.
        self.run.log(dict(metrics.scalars), commit=False)
        self.run.summary.update(dict(metrics.text))


class MLflowTracker:
    """An MLflow run by id: metrics at `step` and the text as tags, through a client (an audit runs in
    a thread, where MLflow's fluent API sees no active run)."""

    def __init__(self, run_id: str, client: Any = None) -> None:
        if client is None:
            from mlflow.tracking import MlflowClient

            client = MlflowClient()  # the tracking URI as it is set now (set_tracking_uri, MLFLOW_TRACKING_URI)
        self.run_id = run_id
        self.client = client

    def log_audit(self, metrics: AuditMetrics, step: int) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id,
            metrics=[Metric(k, v, now, step) for k, v in metrics.scalars.items()],
            tags=[RunTag(k, v) for k, v in metrics.text.items()],
        )


class MetricsTracker:
    """Numbers only, through `log(metrics: dict[str, float], step)` (a Lightning logger's
    `log_metrics`, an Accelerate tracker's `log`)."""

    def __init__(self, log: Callable[[dict[str, float], int], Any]) -> None:
        self.log = log

    def log_audit(self, metrics: AuditMetrics, step: int) -> None:
        self.log(dict(metrics.scalars), step)


def as_trackers(target: Any) -> list[Tracker]:
    """The trackers `target` stands for (raises TypeError when it is none of the kinds known).

    A SummaryWriter, a W&B run, an MLflow run (ActiveRun or Run), a Lightning logger (TensorBoard, W&B
    and MLflow loggers get the text too; others the numbers through `log_metrics`), an Accelerate
    Accelerator or one of its trackers (each `init_trackers` tracker, as above), or a `Tracker`.
    """
    if isinstance(target, Tracker):
        return [target]
    names = {cls.__name__ for cls in type(target).__mro__}
    module = type(target).__module__
    if callable(getattr(target, "add_scalar", None)) and callable(getattr(target, "add_text", None)):
        return [TensorBoardTracker(target)]
    if module.startswith("wandb") and callable(getattr(target, "log", None)) and hasattr(target, "summary"):
        return [WandbTracker(target)]
    if module.startswith("mlflow") and isinstance(getattr(getattr(target, "info", None), "run_id", None), str):
        return [MLflowTracker(target.info.run_id)]
    if "MLFlowLogger" in names:
        return [MLflowTracker(target.run_id, client=target.experiment)]
    if names & {"TensorBoardLogger", "WandbLogger"}:
        return as_trackers(target.experiment)
    if callable(getattr(target, "log_metrics", None)) and hasattr(
        type(target), "experiment"
    ):  # other Lightning loggers
        logger = target
        return [MetricsTracker(lambda metrics, step: logger.log_metrics(metrics, step=step))]
    if "Accelerator" in names:
        return [tracker for each in target.trackers for tracker in as_trackers(each)]
    if "GeneralTracker" in names:  # one of Accelerate's trackers
        if target.name in ("tensorboard", "wandb", "mlflow"):
            return as_trackers(target.tracker)
        general = target
        return [MetricsTracker(lambda metrics, step: general.log(metrics, step=step))]
    raise TypeError(
        f"cannot log an audit to a {type(target).__module__}.{type(target).__qualname__} (not a "
        "SummaryWriter, W&B run, MLflow run, Lightning logger, Accelerator or Tracker)"
    )


def log_audit(report: AuditReport, trackers: Sequence[Any], step: int = 0, run: str | None = None) -> AuditMetrics:
    """Log `run` of an audit made by hand to each tracker (errors are raised, not warned)."""
    metrics = audit_metrics(report, run)
    for target in trackers:
        for tracker in as_trackers(target):
            tracker.log_audit(metrics, step)
    return metrics


QUIET = "TOKAUDIT_QUIET"
"""Set to 1: no Recorder says its start and close lines (as `Recorder(announce=False)`)."""


def announcing(announce: bool) -> bool:
    return announce and os.environ.get(QUIET, "").lower() not in ("1", "true", "yes")


def start_line(log_dir: Path | str, run_id: str) -> Callable[[Any], None]:
    """The Recorder's one line once rank, W and D are known (its first record), on global rank 0 alone."""

    def say(placement: Any) -> None:
        if _global_rank() != 0:
            return
        divisor = placement.grad_divisor
        seen = (
            f"D={divisor:g}" if placement.divisor_known and divisor is not None else "D not seen (pass grad_divisor=)"
        )
        print(
            f"tokaudit: recording run {run_id!r} to {shown(log_dir)} (W={placement.identity.world_size}, {seen}); "
            f"`tokaudit check {shell_word(log_dir)}` audits it",
            file=sys.stderr,
            flush=True,
        )

    return say


class VerdictLine:
    """The Recorder's line at close() (global rank 0): the run's verdict, on stderr; logged by the final audit
    only (`AuditLoop`)."""

    def __init__(self, log_dir: Path | str) -> None:
        self.log_dir = log_dir

    def log_audit(self, metrics: AuditMetrics, step: int) -> None:
        findings = int(metrics.scalars.get("tokaudit/findings", 0))
        print(
            f"tokaudit: run {metrics.run!r} is {metrics.text['tokaudit/verdict_text']} ({findings} finding(s)); "
            f"`tokaudit check {shell_word(self.log_dir)}` says why",
            file=sys.stderr,
            flush=True,
        )


class AuditLoop:
    """A Recorder's audits for its trackers: every `every` steps and at close, on global rank 0, each
    in a daemon thread (never two at once). Other ranks only flush at the same step boundaries, so
    the audit reads whole steps of every rank."""

    def __init__(self, log_dir: Path | str, run_id: str, targets: list[Any], every: int | None, warn: Warn) -> None:
        self.log_dir = log_dir
        self.run_id = run_id
        self.every = every
        self._targets = targets
        self._trackers: list[Tracker] | None = None
        self._next: int | None = None
        self._latest = -1
        """The last step recorded: the final audit waits for every rank's shards through it."""
        self._thread: threading.Thread | None = None
        self._warn = warn

    @classmethod
    def create(
        cls,
        log_dir: Path | str,
        run_id: str,
        trackers: Any,
        audit_every: Any,
        accelerator: Any,
        warn: Warn,
        announce: bool = False,
    ) -> AuditLoop | None:
        """The loop for the Recorder's options, or None when there is nothing to do. Never raises.

        `trackers`: one tracker or a list (None: the accelerator's trackers, when one is given). `announce`: the
        final audit's verdict is also said on stderr (`VerdictLine`).
        """
        every = None
        if audit_every is not None:
            if isinstance(audit_every, int) and not isinstance(audit_every, bool) and audit_every >= 1:
                every = audit_every
            else:
                warn(
                    "audit_every",
                    f"tokaudit: audit_every must be an int of at least 1, got {audit_every!r}; "
                    "the run is audited for the trackers at close() only",
                )
        if trackers is None:
            targets = [] if accelerator is None else [accelerator]
        elif isinstance(trackers, list | tuple):
            targets = list(trackers)
        else:
            targets = [trackers]
        if announce:
            targets.append(VerdictLine(log_dir))
        if not targets and every is None:
            return None
        return cls(log_dir, run_id, targets, every, warn)

    def due(self, step: int) -> bool:
        """Called at every record, on every rank, with its step: whether `step` opens a new block of
        `every` steps (every rank then flushes before recording it, so the audit sees the steps
        before `step` whole, from every rank)."""
        self._latest = max(self._latest, step)
        if self._trackers is None:
            self._resolve()  # while the process group is up: at close() it may be gone, and every rank "rank 0"
        if self.every is None:
            return False
        if self._next is not None and step < self._next:
            return False
        first = self._next is None  # a resumed run does not audit at its first record
        self._next = (step // self.every + 1) * self.every
        return not first

    def start(self, step: int) -> None:
        """Rank 0, after its flush: audit the steps before `step` in the background."""
        try:
            if not self._resolve() or (self._thread is not None and self._thread.is_alive()):
                return  # nothing to log to, or the previous audit still runs: the next block catches up
            deadline = time.monotonic() + WAIT_FOR_RANKS_S
            self._thread = threading.Thread(
                target=self._audit, args=(step, deadline, False), name="tokaudit-audit", daemon=True
            )
            self._thread.start()
        except Exception as error:
            self._warn("trackers-start", f"tokaudit: could not start an audit for the trackers ({error!r})")

    def close(self) -> None:
        """Rank 0, after the last flush: audit the whole run and wait at most CLOSE_TIMEOUT_S for it.
        It is logged at the step after the last one recorded (the number of steps, from step 0)."""
        try:
            if not self._resolve():
                return
            step = self._latest + 1
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            previous = self._thread
            done = threading.Event()

            def final() -> None:
                if previous is not None:
                    previous.join(max(0.0, deadline - time.monotonic()))
                    if previous.is_alive():
                        return  # a tracker still hangs in the last audit: never two at once
                self._audit(step, min(deadline, time.monotonic() + WAIT_FOR_RANKS_S), True)
                done.set()

            self._thread = threading.Thread(target=final, name="tokaudit-final-audit", daemon=True)
            try:
                self._thread.start()
            except RuntimeError:  # no new thread at interpreter shutdown: audit here, still bounded
                final()
                return
            self._thread.join(max(0.0, deadline - time.monotonic()))
            # Not "is the thread alive": a final audit that gave up on a hanging tracker ends at the same
            # deadline as this wait, and whichever came first decided whether it was said.
            if not done.is_set():
                self._warn(
                    "trackers-timeout",
                    f"tokaudit: the final audit for the trackers did not finish within "
                    f"{CLOSE_TIMEOUT_S:.0f} s; training goes on without it (run "
                    f"`tokaudit check {shell_word(self.log_dir)}`)",
                )
        except Exception as error:
            self._warn("trackers-start", f"tokaudit: could not audit the run for the trackers ({error!r})")

    def _resolve(self) -> bool:
        """On global rank 0, the trackers (resolved once, in the training thread); elsewhere none."""
        if self._trackers is None:
            self._trackers = []
            if _global_rank() != 0:
                return False
            for target in self._targets:
                try:
                    self._trackers.extend(as_trackers(target))
                except Exception as error:
                    self._warn(
                        f"trackers-{type(target).__name__}",
                        f"tokaudit: {error}; the audit is not logged there, training goes on",
                    )
        return bool(self._trackers)

    def _audit(self, step: int, deadline: float, final: bool) -> None:
        """Audit until every rank's shards reach the steps before `step` (or the deadline), then log."""
        try:
            from tokaudit import audit  # the public entry point: the hooks know no module of the auditor's

            while True:
                # One DuckDB thread: the audit runs beside the training, which keeps the cores.
                report = audit([self.log_dir], live=True, keep_steps=True, threads=1)
                missing = _missing(report, self.run_id, step - 1)
                if missing is None or missing == "run" or time.monotonic() + RETRY_S > deadline:
                    break
                time.sleep(RETRY_S)
            if missing == "run":
                return  # this rank recorded nothing: nothing to say
            if missing is not None:
                # A rank (or a group) whose last shards are not on disk yet: a verdict on part of the run would
                # contradict the audit of the finished log, so none is logged.
                if final:
                    self._warn(
                        "trackers-ranks",
                        f"tokaudit: not every rank's records of run {self.run_id!r} were "
                        f"in {shown(self.log_dir)} within {WAIT_FOR_RANKS_S:.0f} s, so no verdict "
                        f"is said or logged here; `tokaudit check {shell_word(self.log_dir)}` audits the "
                        "complete log",
                    )
                return
            metrics = audit_metrics(report, self.run_id)
        except Exception as error:
            self._warn("trackers-audit", f"tokaudit: the audit for the trackers failed ({error!r}); training goes on")
            return
        for tracker in list(self._trackers or []):
            if isinstance(tracker, VerdictLine) and not final:
                continue  # the verdict line is said once, at close()
            try:
                tracker.log_audit(metrics, step)
            except Exception as error:
                # never tried again: a writer reopened at every audit on a folder it cannot write fills stderr
                self._trackers = [t for t in self._trackers or [] if t is not tracker]
                self._warn(
                    f"trackers-log-{id(tracker)}",
                    f"tokaudit: could not log the audit to "
                    f"{type(tracker).__name__} ({error!r}); it is not tried "
                    "again, training goes on",
                )


def _missing(report: AuditReport, run: str, through: int) -> str | None:
    """What the live audit still lacks: "run" (no record of it), "ranks" (a rank has no shard yet),
    "steps" (a rank has not flushed through step `through` yet) or None."""
    if not any(s.run == run for s in report.runs):
        return "run"
    steps = report.steps
    audited = steps[steps.run == run] if steps is not None else None
    if audited is None or audited.empty:
        return "steps"
    # read from the aggregated steps, every one of them: the summary counts the ranks of the steps it judged, none
    # where every step was set aside (a count the probe contradicts), and all the records are there all the same
    if int(audited.ranks.max()) < int(audited.world_high.max()):
        return "ranks"
    # every group through the last step (a live audit leaves out the steps some rank of a group lacks)
    if int(audited.groupby("grp", observed=True).step.max().min()) < through:
        return "steps"
    return None


def _global_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0") or 0)
