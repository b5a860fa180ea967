"""Step ranges: a large log is aggregated a range of steps at a time, each range's files read once."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tokaudit._reader import Shard


CHUNK_ROWS = 1_000_000

CHUNK_STEPS = 62_500
"""Steps aggregated at a time at most: a range's share of the step table and of DuckDB's groups."""


def step_ranges(
    shards: list[Shard], chunk_rows: int, only_steps: tuple[int, int] | None = None, threads: int = 1
) -> list[tuple[tuple[int, int] | None, list[Shard]]]:
    """Step ranges of at most about `chunk_rows` rows and CHUNK_STEPS steps each, with the shards that
    overlap them. Rows bound DuckDB's aggregation; steps bound it too, and the range's share of the step
    table, which is what grows when each step has few records (few ranks, one microbatch).

    A range never cuts a row group: DuckDB decodes a row group whole for each range that overlaps it, so
    a row group cut into k ranges would be decoded k times. Row groups that overlap in steps form a
    segment (1,024 ranks' recorder shards of the same 1,024 steps; a pandas file per rank, each of one row
    group over every step); segments are packed into ranges and never cut, however large: DuckDB's memory
    limit bounds a large one's aggregation (it spills), not a second read. DuckDB reads a row group on one
    thread: a range holds at least `threads` row groups where the log has them, past `chunk_rows` if it must
    (a file of 1Mi-row row groups, pyarrow's default, in ranges of one would be aggregated on one core). With
    `only_steps`, the same ranges clipped to those steps (one step: one range)."""
    if only_steps is None:
        return _whole_ranges(shards, chunk_rows, threads)
    first, last = only_steps
    clipped: list[tuple[tuple[int, int] | None, list[Shard]]] = []
    for steps, members in _whole_ranges(shards, chunk_rows, threads):
        low, high = steps if steps is not None else only_steps
        if max(low, first) <= min(high, last):
            clipped.append(((max(low, first), min(high, last)), members))
    return clipped or [(only_steps, shards)]


def _whole_ranges(
    shards: list[Shard], chunk_rows: int, threads: int
) -> list[tuple[tuple[int, int] | None, list[Shard]]]:
    """`step_ranges` over every step of the shards."""
    if any(s.step_range is None for s in shards):
        return [(None, shards)]
    # (first step, last step, rows, shard index) of each row group; a range's shards in step order (stable)
    shards = sorted(shards, key=lambda s: s.step_range or (0, 0))
    groups = sorted(
        (first, last, rows, index) for index, shard in enumerate(shards) for first, last, rows in units(shard)
    )
    # (first step, last step, rows, row groups, shard indices)
    segments: list[tuple[int, int, int, int, set[int]]] = []
    for first, last, rows, index in groups:
        if segments and first <= segments[-1][1]:
            low, high, held, count, members = segments[-1]
            members.add(index)
            segments[-1] = (low, max(high, last), held + rows, count + 1, members)
        else:
            segments.append((first, last, rows, 1, {index}))
    packed: list[tuple[int, int, int, int, set[int]]] = []
    for first, last, rows, count, members in segments:
        if packed:
            low, _, held, had, inside = packed[-1]
            if (held + rows <= chunk_rows or had < threads) and _steps(low, last, held + rows) <= CHUNK_STEPS:
                packed[-1] = (low, last, held + rows, had + count, inside | members)
                continue
        packed.append((first, last, rows, count, set(members)))
    if len(packed) == 1:  # the whole log: no step filter
        return [(None, shards)]
    return [((low, high), [shards[i] for i in sorted(inside)]) for low, high, _, _, inside in packed]


def units(shard: Shard) -> tuple[tuple[int, int, int], ...]:
    """What a range may not cut in a shard, as (first step, last step, rows): each row group where the footer gives
    each one's steps (`Shard.step_groups`), else the whole file; () without step statistics."""
    if shard.step_range is None:
        return ()
    return shard.step_groups or ((*shard.step_range, shard.rows),)


def range_rows(steps: tuple[int, int] | None, shards: Sequence[Shard]) -> int:
    """The records a range of `step_ranges` holds: its shards' units that overlap its steps (a range cuts none but
    where `only_steps` clipped it)."""
    if steps is None:
        return sum(shard.rows for shard in shards)
    return sum(rows for shard in shards for first, last, rows in units(shard) if first <= steps[1] and steps[0] <= last)


def _steps(first: int, last: int, rows: int) -> int:
    """Steps a range can hold: its span, and at most one a row whatever the numbering."""
    return min(last - first + 1, rows)


@dataclass(frozen=True)
class RangeTask:
    """One step range's aggregation as a worker elsewhere runs it alone (`aggregate_range`)."""

    shards: tuple[Shard, ...]
    """The range's shards, in the order of the engine that cut it (of two records of one key, the later file's wins)."""
    steps: tuple[int, int] | None
    extremes: bool
    prune: bool
    footer_rows: bool
    memory_limit: str

    def __str__(self) -> str:
        return f"steps {self.steps[0]}–{self.steps[1]}" if self.steps else "every step"


RangesMap = Callable[[Callable[[RangeTask], Any], Sequence[RangeTask]], Iterator[Any]]
"""An ordered map: the function's result for each task, in the tasks' order."""
