"""A run whose ranks' records end at different steps: a rank killed at once (the OOM killer, a lost node: SIGKILL,
which no recorder can answer), or a job stopped before each rank wrote its last shard. The steps past the last one
every rank recorded hold only some ranks' tokens, so their N is partial. Where each rank's missing end is no longer
than the widest of its shards (what a recorder holds between two writes), and its last shard does not say its
recorder was closed by the training code (a rank that ran out of data under DDP's join() ends so), those steps are
left out and said (`unfinished_update`); otherwise a rank is missing, which `missing_rank` says: read from the
footers (`uneven_ends`). Where they cannot say (shards of several ranks each, as a compaction leaves them), each
rank's last step is read from the step table's rank masks and those steps are left out with a warning that the logs
cannot tell a kill from a deliberate end (`recorded_end`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._checks import grouped, rank_masks
from tokaudit.codes import DEFAULT_SEVERITY, Code, Severity
from tokaudit._reader import Shard
from tokaudit._report import Finding, StepRange


@dataclass(frozen=True)
class GroupEnd:
    """Where one group's ranks stopped recording."""

    complete: int
    """The last step every rank recorded."""
    last: int
    """The last step any rank recorded."""
    stopped: dict[int, int]
    """Each rank whose records end before `last`, and its last step."""


@dataclass(frozen=True)
class UnevenEnd:
    """One run's groups whose ranks' records end at different steps: each within what one shard holds, or (undecided)
    as the records alone show it."""

    groups: dict[str, GroupEnd]
    undecided: bool = False
    """Read from the records (`recorded_end`), no footer saying whether a rank was killed or closed: the finding is a
    warning that the logs cannot tell."""

    def covers(self, frame: pd.DataFrame) -> npt.NDArray[np.bool_]:
        """Rows of the step table past their group's last complete step."""
        return spans_cover(frame, {group: [(end.complete + 1, end.last)] for group, end in self.groups.items()})

    def finding(self, run: str) -> Finding:
        first = min(end.complete for end in self.groups.values()) + 1
        last = max(end.last for end in self.groups.values())
        stopped = sorted({(rank, step) for end in self.groups.values() for rank, step in end.stopped.items()})
        said = (
            f"rank {stopped[0][0]} stops at step {stopped[0][1]}"
            if len(stopped) == 1
            else "ranks "
            + ", ".join(f"{rank} (at step {step})" for rank, step in stopped[:8])
            + (f" and {len(stopped) - 8} more" if len(stopped) > 8 else "")
            + " stop"
        )
        cause = (
            "a rank killed at once with records unwritten, or one that stopped while the others trained on, such as a "
            "rank out of data under DDP's join(), whose tokens are then missing from N: shards of several ranks each "
            "(a compaction's) cannot say which"
            if self.undecided
            else "a rank killed at once, such as by the OOM killer or a lost node, or shards not yet written"
        )
        return Finding(
            run=run,
            code=Code.UNFINISHED_UPDATE,
            severity=Severity.WARNING if self.undecided else DEFAULT_SEVERITY[Code.UNFINISHED_UPDATE],
            steps=StepRange(first, last, sum(end.last - end.complete for end in self.groups.values())),
            message=f"The ranks' records end at different steps: {said} before the others' last step {last} "
            f"({cause}). Steps {first}–{last} hold only some ranks' tokens and are not judged; the steps before "
            "them are.",
            fix="nothing where a rank died; audit the shards as the recorder wrote them (one rank each) to tell a "
            "kill from a rank that stopped"
            if self.undecided
            else "nothing where a rank died; for a run still training, tokaudit check --live",
            undecidable=True if self.undecided else None,
            evidence={
                "last_complete_step": first - 1,
                "last_step": last,
                "stopped_ranks": [rank for rank, _ in stopped],
                "stopped_at": [step for _, step in stopped],
            },
        )


def spans_cover(frame: pd.DataFrame, spans: Mapping[str, Iterable[tuple[int, int]]]) -> npt.NDArray[np.bool_]:
    """Rows of the step table whose step lies in one of its group's spans (first, last): the steps left out of a
    run's judgement, here and where records were dropped (`summary.DroppedRecords`)."""
    hit = np.zeros(len(frame), dtype=bool)
    groups, steps = frame.grp.astype(str).to_numpy(), frame.step.to_numpy()
    for group, held in spans.items():
        mine = groups == group
        for first, last in held:
            hit |= mine & (steps >= first) & (steps <= last)
    return hit


@dataclass(frozen=True)
class FooterEnds:
    """What the footers say of where each (run, group)'s ranks stopped (`uneven_ends`)."""

    found: dict[str, UnevenEnd]
    """Per run, its groups whose ranks' records end at different steps, as a kill leaves them."""
    settled: set[tuple[str, str]]
    """The (run, group)s the footers settle, uneven or not."""
    closes: dict[tuple[str, str], dict[int, set[int]]]
    """Per (run, group) and rank, the last steps of its shards written at a close() by the training code in the
    group's latest launch."""
    blind: set[tuple[str, str]] | None
    """The (run, group)s with a close the footers place on no one rank; None: a close placed on no (run, group)."""
    joined: dict[str, tuple[tuple[str, int, int], ...]] = field(default_factory=dict)
    """Per run, (group, rank, step): each rank the training code closed at that step while the others went on
    (`closed_on_purpose`: out of data under DDP's join(); `Provenance.joined`)."""

    def unread(self, key: tuple[str, str]) -> bool:
        """Whether the records are not to say this (run, group)'s end (`recorded_end`): the footers settle it, or a
        close they cannot place might be the stopped rank's."""
        return key in self.settled or self.blind is None or key in self.blind


def uneven_ends(shards: Sequence[Shard]) -> FooterEnds:
    """Per run, its groups whose ranks' records end at different steps, each rank short of the last step by at most
    its widest shard and not closed then (`closed_on_purpose`). Only what the footers settle: shards of one rank each,
    whose run, group, steps and W they give, one W over the group (a resize ends the ranks it leaves), every rank
    below it holding a shard."""
    spans: dict[tuple[str, str], dict[int, tuple[int, int]]] = {}  # per rank: (its last step, its widest shard)
    launched: dict[tuple[str, str], dict[int, dict[int, set[int]]]] = {}  # per launch, per rank: the steps it closed
    worlds: dict[tuple[str, str], set[tuple[int, int] | None]] = {}
    unsettled: set[tuple[str, str]] = set()
    blind: set[tuple[str, str]] | None = set()
    for shard in shards:
        if shard.run_group is None:
            blind = None if shard.provenance.closed else blind
            continue
        key = (shard.default_run if shard.run_override else shard.run_group[0], shard.run_group[1])
        worlds.setdefault(key, set()).add(shard.world_range)
        launch = -1 if shard.provenance.launch is None else shard.provenance.launch
        launched.setdefault(key, {}).setdefault(launch, {})
        held, steps = shard.rank_range, shard.step_range
        if held is None or steps is None or held[0] != held[1]:
            unsettled.add(key)
            if shard.provenance.closed and blind is not None:
                blind.add(key)
            continue
        if shard.provenance.closed:
            launched[key][launch].setdefault(held[0], set()).add(steps[1])
        last, widest = spans.setdefault(key, {}).get(held[0], (steps[1], 0))
        spans[key][held[0]] = (max(last, steps[1]), max(widest, steps[1] - steps[0] + 1))
    # only a close in the group's latest launch can say a rank ended on purpose: an earlier launch's end is no join()
    closes = {key: by_launch[max(by_launch)] for key, by_launch in launched.items()}
    found: dict[str, dict[str, GroupEnd]] = {}
    settled: set[tuple[str, str]] = set()
    joined: dict[str, tuple[tuple[str, int, int], ...]] = {}
    for key, ranks in spans.items():
        world = next(iter(worlds[key])) if len(worlds[key]) == 1 else None
        if key in unsettled or world is None or world[0] != world[1] or not _every_rank(ranks, world[0]):
            continue
        settled.add(key)
        end = max(last for last, _ in ranks.values())
        stopped = {rank: last for rank, (last, _) in ranks.items() if last < end}
        closed = {
            rank: last for rank, last in stopped.items() if closed_on_purpose(closes.get(key, {}), rank, last, ranks)
        }
        if closed:
            joined[key[0]] = (*joined.get(key[0], ()), *((key[1], rank, last) for rank, last in sorted(closed.items())))
        ended = bool(closed)
        if stopped and not ended and all(end - ranks[rank][0] <= ranks[rank][1] for rank in stopped):
            found.setdefault(key[0], {})[key[1]] = GroupEnd(min(stopped.values()), end, stopped)
    return FooterEnds({run: UnevenEnd(groups) for run, groups in found.items()}, settled, closes, blind, joined)


def closed_on_purpose(closes: Mapping[int, set[int]], rank: int, last: int, ranks: Iterable[int]) -> bool:
    """Whether a rank whose records stop at `last` while the others go on was closed there by the training code (under
    DDP's join(), out of data): ended on purpose, its tokens missing from the others' updates. Where every rank closed
    at that step, the job ended there, and a relaunch went on without this rank (killed before its first shard)."""
    return last in closes.get(rank, set()) and not all(last in closes.get(other, set()) for other in ranks)


def recorded_end(run: str, parts: Callable[[], Iterable[pd.DataFrame]], footers: FooterEnds) -> UnevenEnd | None:
    """The run's groups that its footers do not settle (shards of several ranks each, as a compaction leaves them)
    whose ranks' records end at different steps, read from the step table's rank masks (W ≤ 64): one W, every rank
    below it recorded, and each step past the last complete one holding exactly the ranks not yet stopped. What
    ended them no record says (a rank killed with records unwritten, or one out of data under join()): those steps
    are left out, and the run is inconclusive (`UnevenEnd.undecided`). A first pass reads each group's last step
    alone; the groups whose last step lacks a rank are read whole. A stopped rank closed at its last step
    (`closed_on_purpose`) leaves the end to `missing_rank`."""
    last: dict[str, list[Any]] = {}  # per group: [its last step, the ranks there, every rank seen, its W's bounds]
    for part, group, rows in _groups(parts(), run, footers):
        steps, masks = part.step.to_numpy()[rows], rank_masks(part)[rows]
        top = steps.max()
        seen = last.setdefault(group, [top, np.uint64(0), np.uint64(0), np.inf, -np.inf])
        if top > seen[0]:
            seen[0], seen[1] = top, np.uint64(0)
        if top == seen[0]:
            seen[1] |= np.bitwise_or.reduce(masks[steps == top])
        seen[2] |= np.bitwise_or.reduce(masks)
        seen[3] = min(seen[3], np.min(part.world_low.to_numpy(dtype=float)[rows], initial=np.inf))
        seen[4] = max(seen[4], np.max(part.world_high.to_numpy(dtype=float)[rows], initial=-np.inf))
    ragged = {
        group
        for group, (_, there, every, low, high) in last.items()
        if low == high and 1 <= low <= 64 and every == (full := np.uint64((1 << int(low)) - 1)) and there != full
    }
    if not ragged:
        return None
    held: dict[str, list[tuple[Any, Any]]] = {}
    for part, group, rows in _groups(parts(), run, footers):
        if group in ragged:
            held.setdefault(group, []).append((part.step.to_numpy()[rows], rank_masks(part)[rows]))
    found = {
        group: end
        for group, pieces in held.items()
        if (end := _ragged(pieces, int(last[group][3]), footers.closes.get((run, group), {}))) is not None
    }
    return UnevenEnd(found, undecided=True) if found else None


def both_ends(footers: UnevenEnd | None, records: UnevenEnd | None) -> UnevenEnd | None:
    """A run's ragged ends as its footers say them and as its records do (other groups): undecided where any is."""
    if footers is None or records is None:
        return footers or records
    return UnevenEnd({**footers.groups, **records.groups}, undecided=True)


def _groups(parts: Iterable[pd.DataFrame], run: str, footers: FooterEnds) -> Iterator[tuple[pd.DataFrame, str, Any]]:
    """Each part's rows of each group whose end is the records' to say (`FooterEnds.unread`): (part, group, rows)."""
    for part in parts:
        for group, rows in grouped(part.grp):
            if not footers.unread((run, group)):
                yield part, group, rows


def _ragged(pieces: list[tuple[Any, Any]], world: int, closes: Mapping[int, set[int]]) -> GroupEnd | None:
    """One group's ragged end from its steps' rank masks (each step's terms' masks or-ed), if it has one."""
    steps, masks = (np.concatenate([p[i] for p in pieces]) for i in range(2))
    order = np.argsort(steps, kind="stable")
    steps, masks = steps[order], masks[order]
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    steps, masks = steps[starts], np.bitwise_or.reduceat(masks, starts)
    # each rank's last step: where its bit is last set
    last = {r: int(steps[np.flatnonzero((masks >> np.uint64(r)) & np.uint64(1))[-1]]) for r in range(world)}
    complete = min(last.values())
    tail = steps > complete
    expected = np.zeros(int(tail.sum()), dtype=np.uint64)
    for rank, at in last.items():
        expected |= (steps[tail] <= at).astype(np.uint64) << np.uint64(rank)
    if not np.array_equal(masks[tail], expected):
        return None  # a rank missing inside the tail and back after: no end, missing_rank
    stopped = {r: at for r, at in last.items() if at < steps[-1]}
    if any(closed_on_purpose(closes, rank, at, range(world)) for rank, at in stopped.items()):
        return None
    return GroupEnd(complete, int(steps[-1]), stopped)


def _every_rank(ranks: Mapping[int, object], world: int) -> bool:
    """Every rank below W holds a shard (distinct whole numbers: as many as W, each below it; never W's range)."""
    return len(ranks) == world and all(0 <= rank < world for rank in ranks)
