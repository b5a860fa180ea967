"""Spans: consecutive steps of one group and term with the same diagnosis, kept in bounded memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._normalization.vocabulary import DENOMINATORS, Denominator, Diagnoses, StepKind


@dataclass(frozen=True, slots=True)
class Span:
    """Consecutive steps of one (group, term) that used the same normalization."""

    group: str
    term: str
    first: int
    last: int
    steps: int
    denominator: Denominator
    factor: float | None


MAX_SPANS = 100
"""Spans listed per (group, term): a normalization that alternates from step to step (a bug that
fires every other update) would otherwise make one span per step; the longest are kept."""

SPAN_BLOCK = 1 << 16
"""Rows `segments` reads at a time: its temporaries stay about 10 MB whatever the number of steps."""


def segments(steps: pd.DataFrame, diagnoses: Diagnoses) -> tuple[list[Span], int]:
    """Consecutive steps with the same recovered normalization, merged per (group, term): two
    data-parallel groups never interleave. Columnar: a span starts wherever (denominator, α) changes.
    At most MAX_SPANS per (group, term), the longest (the earliest among equals), in step order;
    the second value counts the spans left out.

    The step table comes in (group, term, step) order: it is read SPAN_BLOCK rows at a time, each
    block's spans added to the longest kept so far (a normalization that changes at every step makes
    a span per step: held whole, they were 90 bytes a step). A table in another order is sorted first."""
    keep = ~diagnoses.kind_is(StepKind.EMPTY, StepKind.SKIPPED)
    if not keep.any():
        return [], 0
    grp, grp_names = _name_ranks(steps.grp)
    term, term_names = _name_ranks(steps.term)
    step = steps.step.to_numpy()

    def kept(rows: npt.NDArray[Any]) -> dict[str, npt.NDArray[Any]]:
        return {
            "grp": grp.values(rows),
            "term": term.values(rows),
            "step": step[rows],
            "denominator": diagnoses.denominator[rows],
            "factor": diagnoses.factor[rows],
        }

    spans = Spans()
    for start in range(0, len(step), SPAN_BLOCK):
        if not spans.add(kept(start + np.flatnonzero(keep[start : start + SPAN_BLOCK]))):
            # Out of order: every kept row at once, sorted by group, term, then step (lexsort is stable).
            rows = kept(np.flatnonzero(keep))
            order = np.lexsort((rows["step"], rows["term"], rows["grp"]))
            spans = Spans()
            spans.add({name: values[order] for name, values in rows.items()})
            break
    return spans.listed(grp_names, term_names)


def span_rows(
    steps: pd.DataFrame, diagnoses: Diagnoses, groups: list[str], term_rank: int
) -> dict[str, npt.NDArray[Any]]:
    """What `Spans.add` reads of these steps of one term (every one but the empty and skipped ones): the rank of its
    group's name among the run's (`groups`), the term's rank, the step, the denominator and α."""
    rows = np.flatnonzero(~diagnoses.kind_is(StepKind.EMPTY, StepKind.SKIPPED))
    return {
        "grp": name_ranks(steps.grp, groups)[rows].astype(np.int32),
        "term": np.full(len(rows), term_rank, dtype=np.int32),
        "step": steps.step.to_numpy()[rows],
        "denominator": diagnoses.denominator[rows],
        "factor": diagnoses.factor[rows],
    }


def name_ranks(column: pd.Series, names: list[str]) -> npt.NDArray[np.int64]:
    """Per row, the index of its name (as text) in `names` (−1: another name, or none): each distinct
    value converted once, not every row."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes, found = column.cat.codes.to_numpy(), column.cat.categories
    else:
        codes, found = pd.factorize(column)
    index = {name: rank for rank, name in enumerate(names)}
    # the last entry is read by the code −1 of a missing name
    ranks = np.array([index.get(str(name), -1) for name in found] + [-1], dtype=np.int64)
    ranked: npt.NDArray[np.int64] = ranks[codes]
    return ranked


class Spans:
    """`segments` a block of kept rows at a time, each row (group, term, step, denominator, α) as arrays:
    the last row added and the span still open, and the longest closed spans of each (group, term),
    at most MAX_SPANS. A span is numbered by its first row among the rows added (the earliest wins ties)."""

    def __init__(self) -> None:
        self.rows = 0
        """Rows added so far."""
        self.last: dict[str, npt.NDArray[Any]] = {name: np.zeros(0, dtype) for name, dtype in _ROW_FIELDS}
        """The last row added (none yet: empty arrays)."""
        self.open: dict[str, npt.NDArray[Any]] = {name: np.zeros(0, dtype) for name, dtype in _OPEN_FIELDS}
        """The span still open: its first row's number, group, term, step, denominator and α."""
        self.kept = {name: np.zeros(0, dtype) for name, dtype in _SPAN_FIELDS}
        self.closed = 0

    def add(self, block: dict[str, npt.NDArray[Any]]) -> bool:
        """Take the next rows; False when they are not in (group, term, step) order after the last."""
        if not len(block["step"]):
            return True
        carried = len(self.last["step"])  # the last row, at position 0 when there is one
        rows = {name: np.concatenate([self.last[name], block[name]]) for name, _ in _ROW_FIELDS}
        grp, term, step, denominator, factor = (rows[name] for name, _ in _ROW_FIELDS)
        later = (grp[1:] > grp[:-1]) | (
            (grp[1:] == grp[:-1]) & ((term[1:] > term[:-1]) | ((term[1:] == term[:-1]) & (step[1:] > step[:-1])))
        )
        if not later.all():
            return False
        del later
        same_factor = (factor[1:] == factor[:-1]) | (np.isnan(factor[1:]) & np.isnan(factor[:-1]))
        changed = (grp[1:] != grp[:-1]) | (term[1:] != term[:-1]) | (denominator[1:] != denominator[:-1]) | ~same_factor
        # Positions where a span starts: after each change, and at the very first row.
        starts = np.flatnonzero(changed) + 1 if carried else np.r_[0, np.flatnonzero(changed) + 1]
        number = self.rows - carried  # the row number of position 0
        spans = {
            name: np.concatenate([self.open[name], number + starts if name == "first" else rows[name][starts]])
            for name, _ in _OPEN_FIELDS
        }
        # Every span but the last is closed by the next start, its last row just before that start.
        closing = len(spans["first"]) - 1
        self._keep(
            {
                "first": spans["first"][:-1],
                "length": np.diff(spans["first"]),
                "grp": spans["grp"][:-1],
                "term": spans["term"][:-1],
                "first_step": spans["step"][:-1],
                "last_step": step[starts - 1][len(starts) - closing :],
                "denominator": spans["denominator"][:-1],
                "factor": spans["factor"][:-1],
            }
        )
        # copies: a view of the last element would keep the whole block's arrays alive
        self.open = {name: values[-1:].copy() for name, values in spans.items()}
        self.rows = number + len(step)
        self.last = {name: values[-1:].copy() for name, values in rows.items()}
        return True

    def _keep(self, closed: dict[str, npt.NDArray[Any]]) -> None:
        """Add closed spans and keep, per (group, term), the MAX_SPANS longest (the earliest among equals)."""
        self.closed += len(closed["first"])
        pool = {name: np.concatenate([self.kept[name], closed[name].astype(dtype)]) for name, dtype in _SPAN_FIELDS}
        order = np.lexsort((pool["first"], -pool["length"], pool["term"], pool["grp"]))
        pair = np.stack([pool["grp"][order], pool["term"][order]], axis=1)
        new_pair = np.r_[True, (pair[1:] != pair[:-1]).any(axis=1)]
        pair_start = np.maximum.accumulate(np.where(new_pair, np.arange(len(order)), 0))
        chosen = order[np.arange(len(order)) - pair_start < MAX_SPANS]
        self.kept = {name: values[chosen] for name, values in pool.items()}

    def listed(self, grp_names: list[str], term_names: list[str]) -> tuple[list[Span], int]:
        """The spans kept, the open one closed at the last row, in order; and how many were left out."""
        if len(self.open["first"]):
            self._keep(
                {
                    "first": self.open["first"],
                    "length": self.rows - self.open["first"],
                    "grp": self.open["grp"],
                    "term": self.open["term"],
                    "first_step": self.open["step"],
                    "last_step": self.last["step"],
                    "denominator": self.open["denominator"],
                    "factor": self.open["factor"],
                }
            )
            self.open = {name: values[:0] for name, values in self.open.items()}
        order = np.argsort(self.kept["first"], kind="stable")
        kept = {name: values[order].tolist() for name, values in self.kept.items()}
        spans = [
            Span(grp_names[g], term_names[t], a, b, n, DENOMINATORS[d], None if f != f else f)  # NaN: none
            for g, t, a, b, n, d, f in zip(
                kept["grp"],
                kept["term"],
                kept["first_step"],
                kept["last_step"],
                kept["length"],
                kept["denominator"],
                kept["factor"],
            )
        ]
        return spans, self.closed - len(spans)


_ROW_FIELDS = (
    ("grp", np.int32),
    ("term", np.int32),
    ("step", np.int64),
    ("denominator", np.int8),
    ("factor", np.float64),
)

_OPEN_FIELDS = (("first", np.int64), *_ROW_FIELDS)

_SPAN_FIELDS = (
    ("first", np.int64),
    ("length", np.int64),
    ("grp", np.int32),
    ("term", np.int32),
    ("first_step", np.int64),
    ("last_step", np.int64),
    ("denominator", np.int8),
    ("factor", np.float64),
)


@dataclass(frozen=True, slots=True)
class _NameRanks:
    """Per row, the rank of its name among the column's names, read for the rows asked (4 bytes a row
    of those only): the codes of the column's categories and, per code, its rank."""

    codes: npt.NDArray[Any]
    rank: npt.NDArray[np.int32]

    def values(self, rows: npt.NDArray[Any]) -> npt.NDArray[np.int32]:
        ranks: npt.NDArray[np.int32] = self.rank[self.codes[rows]]
        return ranks


def _name_ranks(column: pd.Series) -> tuple[_NameRanks, list[str]]:
    """Per row, the rank of its name (as text) among the column's names, and the names in that order:
    a column of a few names repeated on millions of steps is compared and sorted as integers, and no
    row is turned into a string."""
    categorical = (
        column
        if isinstance(column.dtype, pd.CategoricalDtype) and not column.isna().any()
        else column.astype(str).astype("category")
    )
    names = [str(name) for name in categorical.cat.categories]
    order = sorted(range(len(names)), key=names.__getitem__)
    rank = np.empty(len(names), dtype=np.int32)  # 4 bytes a step: fewer than 2³¹ names
    rank[order] = np.arange(len(names))
    return _NameRanks(categorical.cat.codes.to_numpy(), rank), [names[i] for i in order]
