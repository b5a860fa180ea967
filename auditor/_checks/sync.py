"""missing_sync and sync_every_micro: whether each rank's last microbatch synchronized gradients, as the records
say."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._checks.base import (
    Check,
    TermInputs,
    accumulating,
    column_of,
    grouped,
    grouped_rows,
    make_finding,
    nan_sum,
)
from tokaudit._checks.ranks import MainSteps
from tokaudit._normalization import Diagnoses
from tokaudit.codes import Code, Severity
from tokaudit._report import Finding


class SyncCheck(Check):
    """missing_sync, sync_every_micro."""

    main_term_only = True

    def __init__(self, term: TermInputs) -> None:
        super().__init__(term)
        self.missing, self.unsynced, self.cleared = self.steps(), 0.0, 0
        self.missed = 0  # (group, step)s of missing: with cleared, what a step number repeated across groups hides
        self.every, self.every_count, self.multi_count = self.steps(), 0, 0
        self.every_micro = (math.inf, 0.0)  # the fewest and most microbatches of those steps
        self.endings: dict[str, Ending] = {}  # per group
        self.stand_in = term.stand_in
        self.run_last = term.later.told  # the run's last step with valid tokens, over every term
        self.others: OtherTermSyncs | None = term.other_syncs
        self.undecided, self.undecided_ranks = self.steps(), 0.0  # unsynchronized where another term synchronized
        self.applied_last = term.later.applied >= self.run_last  # a record of it, of any term, said applied

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        step, unsynced = column_of(block, "step"), column_of(block, "unsynced_ranks")
        # a group of one rank (W = 1) reduces nothing: its local gradient is the update's, synchronized or not
        alone = column_of(block, "world_high") == 1
        unsynced = np.where(alone, 0.0, unsynced)
        if self.others is not None and not self.stand_in:  # another term's backward synchronized: cannot tell
            for group, covered in grouped_rows(block, unsynced > 0):
                covered[covered] = self.others.covered(group, step[covered])
                self.undecided.add(step[covered])
                self.undecided_ranks += nan_sum(unsynced[covered])
                unsynced = np.where(covered, 0.0, unsynced)
        for group, rows in grouped(block.grp):
            self.endings.setdefault(group, Ending()).add(block, rows)
        records = column_of(block, "records")
        self.missing.add(step[unsynced > 0])
        self.unsynced += nan_sum(unsynced)
        # An update whose last microbatch never synchronized, closed as skipped: no optimizer step took it, its
        # gradients were cleared (zero_grad) before its window ended, and the update after it starts afresh.
        self.cleared += int(((unsynced > 0) & (column_of(block, "skipped_true") == records)).sum())
        self.missed += int((unsynced > 0).sum())
        multi = (column_of(block, "microbatches_high") > 1) & (column_of(block, "sync_known") == records) & ~alone
        every = multi & (column_of(block, "sync_true") == records)
        self.every.add(step[every])
        self.every_count += int(every.sum())
        if every.any():
            micro = column_of(block, "microbatches_high")[every]
            self.every_micro = (
                min(self.every_micro[0], float(micro.min())),
                max(self.every_micro[1], float(micro.max())),
            )
        self.multi_count += int(multi.sum())

    def findings(self) -> Iterator[Finding]:
        yield from self._stand_in_findings() if self.stand_in else self._main_findings()
        if self.undecided and not self.missing:
            yield self._undecided_finding()

    def _undecided_finding(self) -> Finding:
        """missing_sync where, at every such step, another term's records of the last microbatch synchronized: a
        backward of its own after the main loss's carried both (as DDP's no_sync() promises), one before it did not.
        The logs cannot tell which."""
        term = self.context.term
        return make_finding(
            self.context,
            Code.MISSING_SYNC,
            self.undecided,
            f"The last microbatch's record of loss term {term} did not synchronize gradients on "
            f"{int(self.undecided_ranks)} rank-step(s), where another loss term's record of that microbatch, a "
            "backward of its own, did: if that backward ran after this one's, its all-reduce carried both "
            "(DDP reduces what no_sync() accumulated at the first synchronized backward); if before, the last "
            f"gradients of {term} stayed local. The logs cannot tell which ran last.",
            "run every backward of the last microbatch outside model.no_sync(), or the one that synchronizes last",
            {"rank_steps": int(self.undecided_ranks), "synchronized_by_another_term": True},
            severity=Severity.WARNING,
            undecidable=True,
        )

    def _main_findings(self) -> Iterator[Finding]:
        if self.missing and self.cleared:
            steps = self.missed
            # Where every such update was cleared without a step, nothing of it reached the weights: what the
            # discarded microbatches cost the updates after them (a partial window's N) their weights show.
            all_cleared = self.cleared == steps
            yield make_finding(
                self.context,
                Code.MISSING_SYNC,
                self.missing,
                f"Gradients were cleared inside the accumulation window: in {self.cleared} of {steps} "
                "step(s) without a synchronized last microbatch, zero_grad() ran before that microbatch "
                "and no optimizer step took what came before it. The microbatches before each "
                "zero_grad() were discarded (a guard that drops a failed batch does this on purpose), so each "
                "update trained on the microbatches after it only.",
                "call optimizer.zero_grad() once per update, after optimizer.step(), never between the "
                "microbatches of one update",
                {"rank_steps": int(self.unsynced), "cleared_steps": self.cleared},
                severity=Severity.INFO if all_cleared else None,
            )
        elif self.missing:
            seen = self.missing.range()
            # the run's last update alone: a loop that ended inside it (a loader drawn ahead, whose end the trainer
            # did not see) neither syncs nor steps, and reads the same
            alone = seen.count == 1 and seen.first == self.run_last
            ended = (
                " Only the run's last step: if the run ended inside that update, nothing was applied." if alone else ""
            )
            # cut short in every group that holds it (`Ending.short`) and said applied by no record of any term: a
            # kill inside the update reads the same, and the logs cannot tell
            there = [ending for ending in self.endings.values() if ending.last == self.run_last]
            cannot = alone and bool(there) and not self.applied_last and all(e.short for e in there)
            yield make_finding(
                self.context,
                Code.MISSING_SYNC,
                self.missing,
                f"The last microbatch of a step did not synchronize gradients on "
                f"{int(self.unsynced)} rank-step(s): those ranks stepped on their local gradient.{ended}"
                + (
                    " It holds fewer microbatches than the updates before it and nothing says it was applied: the "
                    "logs cannot tell."
                    if cannot
                    else ""
                ),
                "run the last microbatch's forward (through the DDP model, not model.module) and backward outside "
                "model.no_sync()",
                {"rank_steps": int(self.unsynced), **({"cut_short": True} if cannot else {})},
                severity=Severity.WARNING if cannot else None,
                undecidable=True if cannot else None,
            )
        if self.every_count and self.every_count == self.multi_count:
            yield make_finding(
                self.context,
                Code.SYNC_EVERY_MICRO,
                self.every,
                f"Every microbatch synchronized gradients in {self.every_count} multi-microbatch step(s): "
                f"correct, but {_times(self.every_micro)} the communication.",
                "wrap all but the last microbatch in model.no_sync()",
                {"steps": self.every_count},
            )

    def _stand_in_findings(self) -> Iterator[Finding]:
        """A term standing for the main one in groups that hold none of it (`TermInputs.stand_in`): its last record
        unsynchronized may be of a microbatch before the update's last, which then holds no record of it. Updates
        closed as skipped (a guard's, cleared) are the main term's to say."""
        if not self.missing or self.cleared == self.missed:
            return
        term = self.context.term
        yield make_finding(
            self.context,
            Code.MISSING_SYNC,
            self.missing,
            f"The last record of loss term {term} did not synchronize gradients on {int(self.unsynced)} rank-step(s), "
            f"in a group that records no other loss (a pipeline stage's): if {term} is recorded on every microbatch, "
            "those ranks stepped on their local gradient; if not on the update's last (an auxiliary loss of some "
            "microbatches), that microbatch has no record. The logs cannot tell which.",
            f"record {term} on every microbatch of the update (a zero where the microbatch has none), or the stage's "
            "own loss, so its last microbatch is recorded",
            {"rank_steps": int(self.unsynced)},
            severity=Severity.WARNING,
            undecidable=True,
        )


def _times(micro: tuple[float, float]) -> str:
    """M× (M the microbatches of those steps), or M₁–M₂× where they differ."""
    low, high = int(micro[0]), int(micro[1])
    return f"{low}×" if low == high else f"{low}–{high}×"


@dataclass
class Seen:
    """What some steps of one (group, term) show."""

    fewest: float = np.inf
    """The fewest microbatches a rank holds."""
    most: float = -np.inf
    """The most."""
    unsynced: bool = False
    """Some rank's last microbatch did not synchronize, in an update not said skipped (a guard's, cleared)."""
    synced: bool = False
    """Some step synchronized on every rank."""
    applied: bool = False
    """Some record says its update was applied (`skipped` false)."""
    cut: bool = True
    """Every step: every rank's last microbatch unsynchronized, known so, and no record said applied or not."""

    def merge(self, other: Seen) -> None:
        self.fewest, self.most = min(self.fewest, other.fewest), max(self.most, other.most)
        self.unsynced, self.synced = self.unsynced or other.unsynced, self.synced or other.synced
        self.applied, self.cut = self.applied or other.applied, self.cut and other.cut

    @classmethod
    def of(cls, columns: dict[str, npt.NDArray[Any]], rows: npt.NDArray[np.bool_]) -> Seen:
        """Of these `rows` of a block's `columns` (`Ending.add`), read where they are, not copied out."""
        if not rows.any():
            return cls()
        unsynced, records, ranks = columns["unsynced_ranks"], columns["records"], columns["ranks"]
        known = columns["sync_known"] == records
        taken, dropped = columns["skipped_false"], columns["skipped_true"]
        said = dropped + taken
        return cls(
            fewest=float(columns["microbatches_low"][rows].min()),
            most=float(columns["microbatches_high"][rows].max()),
            unsynced=bool(((unsynced > 0) & (dropped != records) & rows).any()),
            synced=bool((known & (unsynced == 0) & rows).any()),
            applied=bool(((taken > 0) & rows).any()),
            cut=bool((known & (unsynced == ranks) & (said == 0) | ~rows).all()),
        )


_READ = (
    "sync_true",
    "unsynced_ranks",
    "records",
    "ranks",
    "sync_known",
    "skipped_false",
    "skipped_true",
    "microbatches_low",
    "microbatches_high",
)
"""What `Seen.of` reads; where no record says whether it synchronized (NaN), no step counts as synchronized or not."""


@dataclass
class Ending:
    """One (group, term)'s steps a part at a time: its last step, what it shows, and what the steps before it do."""

    last: float = -np.inf
    at: Seen = field(default_factory=Seen)
    before: Seen = field(default_factory=Seen)
    records: float = 0.0
    """Its records over every step, those that synchronized, and its steps of an accumulation's pattern
    (`accumulating`): which term is the main one (`main_term_first`)."""
    synced: float = 0.0
    accumulated: float = 0.0

    def add(self, block: pd.DataFrame, rows: Any = slice(None)) -> None:
        """These `rows` of a block (a slice, or the indices of one group's)."""
        step = column_of(block, "step")[rows]
        if not len(step):
            return
        if step.max() > self.last:  # what was the last step is one before it now
            if self.last > -np.inf:
                self.before.merge(self.at)
            self.last, self.at = float(step.max()), Seen()
        # the columns read, as arrays (a mask of a frame would copy every column of it); a skip not said is 0
        columns = {name: column_of(block, name)[rows] for name in _READ}
        for name in ("skipped_false", "skipped_true"):
            columns[name] = np.nan_to_num(columns[name].astype(float, copy=False))
        self.records += nan_sum(columns["records"])
        self.synced += float(np.nansum(columns["sync_true"].astype(float, copy=False)))
        self.accumulated += float(accumulating(columns["sync_true"], columns["records"], columns["ranks"]).sum())
        self.before.merge(Seen.of(columns, step < self.last))
        self.at.merge(Seen.of(columns, step == self.last))

    @property
    def short(self) -> bool:
        """Every rank of the last step holds fewer microbatches than the most a rank held before (a rank of as many
        ran its whole update: no kill's; updates of fewer microbatches, or ranks that run fewer, may come before), or
        it is the only step (no update says how many a whole one holds)."""
        return self.at.most < self.before.most or self.before.most == -np.inf


class OtherTermSyncs:
    """Of the main term's steps whose last microbatch did not synchronize on some rank (`ranks.MainSteps`), those
    another term's records show synchronized on every rank, of as many ranks (`add`, that term's blocks): its own
    backward synchronized last on each rank. Run after the main term's last, its all-reduce carried both; run before
    it, not the main loss's last gradients. The step table does not say which ran last, nor in which microbatch."""

    def __init__(self, main: MainSteps) -> None:
        self.main = main
        self.steps: dict[str, list[npt.NDArray[np.int64]]] = {}  # per group

    def add(self, block: pd.DataFrame) -> None:
        records, unsynced = column_of(block, "records"), column_of(block, "unsynced_ranks")
        rows = (unsynced == 0) & (column_of(block, "sync_known") == records) & (column_of(block, "sync_true") > 0)
        if not rows.any():
            return
        steps, ranks = column_of(block, "step").astype(np.int64), column_of(block, "ranks")
        for group, picked in grouped_rows(block, rows):
            found, _, main_ranks, main_unsynced = self.main.at(group, steps[picked])
            hit = found & (main_unsynced > 0) & (main_ranks == ranks[picked])
            self.steps.setdefault(group, []).append(steps[picked][hit])

    def covered(self, group: str, steps: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
        """Of these unsynchronized steps of the main term's group, those another term synchronized as above."""
        held = self.steps.get(group)
        return np.isin(steps, np.concatenate(held)) if held else np.zeros(len(steps), dtype=bool)
