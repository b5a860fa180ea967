"""Post-mortem views: the weight of every record at one step, and the loss curves of a run."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._opening import Progress, load_logs, open_log_parts, open_logs
from tokaudit._step_parts import selected_runs, table_parts, table_runs
from tokaudit._checks import RunSteps, loss_terms, main_term_first, main_term_known, one_objective, outside_probe_range
from tokaudit._checks import pooled_steps, term_records
from tokaudit.codes import DEFAULT_RTOL
from tokaudit._engine import Spilled
from tokaudit._normalization import name_ranks
from tokaudit._loading import Loading, LogSet
from tokaudit.errors import LogFormatError, TokauditError, UsageError
from tokaudit._validation import INT64_MAX


def _names(runs: list[str], shown: int = 50) -> str:
    more = f", and {len(runs) - shown} more" if len(runs) > shown else ""
    return ", ".join(runs[:shown]) + more


def _window(steps: tuple[int, int]) -> str:
    """--steps' window as the user gave it: an open end, which stands for the end of int64's range, unsaid."""
    first, last = steps
    if last >= INT64_MAX:
        return "at all" if first < -INT64_MAX else f"from {first} on"
    return f"up to {last}" if first < -INT64_MAX else f"from {first} to {last}"


def _nothing_readable(logset: LogSet) -> TokauditError:
    """The one line for a post-mortem with no readable shard: what was wrong with the input."""
    if not logset.problems:
        return UsageError("no readable log to inspect")
    if len(logset.problems) == 1:
        return logset.problems[0]
    return UsageError(f"no readable log to inspect: {logset.problems[0]} (and {len(logset.problems) - 1} more)")


def _pick_run(runs: Iterable[str], run: str | None) -> str:
    """The run asked for, or the logs' only one; one line naming them all otherwise."""
    names = sorted(str(r) for r in set(runs))
    if run is None:
        if len(names) != 1:
            raise UsageError(f"the logs hold {len(names)} runs; choose one with --run: {_names(names)}")
        return names[0]
    if run not in names:
        raise UsageError(f"no run named {run!r} in the logs (runs: {_names(names)})")
    return run


def step_weights(
    paths: Sequence[str | os.PathLike[str]], step: int, run: str | None = None, started: Loading | None = None
) -> tuple[str, pd.DataFrame, list[LogFormatError]]:
    """Every record of one step: n, S, b, c = b/S (or the probe's), e = c·g/D and q = e·N.

    Only the shards whose footers may hold `step` are read, and only that step is aggregated; when
    it is not there the whole log is aggregated, a part at a time, to say which runs and steps it has
    (its footers validated once for both). `started`: the validation of `paths` already under way
    (`tokaudit._loading.start_loading`)."""
    loaded = load_logs(paths, started)
    logset, engine, steps = open_logs(paths, only_steps=(step, step), loaded=loaded)
    one_run = run is None and len({s.default_run for s in logset.shards}) == 1 and steps.run.nunique() == 1
    if engine is not None and len(steps) and (one_run or run in set(steps.run.unique())):
        try:
            chosen = _pick_run(steps.run.unique(), run)
            return chosen, engine.records_at(chosen, step), logset.problems
        finally:
            engine.close()
    if engine is not None:
        engine.close()
    # The whole log, its table read a part at a time (kept on disk past engine.SPILL_STEPS steps, as for
    # `check`): its runs, and the chosen run's steps.
    logset, engine, table = open_log_parts(paths, spill=True, loaded=loaded)  # the footers validated once
    if engine is None:
        raise _nothing_readable(logset)
    try:
        chosen = _pick_run(table_runs(table), run)
        low, high, found = None, None, False
        for rows in selected_runs(table_parts(table), [chosen]):
            held = rows.step.to_numpy()
            if len(held):
                low = int(held.min()) if low is None else min(low, int(held.min()))
                high = int(held.max()) if high is None else max(high, int(held.max()))
                found = found or bool((held == step).any())
        if not found:
            raise UsageError(f"run {chosen!r} has no step {step} (steps {low}–{high})")
        return chosen, engine.records_at(chosen, step), logset.problems
    finally:
        engine.close()
        if isinstance(table, Spilled):
            table.close()


ProbeQ = tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.bool_]]
"""Per record of a step: its lightest and heaviest valid token as the probe measured them, as q, and whether its
own q lies outside them (`probe_extremes`)."""


def probe_extremes(records: pd.DataFrame) -> ProbeQ | None:
    """Where the probe measured a step's records (`step_weights`): each record's lightest and heaviest valid token
    as q = e·N, and whether its own q (its mean weight) lies outside them beyond the default tolerance, a count that
    is not the tokens the probe saw (`count_mismatch`). None where no record was probed."""
    if "eff_min" not in records.columns or not records.eff_min.notna().any():
        return None
    # N of each record's (group, term): q = e·N, so the probe's extremes e_min, e_max read as q as well
    tokens = records.groupby(["grp", "term"], observed=True, sort=False).valid_tokens.transform("sum").to_numpy(float)
    lightest, heaviest = records.eff_min.to_numpy(float) * tokens, records.eff_max.to_numpy(float) * tokens
    q = records.q.to_numpy(float)
    return lightest, heaviest, outside_probe_range(q, q, lightest, heaviest, DEFAULT_RTOL)


CURVE_KEYS = ("step", "tokens", "token_mean", "mean_of_local_means", "reported", "optimized")
"""The curve's columns, in order: what `--csv` writes (and, for a run of several loss terms, each other term's
ΣS/N after them, `token_mean:TERM`)."""

CURVE_LABELS = (
    ("token_mean", "ΣS/N (true)"),
    ("mean_of_local_means", "mean of local means"),
    ("reported", "reported"),
    ("optimized", "optimized Σe·S"),
)
"""Each series' key and its label, in the chart's order."""


@dataclass
class Curve:
    """A run's loss curve, a part of the step table at a time (`parts`): a log of more than
    `engine.SPILL_STEPS` steps keeps its table on disk, and each pass reads it again, so what is held is
    one part (a step range), whatever the number of steps. `close` removes what is on disk."""

    run: str
    table: pd.DataFrame | Spilled
    terms: list[str]
    """The run's loss terms, the main one first (`loss_terms`)."""
    pooled: bool = False
    """The terms are one token mean (`checks.one_objective`): one curve over all of them."""

    def labels(self) -> list[tuple[str, str]]:
        """(key, label) of each series. With several loss terms, ΣS/N, the mean of local means and the reported
        loss are the main term's (what a trainer logs as its loss), each other term's ΣS/N is a series of its
        own, and the optimized objective is the sum of every term's Σe·S (what the weights say was trained)."""
        if len(self.terms) == 1:
            return list(CURVE_LABELS)
        if self.pooled:
            return [("token_mean", "ΣS/N (true, all terms)"), *CURVE_LABELS[1:]]
        main = self.terms[0]
        return [
            ("token_mean", f"ΣS/N (true, term {main})"),
            ("mean_of_local_means", f"mean of local means (term {main})"),
            ("reported", "reported"),
            ("optimized", "optimized Σe·S (all terms)"),
            *((f"token_mean:{term}", f"ΣS/N (true, term {term})") for term in self.terms[1:]),
        ]

    def parts(self) -> Iterator[pd.DataFrame]:
        """The curve's rows, in step order: a step's rows (every data-parallel group's and term's) are in
        one part, since the step table is kept a step range at a time."""
        for rows in selected_runs(table_parts(self.table), [self.run]):
            if not len(rows):
                continue
            if len(self.terms) > 1 and not self.pooled:
                yield _terms_curve_rows(rows, self.terms)
            else:
                yield _curve_rows(_pooled_rows(rows, self.terms[0]) if self.pooled else rows)

    def partial_steps(self) -> list[int]:
        """The steps some rank below W recorded none of (a log still being written, a rank that did not record):
        their N, and so their values, are of the ranks present alone."""
        found: list[int] = []
        for rows in selected_runs(table_parts(self.table), [self.run]):
            found.extend(int(step) for step in np.unique(rows.step.to_numpy()[rows.ranks < rows.world_high]))
        return found

    def close(self) -> None:
        if isinstance(self.table, Spilled):
            self.table.close()


def unseen_divisor_note() -> str:
    """`weights`' note where a record's D could not be seen (`divisor_known` false): it shows no e or q."""
    return (
        "the recorder could not see the divisor D of some records' reduction (divisor_known false): their e = c·g/D "
        "and q are not shown (see `tokaudit explain unknown_divisor`)"
    )


def partial_note(steps: list[int]) -> str:
    """What `curve` and `weights` say of steps some ranks recorded nothing of."""
    shown = ", ".join(map(str, steps[:5])) + (f", … ({len(steps)} in all)" if len(steps) > 5 else "")
    return (
        f"step(s) {shown} lack some ranks' records (a log still being written, or a rank that did not record): "
        "their N counts the ranks present, and their values are of those ranks alone"
    )


def _curve_rows(table: pd.DataFrame) -> pd.DataFrame:
    """One part's curve: per step, ΣS/N, the mean of local means, the reported loss (the middle of what
    the ranks reported) and Σe·S where some record has a weight; under DP×TP every data-parallel group
    sees the whole batch, and the groups' curves (and the terms') are averaged."""
    # The columns the curve reads: not a copy of every column of the step table.
    used = [
        "step",
        "tokens",
        "loss",
        "reported_low",
        "reported_high",
        "reported",
        "objective",
        "weighted_records",
        "unknown_divisor",
        "nonfinite_valid",
        "mean_of_local_means",
    ]
    frame = table[used].copy()
    frame["token_mean"] = frame.loss / frame.tokens.where(frame.tokens > 0)
    frame["reported"] = ((frame.reported_low + frame.reported_high) / 2).where(frame.reported > 0)
    frame["optimized"] = frame.objective.where(_optimized_known(frame))
    steps = frame.step.to_numpy()
    if len(steps) < 2 or (np.diff(steps) > 0).all():
        # one row a step (one group, one term), in order: the mean of one value is that value, as the
        # group's mean makes it, (0.0 + x) / 1 (−0.0 becomes 0.0)
        curve = frame[list(CURVE_KEYS)].reset_index(drop=True)
        for key in CURVE_KEYS[2:]:
            curve[key] = curve[key] + 0.0
    else:
        # the rows by group, term (by their names) and step, as the whole table holds them, whatever order a
        # part holds them in: each step's rows are then added in one order (pandas' mean adds in the rows'
        # order), and the mean of the groups is the same double whether the table is whole or in parts
        order = np.lexsort((steps, _name_order(table.term), _name_order(table.grp)))
        curve = (
            frame.take(order)
            .groupby("step", as_index=False)
            .agg(
                tokens=("tokens", "max"),
                token_mean=("token_mean", "mean"),
                mean_of_local_means=("mean_of_local_means", "mean"),
                reported=("reported", "mean"),
                optimized=("optimized", "mean"),
            )
        )
    curve["tokens"] = curve.tokens.astype("int64")
    return curve


def _optimized_known(table: pd.DataFrame) -> pd.Series:
    """Steps whose Σe·S the records give: some record has a weight e = c·g/D, every valid one's D was seen (where the
    recorder could not see it, D is the default W, and e's scale, so Σe·S, is not known), and none holds a value that
    is not finite (its gradient is not: a sum over the others' is no step's objective)."""
    return (table.weighted_records > 0) & (table.unknown_divisor == 0) & ~(table.nonfinite_valid > 0)


def _pooled_rows(table: pd.DataFrame, term: str) -> pd.DataFrame:
    """The rows of a run whose terms are one objective as one term's: per (group, step) the terms' tokens, loss
    sums, Σe·S and reported losses together. The mean of local means is not what the terms' rows can give
    (each rank's mean over all its pieces): left out."""
    pooled = pooled_steps(
        table.assign(objective=table.objective.where(_optimized_known(table))),
        tokens=("tokens", "sum"),
        loss=("loss", "sum"),
        objective=("objective", lambda v: v.sum(min_count=1)),
        weighted_records=("weighted_records", "sum"),
        unknown_divisor=("unknown_divisor", "sum"),
        nonfinite_valid=("nonfinite_valid", "sum"),
        reported_low=("reported_low", "min"),
        reported_high=("reported_high", "max"),
        reported=("reported", "sum"),
    )
    return pooled.assign(term=term, mean_of_local_means=np.nan)


def _terms_curve_rows(table: pd.DataFrame, terms: list[str]) -> pd.DataFrame:
    """`_curve_rows` of a run of several loss terms: the main term's curve, the optimized objective summed over
    the terms (each a token mean of its own: the update follows their sum) and each other term's ΣS/N."""
    term = table.term.astype(str)
    curve = _curve_rows(table[(term == terms[0]).to_numpy()])
    # Σ over terms of Σe·S per (step, group), then the groups' mean, as `_curve_rows` averages groups; the terms
    # summed in the order of their names, whatever order a range's rows came in (a sum's last bit depends on it)
    weighted = table[["step", "grp", "objective"]].assign(
        objective=table.objective.where(_optimized_known(table)), grp=table.grp.astype(str), term=term
    )
    weighted = weighted.sort_values(["step", "grp", "term"], kind="stable")
    optimized = weighted.groupby(["step", "grp"], sort=True).objective.sum(min_count=1).groupby("step").mean()
    curve["optimized"] = optimized.reindex(curve.step).to_numpy()
    for other in terms[1:]:
        own = _curve_rows(table[(term == other).to_numpy()])
        curve[f"token_mean:{other}"] = own.set_index("step").token_mean.reindex(curve.step).to_numpy()
    return curve


def _name_order(column: pd.Series) -> npt.NDArray[np.int64]:
    """Per row, the rank of its name (as text) among the column's names (−1: none)."""
    distinct = column.cat.categories if isinstance(column.dtype, pd.CategoricalDtype) else pd.unique(column)
    return name_ranks(column, sorted({str(name) for name in distinct}))


def curve_parts(
    paths: Sequence[str | os.PathLike[str]],
    run: str | None = None,
    progress: Progress | None = None,
    steps: tuple[int, int] | None = None,
    started: Loading | None = None,
) -> tuple[Curve, list[LogFormatError]]:
    """Per step: the true token mean ΣS/N, the mean of per-rank means, the reported loss, and the
    objective the optimizer actually followed, Σ e·S (equal to ΣS/N when the run is correct), a part at
    a time (`Curve`, which the caller closes).

    `steps`: only these (first, last), read from the shards whose footers may hold them and aggregated
    a range at a time as the whole log would be: a window of a run of millions of steps costs its own size.
    `started`: the validation of `paths` already under way (`tokaudit._loading.start_loading`)."""
    logset, engine, table = open_log_parts(paths, progress, only_steps=steps, started=started, spill=True)
    if engine is not None:
        engine.close()
    try:
        # No shard in the window (and none unreadable), or shards whose records all lie outside it.
        if (
            steps is not None
            and isinstance(table, pd.DataFrame)
            and table.empty
            and (engine is not None or not logset.problems)
        ):
            raise UsageError(f"no step {_window(steps)} in the logs (without --steps the curve has every step)")
        if engine is None:
            raise _nothing_readable(logset)
        held = table_runs(table)
        if steps is not None and run is not None and run not in held:  # (it may hold steps outside the window)
            raise UsageError(
                f"no run named {run!r} with a step {_window(steps)} (runs with steps there: "
                f"{_names(sorted(str(r) for r in held))})"
            )
        try:
            chosen = _pick_run(held, run)
        except UsageError as error:
            if steps is None:
                raise
            raise UsageError(f"{error} (steps {steps[0]}–{steps[1]} only)") from None
    except BaseException:
        if isinstance(table, Spilled):
            table.close()
        raise
    return run_curve(table, chosen), logset.problems


def run_curve(table: pd.DataFrame | Spilled, run: str, pooled: bool | None = None) -> Curve:
    """The curve of one run of a step table. Loss terms that are one token mean (`checks.one_objective`: a loss
    in pieces, each recorded as a term) are drawn as that one objective, ΣS/N over all of them. `pooled`: whether
    they are, where an audit has said so already (None: found here)."""
    terms = run_terms(table, run)
    if pooled is None and len(terms) > 1:

        def parts() -> Iterator[pd.DataFrame]:
            return selected_runs(table_parts(table), [run])

        groups = sorted({str(group) for part in parts() for group in part.grp.unique()})
        pooled = one_objective(RunSteps(parts, groups, terms), DEFAULT_RTOL) is not None
    return Curve(run, table, terms, bool(pooled))


def run_terms(table: pd.DataFrame | Spilled, run: str) -> list[str]:
    """The loss terms of one run of the table, the main one first."""
    if isinstance(table, pd.DataFrame):
        return loss_terms(table[table.run.astype(str) == run])
    terms = dict.fromkeys((term for name, _, term in table.names if name == run), (0.0, 0.0))
    return main_term_first(terms if main_term_known(terms) else term_records(selected_runs(table_parts(table), [run])))


PLOT_BUCKETS = 25_000
"""Step buckets of a long curve's envelope (`envelope`): about 25 a pixel of `--plot`'s figure."""


def envelope(
    x: npt.NDArray[np.float64], ys: npt.NDArray[np.float64], span: tuple[float, float], buckets: int | None = None
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """The points of a part of a long curve that `--plot` draws: in each of `buckets` buckets of the
    steps (PLOT_BUCKETS unless given), the first, last, lowest and highest finite point (its envelope, drawn as
    every point would be: a spike stays a spike). A bucket across two parts keeps its four of each."""
    buckets = PLOT_BUCKETS if buckets is None else buckets
    finite = np.isfinite(ys)
    x, ys = x[finite], ys[finite]
    if not len(x):
        return x, ys
    low, high = span
    # bucket b = ⌊(x − low) / (high − low) · B⌋, the last step in bucket B − 1; x is in step order
    bucket = np.minimum(((x - low) / max(high - low, 1.0) * buckets).astype(np.int64), buckets - 1)
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    ends = np.r_[starts[1:], len(x)] - 1
    by_value = np.lexsort((ys, bucket))  # each bucket's points, lowest value first
    keep = np.unique(np.concatenate([starts, ends, by_value[starts], by_value[ends]]))
    return x[keep], ys[keep]
