"""Which loss term is a run's main one (its structure and synchronization are read there, its loss is the one a
trainer logs), which stands for it in a group that holds none of it, and which the records cannot tell from it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np
import pandas as pd

from tokaudit._checks.base import RunSteps, accumulating, column_of, grouped, mixed_sync, nan_sum
from tokaudit._normalization import name_ranks
from tokaudit._schema import UNNAMED


def whole_run(frame: pd.DataFrame) -> RunSteps:
    """One run's whole table as `RunSteps`, put in the table's order (group, term, step) if it is not."""
    terms, standing, tied = terms_of(group_records([frame]))
    groups = sorted({str(g) for g in frame.grp.unique()})
    step = frame.step.to_numpy()
    if len(groups) > 1 or len(terms) > 1 or not bool((step[1:] > step[:-1]).all()):
        order = np.lexsort((step, name_ranks(frame.term, terms), name_ranks(frame.grp, groups)))
        if (order != np.arange(len(order))).any():
            frame = frame.iloc[order].reset_index(drop=True)
    return RunSteps(lambda: [frame], groups, terms, standing, tied)


def terms_of(held: Mapping[tuple[str, str], Held]) -> tuple[list[str], dict[str, str], tuple[str, ...]]:
    """From what `group_records` counts: the terms, the main one first (`main_term_first`), the term that stands for
    it in each group that holds none of it (`stand_ins`), and those tied with it (`tied_terms`)."""
    counts = over_groups(held)
    terms = main_term_first(counts)
    main = terms[0] if terms else UNNAMED
    return terms, stand_ins(held, main), tied_terms(counts, main)


def loss_terms(steps: pd.DataFrame) -> list[str]:
    """The loss terms of a step table, as text, the main term first (`main_term_first`)."""
    return main_term_first(term_records([steps]))


def term_records(parts: Iterable[pd.DataFrame]) -> dict[str, tuple[float, float, float]]:
    """Per loss term of these parts of a step table (as text): its records that synchronized, the most records one
    group holds of it (a pipeline's stages each a group: an auxiliary loss of every stage outnumbers the loss of the
    last one, over the run), and its steps of an accumulation's pattern (`over_groups`)."""
    return over_groups(group_records(parts))


@dataclass
class Held:
    """What the records of one (group, loss term) show over its steps (`group_records`)."""

    synced: float = 0.0
    """Records that synchronized."""
    records: float = 0.0
    mixed: float = 0.0
    """Steps that hold both records that synchronized and records that did not (`mixed_sync`)."""
    accumulating: float = 0.0
    """Of those, the steps where a rank holds several (`accumulating`: no_sync() before the last microbatch)."""
    all_synced: float = 0.0
    """Steps every record of which synchronized (an update of one microbatch, or a loop without no_sync())."""
    unsynced: float = 0.0
    """Steps whose records say whether they synchronized, none of which did."""

    def add(self, counts: Sequence[float]) -> None:
        """Counts of more steps, in the order of the fields."""
        for field, count in zip(fields(self), counts):
            setattr(self, field.name, getattr(self, field.name) + count)


def group_records(parts: Iterable[pd.DataFrame]) -> dict[tuple[str, str], Held]:
    """Per (group, loss term) of these parts of a step table (as text): what `Held` counts."""
    held: dict[tuple[str, str], Held] = {}
    for part in parts:
        records = column_of(part, "records") if "records" in part else np.zeros(len(part))
        synced = column_of(part, "sync_true").astype(float) if "sync_true" in part else records * np.nan
        said = np.nan_to_num(synced)  # (NaN: no record of the step says)
        known = column_of(part, "sync_known") if "sync_known" in part else records * 0
        ranks = column_of(part, "ranks") if "ranks" in part else records
        counted = (
            said,
            records,
            mixed_sync(synced, records),
            accumulating(synced, records, ranks),
            (records > 0) & (said == records),
            (known > 0) & (said == 0),
        )
        for group, in_group in grouped(part.grp):
            terms = part.term if isinstance(in_group, slice) else part.term.iloc[in_group]
            for term, rows in grouped(terms):
                more = [nan_sum(np.asarray(column[in_group][rows], dtype=float)) for column in counted]
                held.setdefault((group, str(term)), Held()).add(more)
    return held


def over_groups(held: Mapping[tuple[str, str], Held]) -> dict[str, tuple[float, float, float]]:
    """Per term, from what `group_records` counts of it per (group, term): its records that synchronized in every
    group, the most records one group holds, and its steps of an accumulation's pattern (`accumulating`) in every
    group (what `main_term_first` reads)."""
    most: dict[str, tuple[float, float, float]] = {}
    for (_, term), counts in held.items():
        before = most.get(term, (0.0, 0.0, 0.0))
        most[term] = (before[0] + counts.synced, max(before[1], counts.records), before[2] + counts.accumulating)
    return most


def main_term_first(records: Mapping[str, tuple[float, ...]]) -> list[str]:
    """The loss terms (with what `term_records` counts), the main term first, then the others by name. The main term
    is UNNAMED ("0"), the recorder's default; where no record is of it (every term named), a term some record of
    which synchronized before one none of whose did (an auxiliary loss of the first microbatch, recorded once or by
    several layers, is unsynchronized in a correct loop: it ends no update and is no run's logged loss), then one
    some step of which holds records that synchronized and records that did not, a rank holding several (an
    accumulation's, no_sync() before the last microbatch: the loss of every microbatch shows it, an auxiliary loss of
    the first or the last microbatch alone never, however many layers record it), then the term of the most records
    in one group, ties by name."""
    main = UNNAMED if UNNAMED in records or not records else min(records, key=lambda t: (*_told(records[t]), t))
    return sorted(records, key=lambda t: (t != main, t))


def _told(counts: tuple[float, ...]) -> tuple[bool, bool, float]:
    """What tells a main term from the others by its (records that synchronized, most records in one group, steps of
    an accumulation's pattern): the least comes first."""
    return counts[0] <= 0, counts[2] <= 0, -counts[1]


def tied_terms(records: Mapping[str, tuple[float, float, float]], main: str) -> tuple[str, ...]:
    """The terms other than `main` that their counts (`term_records`) cannot tell from it, whose order only their
    names gave (two heads on every microbatch: a trainer may log either one's loss)."""
    if main == UNNAMED or main not in records:
        return ()
    return tuple(t for t in sorted(records) if t != main and _told(records[t]) == _told(records[main]))


def stand_ins(held: Mapping[tuple[str, str], Held], main: str) -> dict[str, str]:
    """Per group with no record of the `main` term (a pipeline stage whose loss is another's), the term that stands
    for it there: the first of the group's terms in its own order (`main_term_first`) whose records show where
    updates end (`_ends_updates`). One that never does (an auxiliary loss of the first microbatch, never
    synchronized, or of the last, always, by one layer or several) shows no update's end; a group none of whose
    terms does is not read for its structure and synchronization."""
    terms: dict[str, dict[str, Held]] = {}
    for (group, term), counts in held.items():
        terms.setdefault(group, {})[term] = counts
    found = {}
    for group, of_group in terms.items():
        ordered = main_term_first(over_groups({(group, t): h for t, h in of_group.items()}))
        ending = [t for t in ordered if _ends_updates(of_group[t])]
        if main not in of_group and ending:
            found[group] = ending[0]
    return found


def _ends_updates(held: Held) -> bool:
    """A term whose records show where updates end, as a loss's do: a step of records that synchronized and records
    that did not (an accumulation's), or one whose records all synchronized (a loop without no_sync(), or of one
    microbatch) beside one where none did (an update that never synchronized, or an auxiliary loss's steps but
    for a last update of one microbatch: which, the logs cannot tell)."""
    return held.mixed > 0 or held.all_synced > 0 and held.unsynced > 0


def main_term_known(terms: Iterable[str]) -> bool:
    """The main term of these terms needs no count of records: one term, or UNNAMED among them."""
    names = set(terms)
    return len(names) < 2 or UNNAMED in names
