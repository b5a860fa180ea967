"""A step table's parts, by run: the runs asked for, the steps every rank has recorded (`--live`), those that lost
records left out, read again at every pass whether the table is in memory or on disk."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import numpy.typing as npt
import pandas as pd
from pandas.api.types import union_categoricals

from tokaudit._checks import RunSteps, group_records, main_term_first, main_term_known, terms_of
from tokaudit._engine import EVIDENCE, Spilled
from tokaudit._normalization import name_ranks
from tokaudit._ends import UnevenEnd
from tokaudit._summary import DroppedRecords


def kept_steps(
    parts: Callable[[], Iterable[pd.DataFrame]],
    runs: list[str] | None,
    horizon: dict[tuple[str, str], int] | None,
    ordered: bool,
) -> pd.DataFrame:
    """`keep_steps`' table of these runs (all when None): the same columns whatever the log's size."""
    kept = joined(
        [part if horizon is None else part[live_rows(part, horizon)] for part in selected_runs(parts, runs)],
        ordered=ordered,
    )
    return kept.drop(columns=[c for c in EVIDENCE if c in kept.columns])


def joined(frames: list[pd.DataFrame], ordered: bool) -> pd.DataFrame:
    """The parts of a table as one, as `Engine.step_table` joins its ranges: the names as categories, the
    rows by run, group, term and step. `ordered`: the parts are the engine's whole table (in that order)."""
    if ordered:
        return pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0].reset_index(drop=True)
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    if table.empty:
        return table
    for column in ("run", "grp", "term"):
        table[column] = union_categoricals(
            [frame[column].astype(str).astype("category") for frame in frames], sort_categories=True
        )
    order = np.lexsort((table.step.to_numpy(), table.term.cat.codes, table.grp.cat.codes, table.run.cat.codes))
    return table.iloc[order].reset_index(drop=True)


def table_parts(table: pd.DataFrame | Spilled) -> Callable[[], Iterable[pd.DataFrame]]:
    """A step table's parts, read again at every call: a table in memory is one part."""
    return (lambda: [table]) if isinstance(table, pd.DataFrame) else table.parts


def table_runs(table: pd.DataFrame | Spilled) -> set[str]:
    """A step table's runs, read from no part of it where it is on disk (its names were noted as it was kept)."""
    return set(table.run.unique()) if isinstance(table, pd.DataFrame) else {run for run, _, _ in table.names}


def runs_apart(
    table: pd.DataFrame | Spilled, parts: Callable[[], Iterable[pd.DataFrame]], runs: list[str]
) -> Callable[[str], Callable[[], Iterable[pd.DataFrame]]]:
    """Per run, its parts of the table (`parts`): a table in memory is split once, by run, so that the checks'
    many passes over one run each read that run's rows, not the whole table's; one on disk is read as it is."""
    if not isinstance(table, pd.DataFrame):
        return lambda run: parts
    apart = {run: next(selected_runs(parts, [run])) for run in runs}
    return lambda run: lambda: [apart[run]]


def selected_runs(parts: Callable[[], Iterable[pd.DataFrame]], runs: list[str] | None) -> Iterator[pd.DataFrame]:
    """The parts' rows of these runs (all when None): a part of no other run as it is."""
    for part in parts():
        mine = None if runs is None else name_ranks(part.run, runs) >= 0  # each distinct name once
        yield part if mine is None or mine.all() else part[mine].reset_index(drop=True)


def live_rows(part: pd.DataFrame, horizon: dict[tuple[str, str], int]) -> npt.NDArray[np.bool_]:
    """`--live`: the rows of steps every rank of their run and group has recorded. Each distinct (run,
    group) is looked up once: this runs on every part at every pass."""
    codes, pairs = pd.MultiIndex.from_arrays([part.run, part.grp]).factorize()
    limit = np.array([horizon.get((str(run), str(group)), -1) for run, group in pairs], dtype=np.int64)
    keep: npt.NDArray[np.bool_] = part.step.to_numpy() <= limit[codes]
    return keep


def run_steps(
    parts: Callable[[], Iterable[pd.DataFrame]],
    run: str,
    horizon: dict[tuple[str, str], int] | None,
    lost: DroppedRecords | None,
    names: set[tuple[str, str, str]] | None = None,
    stopped: int | None = None,
    ended: UnevenEnd | None = None,
) -> RunSteps | None:
    """One run's table in parts, its steps not yet complete (`--live`), those that lost records, the update it
    `stopped` inside (its recorder said so) and the steps past the end every rank recorded (`ended`) left out; None
    when nothing is left. The table itself when it is one part of one run and nothing is left out. `names`: every
    (run, group, term) of the table, which spares a pass when nothing is left out."""

    def selected() -> Iterator[pd.DataFrame]:
        for rows in selected_runs(parts, [run]):
            keep = np.ones(len(rows), dtype=bool)
            if horizon is not None:
                keep &= live_rows(rows, horizon)
            if lost:
                keep &= ~lost.covers(rows)
            if stopped is not None:
                keep &= rows.step.to_numpy() != stopped
            if ended is not None:
                keep &= ~ended.covers(rows)
            if not keep.all():
                rows = rows[keep].reset_index(drop=True)
            if len(rows):
                yield rows

    groups: set[str] = set()
    terms: set[str] = set()
    if names is not None and horizon is None and not lost and stopped is None and ended is None:
        groups = {g for r, g, _ in names if r == run}
        terms = {t for r, _, t in names if r == run}
    for rows in selected() if not groups else ():
        groups.update(str(g) for g in rows.grp.unique())
        terms.update(str(t) for t in rows.term.unique())
    if not groups:
        return None
    if len(terms) > 1 and (len(groups) > 1 or not main_term_known(terms)):
        # which term is the main one where the names do not say, and which stands for it in a group that holds
        # none of it: their records (one more pass)
        return RunSteps(selected, sorted(groups), *terms_of(group_records(selected())))
    return RunSteps(selected, sorted(groups), main_term_first(dict.fromkeys(terms, (0.0, 0.0, 0.0))))
