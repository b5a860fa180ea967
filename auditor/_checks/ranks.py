"""Ranks that recorded nothing or not every step: ranks_not_recorded (none of a group's steps), missing_rank (some)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._checks.base import (
    Check,
    FlaggedSteps,
    RunSteps,
    TermInputs,
    column_of,
    grouped,
    grouped_rows,
    make_finding,
)
from tokaudit._checks.base import RunContext, StepsSeen, rank_masks, step_list
from tokaudit._normalization import Diagnoses
from tokaudit.codes import Code, Severity
from tokaudit._report import Finding
from tokaudit._schema import UNNAMED


def ranks_not_recorded(source: RunSteps) -> dict[str, tuple[Sequence[int], int]]:
    """Per group: the ranks below W with no record in any step of that W (its files not given, or no recorder on it),
    and W; only the groups that lack some. Each W is that of the steps whose every record says it (an elastic run's
    each size): a step whose records disagree (a record's wrong W, world_size_inconsistent) makes up no absent rank.
    Up to W = 64 the steps' rank masks say which ranks recorded; past it, the ranks above the highest that recorded
    are absent (a run given the files of its first ranks alone)."""
    seen: dict[tuple[str, int], int] = {}
    highest: dict[tuple[str, int], int] = {}
    for block in source.blocks():
        masks, low, high = rank_masks(block), column_of(block, "world_low"), column_of(block, "world_high")
        top = column_of(block, "rank_max") if "rank_max" in block else None  # (a table without: no rank above is known)
        for group, one in grouped_rows(block, low == high):
            for w in np.unique(low[one]).tolist():
                at = one & (low == w)
                key = (group, int(w))
                seen[key] = seen.get(key, 0) | int(np.bitwise_or.reduce(masks[at]))
                highest[key] = max(highest.get(key, -1), int(np.nanmax(top[at])) if top is not None else 1 << 62)
    absent: dict[str, tuple[Sequence[int], int]] = {}
    for (group, w), mask in sorted(seen.items()):
        # (past 64 a range, however many: W may be two billion)
        ranks: Sequence[int] = _unset_ranks(mask, w) if w <= 64 else range(highest[group, w] + 1, w)
        if ranks and group not in absent:
            absent[group] = (ranks, w)
    return absent


def _unset_ranks(mask: int, below: int) -> list[int]:
    """The ranks under `below` whose bit a rank mask (rank_mask: bit r set where rank r recorded) does not set."""
    return [rank for rank in range(below) if not mask >> rank & 1]


def not_recorded_finding(
    run: str, source: RunSteps, absent: dict[str, tuple[Sequence[int], int]], pipelined: bool = False
) -> Finding:
    """ranks_not_recorded over every step of the run: which ranks of which group the files given lack, and that
    nothing else is judged. `pipelined`: recorded under a pipeline schedule, whose loss only its last stage
    computes: the recorder then wants the last stage's data-parallel group."""
    group, (ranks, w) = next(iter(sorted(absent.items())))
    steps = StepsSeen(True)
    for block in source.blocks():
        steps.add(column_of(block, "step"))
    where = "" if group == UNNAMED else f" of group {group}"
    held = w - len(ranks)
    context = RunContext(run=run, term=UNNAMED, world_size=w, world_sizes=(w,), microbatches=0, divisor=0.0, rtol=0.0)
    return make_finding(
        context,
        Code.RANKS_NOT_RECORDED,
        steps,
        f"The files given hold the records of {held} of W={w} ranks{where}: rank(s) {step_list(ranks)} "
        "have none in any step. Were their files left out, or is the Recorder made on some ranks only? "
        "Every step's N needs all ranks' tokens, so nothing about the normalization is judged.",
        "under pipeline parallelism only the last stage computes the loss: make the Recorder on the ranks of the "
        "last stage with group= their data-parallel group, whose size is W"
        if pipelined
        else "give the whole run's folder (every rank's shards), and make the Recorder on every rank",
        {
            "world_size": w,
            "ranks_not_recorded": list(ranks[:64]),
            **({"ranks_not_recorded_count": len(ranks)} if len(ranks) > 64 else {}),
            "group": group,
        },
    )


class MainSteps:
    """Per group, the main term's steps, from its blocks (`add`): the ranks that recorded each (`rank_mask`), how many,
    and how many of their last microbatches did not synchronize. What another term's checks compare with the main
    term's at the same step: its missing ranks (`MissingRanksCheck`), its synchronization (`sync.OtherTermSyncs`)."""

    def __init__(self) -> None:
        self.parts: dict[str, list[tuple[npt.NDArray[Any], ...]]] = {}
        self.joined: dict[str, tuple[npt.NDArray[Any], ...]] = {}

    def add(self, block: pd.DataFrame) -> None:
        steps, masks = column_of(block, "step").astype(np.int64), rank_masks(block)
        ranks, unsynced = (np.nan_to_num(column_of(block, c).astype(float)) for c in ("ranks", "unsynced_ranks"))
        for group, rows in grouped(block.grp):
            self.parts.setdefault(group, []).append((steps[rows], masks[rows], ranks[rows], unsynced[rows]))

    def at(self, group: str, steps: npt.NDArray[np.int64]) -> tuple[npt.NDArray[Any], ...]:
        """At these steps of a group: whether the main term holds each, and its rank mask, ranks and unsynchronized
        ranks there (0 where it holds none)."""
        if group in self.parts:  # joined once, in step order, when first asked
            held = self.parts.pop(group)
            order = np.argsort(np.concatenate([part[0] for part in held]), kind="stable")
            self.joined[group] = tuple(np.concatenate([part[k] for part in held])[order] for k in range(4))
        known = self.joined.get(group)
        if known is None or not len(known[0]):
            return (
                np.zeros(len(steps), dtype=bool),
                *(np.zeros(len(steps), dtype=t) for t in (np.uint64, float, float)),
            )
        at = np.minimum(np.searchsorted(known[0], steps), len(known[0]) - 1)
        found = known[0][at] == steps
        return (found, *(np.where(found, values[at], 0).astype(values.dtype) for values in known[1:]))


def _below(worlds: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
    """The mask of every rank below W (W ≤ 64): 2^W − 1, every bit at W = 64."""
    shift = np.minimum(worlds.astype(np.int64), 63).astype(np.uint64)
    return np.where(worlds >= 64, np.uint64(2**64 - 1), (np.uint64(1) << shift) - np.uint64(1)).astype(np.uint64)


class MissingRanksCheck(Check):
    """missing_rank: fewer ranks than W recorded a step that others recorded."""

    def __init__(self, term: TermInputs) -> None:
        super().__init__(term)
        keep_steps = term.keep_steps
        self.missing = FlaggedSteps(keep_steps)
        self.fit = True  # every such step's records weigh each token 1/N of their own tokens: q = e·N = 1
        self.joined: dict[str, dict[int, int]] = {}  # per group, each rank closed while the others went on: its step
        for group, rank, step in term.context.provenance.joined:
            self.joined.setdefault(group, {})[rank] = step
        self.unjoined = 0  # such steps a rank is missing from that no close before them explains
        # Another term's: every rank missing from it at such a step recorded the main term there (W ≤ 64)
        self.main_ranks = None if term.main_term else term.main_ranks
        self.elsewhere = self.main_ranks is not None

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        rows = column_of(block, "ranks") < column_of(block, "world_high")
        self.missing.add(block, rows)
        if not rows.any():
            return
        if self.elsewhere and self.main_ranks is not None:
            self.elsewhere = self._recorded_main(block, rows, self.main_ranks)
        self.unjoined += int((rows & ~_closed_before(block, self.joined)).sum())
        # an update every record of which says skipped (a guard's) trained nothing: its weights say nothing here
        weighed = rows & ~(column_of(block, "skipped_true") == column_of(block, "records"))
        if self.fit and weighed.any():
            tokens = column_of(block, "tokens")[weighed].astype(float)
            q = np.concatenate(
                [column_of(block, c)[weighed].astype(float) * tokens for c in ("weight_low", "weight_high")]
            )
            self.fit = bool(np.all(np.abs(q - 1) <= self.context.rtol))

    @staticmethod
    def _recorded_main(block: pd.DataFrame, rows: npt.NDArray[np.bool_], main: MainSteps) -> bool:
        """Every rank below W missing from these rows (ranks < W) recorded the main term at the same step."""
        worlds = column_of(block, "world_high")
        if (worlds[rows] > 64).any():
            return False
        steps, masks = column_of(block, "step").astype(np.int64), rank_masks(block)
        for group, flagged in grouped_rows(block, rows):
            absent = _below(worlds[flagged]) & ~masks[flagged]
            if np.any(absent & ~main.at(group, steps[flagged])[1]):
                return False
        return True

    def findings(self) -> Iterator[Finding]:
        if not self.missing:
            return
        if self.elsewhere and self.fit:
            yield self._other_term_finding()
            return
        first = self.missing.first
        w = int(first.world_high)
        absent = _unset_ranks(0 if pd.isna(first.rank_mask) else int(first.rank_mask), min(w, 64))
        listed = (
            f"ranks {step_list(absent)}"
            if w <= 64
            else f"{w - int(first.ranks)} ranks" + (f" (of those below 64: {step_list(absent)})" if absent else "")
        )
        # q = e·N over the records there: 1 on every one, within rtol, and the missing ranks held no token N counted
        held = (
            "the records there weigh every token 1/N of their own tokens, so the missing ranks held none that N counted; "
            "if they ran backward and only their rows were left out, record every backward, n = 0 included"
            if self.fit
            else "if it only skipped recording, its tokens are missing from N here"
        )
        # every such step lacks only ranks closed before it, and weighs each token 1/N of the ranks still training:
        # the token mean where join() divides by the initial W (its default), not by the ranks still joined
        shadowed = self.fit and self.unjoined == 0
        yield make_finding(
            self.context,
            Code.MISSING_RANK,
            self.missing.steps,
            f"{self.missing.rows} step(s) lack records from some ranks (step {int(first.step)}: {listed} "
            f"of W={w} have none). A rank that skips backward or a collective desynchronizes DDP; {held}."
            + (JOINED if shadowed else ""),
            "every rank runs forward, backward and every collective each microbatch, with a zero loss when "
            "it has no valid token",
            {"step": int(first.step), "missing_ranks": absent, "world_size": w, "weights_fit": self.fit},
            severity=Severity.WARNING if shadowed else None,
            undecidable=True if shadowed else None,
        )

    def _other_term_finding(self) -> Finding:
        """missing_rank of a term other than the main one whose missing ranks recorded the main term at those steps,
        the records there weighing every token 1/N of the term's own: they ran backward and the collectives, with
        no token of this term (an auxiliary loss of data only some ranks had)."""
        first, term = self.missing.first, self.context.term
        w = int(first.world_high)
        absent = _unset_ranks(0 if pd.isna(first.rank_mask) else int(first.rank_mask), w)
        return make_finding(
            self.context,
            Code.MISSING_RANK,
            self.missing.steps,
            f"{self.missing.rows} step(s) hold no record of loss term {term} from some ranks (step {int(first.step)}: "
            f"ranks {step_list(absent)} of W={w}), each of which recorded the main loss there: they ran backward "
            f"and its collectives, with no token of {term}. The records there weigh every token 1/N of {term}'s own "
            "tokens.",
            f"nothing, if those ranks had no token of {term}; under DDP a head that gets no gradient on some ranks "
            "needs find_unused_parameters=True, or a zero loss through it",
            {
                "step": int(first.step),
                "missing_ranks": absent,
                "world_size": w,
                "weights_fit": True,
                "recorded_main_term": True,
            },
            severity=Severity.INFO,
        )


JOINED = (
    " Those ranks' recorders were closed by the training code while the others went on (out of data under DDP's "
    "join(), which shadows their collectives): that is the token mean where join() divides by the initial W "
    "(divide_by_initial_world_size=True, its default), not where it divides by the ranks still joined; the logs "
    "cannot tell which ran."
)


def _closed_before(block: pd.DataFrame, joined: dict[str, dict[int, int]]) -> npt.NDArray[np.bool_]:
    """The steps (W ≤ 64) whose every missing rank the training code closed at an earlier step of their group, the
    others going on (out of data under DDP's join(): `Provenance.joined`)."""
    found = np.zeros(len(block), dtype=bool)
    if not joined:
        return found
    steps, world, masks = column_of(block, "step"), np.nan_to_num(column_of(block, "world_high")), rank_masks(block)
    for group, rows in grouped(block.grp):
        closed = joined.get(group, {})
        at = np.arange(len(block))[rows]
        small = (world[at] >= 1) & (world[at] <= 64)
        # every rank below W as a bit; W = 64: every bit (a shift by 64 is undefined)
        width = np.clip(world[at], 0, 63).astype(np.uint64)
        every = np.where(world[at] >= 64, np.uint64(2**64 - 1), (np.uint64(1) << width) - np.uint64(1))
        gone = np.zeros(len(at), dtype=np.uint64)
        for rank, step in closed.items():
            if rank < 64:
                gone |= np.where(steps[at] > step, np.uint64(1) << np.uint64(rank), np.uint64(0))
        found[at] = small & ((every & ~masks[at] & ~gone) == 0)
    return found
