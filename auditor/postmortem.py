"""Post-mortem views: the weight of every record at one step, and the loss curves of a run."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pandas as pd

from tokaudit.auditing import Progress, open_logs
from tokaudit.reader import Loading, LogSet
from tokaudit.codes import DEFAULT_RTOL
from tokaudit.errors import LogFormatError, TokauditError, UsageError


def _names(runs: list[str], shown: int = 50) -> str:
    more = f", and {len(runs) - shown} more" if len(runs) > shown else ""
    return ", ".join(runs[:shown]) + more


def _nothing_readable(logset: LogSet) -> TokauditError:
    """The one line for a post-mortem with no readable shard: what was wrong with the input."""
    if not logset.problems:
        return UsageError("no readable log to inspect")
    if len(logset.problems) == 1:
        return logset.problems[0]
    return UsageError(f"no readable log to inspect: {logset.problems[0]} (and {len(logset.problems) - 1} more)")


def _pick_run(steps: pd.DataFrame, run: str | None) -> str:
    runs = sorted(str(r) for r in set(steps.run.unique()))
    if run is None:
        if len(runs) != 1:
            raise UsageError(f"the logs hold {len(runs)} runs; choose one with --run: {_names(runs)}")
        return runs[0]
    if run not in runs:
        raise UsageError(f"no run named {run!r} in the logs (runs: {_names(runs)})")
    return run


def step_weights(paths: Sequence[str | os.PathLike[str]], step: int, run: str | None = None,
                 started: Loading | None = None) -> tuple[str, pd.DataFrame, list[LogFormatError]]:
    """Every record of one step: n, S, b, c = b/S (or the probe's), e = c·g/D and q = e·N.

    Only the shards whose footers may hold `step` are read, and only that step is aggregated; when
    it is not there the whole log is opened to say which runs and steps it has. `started`: the
    validation of `paths` already under way (`tokaudit.reader.start_loading`)."""
    logset, engine, steps = open_logs(paths, only_steps=(step, step), started=started)
    one_run = run is None and len({s.default_run for s in logset.shards}) == 1 and steps.run.nunique() == 1
    if engine is not None and len(steps) and (one_run or run in set(steps.run.unique())):
        try:
            chosen = _pick_run(steps, run)
            return chosen, engine.records_at(chosen, step), logset.problems
        finally:
            engine.close()
    if engine is not None:
        engine.close()
    logset, engine, steps = open_logs(paths)
    if engine is None:
        raise _nothing_readable(logset)
    try:
        chosen = _pick_run(steps, run)
        if step not in set(steps.step[steps.run == chosen]):
            known = sorted(set(steps.step[steps.run == chosen]))
            raise UsageError(f"run {chosen!r} has no step {step} (steps {known[0]}–{known[-1]})")
        return chosen, engine.records_at(chosen, step), logset.problems
    finally:
        engine.close()


def loss_curve(paths: Sequence[str | os.PathLike[str]], run: str | None = None, progress: Progress | None = None,
               steps: tuple[int, int] | None = None, started: Loading | None = None
               ) -> tuple[str, pd.DataFrame, list[LogFormatError]]:
    """Per step: the true token mean ΣS/N, the mean of per-rank means, the reported loss, and the
    objective the optimizer actually followed, Σ e·S (equal to ΣS/N when the run is correct).

    `steps`: only these (first, last), read from the shards whose footers may hold them and aggregated
    a range at a time as the whole log would be: a window of a run of millions of steps costs its own size.
    `started`: the validation of `paths` already under way (`tokaudit.reader.start_loading`)."""
    logset, engine, table = open_logs(paths, DEFAULT_RTOL, progress, only_steps=steps, started=started)
    if engine is not None:
        engine.close()
    # No shard in the window (and none unreadable), or shards whose records all lie outside it.
    if steps is not None and table.empty and (engine is not None or not logset.problems):
        raise UsageError(f"no step from {steps[0]} to {steps[1]} in the logs")
    if engine is None:
        raise _nothing_readable(logset)
    try:
        chosen = _pick_run(table, run)
    except UsageError as error:
        if steps is None:
            raise
        raise UsageError(f"{error} (steps {steps[0]}–{steps[1]} only)") from None
    # The columns the curve reads, then the run's rows: not a copy of every column of millions of steps.
    used = ["step", "tokens", "loss", "reported_low", "reported_high", "reported", "objective",
            "weighted_records", "mean_of_local_means"]
    frame = table[used][(table.run == chosen).to_numpy()]
    del table
    frame["token_mean"] = frame.loss / frame.tokens.where(frame.tokens > 0)
    frame["reported"] = ((frame.reported_low + frame.reported_high) / 2).where(frame.reported > 0)
    frame["optimized"] = frame.objective.where(frame.weighted_records > 0)
    # Under DP×TP every data-parallel group sees the whole batch: average the groups' curves.
    curve = frame.groupby("step", as_index=False).agg(
        tokens=("tokens", "max"), token_mean=("token_mean", "mean"),
        mean_of_local_means=("mean_of_local_means", "mean"), reported=("reported", "mean"),
        optimized=("optimized", "mean"))
    curve["tokens"] = curve.tokens.astype("int64")
    return chosen, curve, logset.problems
