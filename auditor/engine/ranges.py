"""Step ranges: a large log is aggregated a range of steps at a time, each range's files read once."""

from __future__ import annotations

import math

from tokaudit.reader import Shard


CHUNK_ROWS = 1_000_000

CHUNK_STEPS = 62_500
"""Steps aggregated at a time at most: a range's share of the step table and of DuckDB's groups."""

WHOLE_SEGMENT_ROWS = 5
"""Files that overlap in steps are aggregated together, never read twice, up to this many times the
chunk's rows (1,024 ranks' recorder shards, 4·10⁶ records, are one such segment)."""

def step_ranges(shards: list[Shard], chunk_rows: int, only_steps: tuple[int, int] | None = None
                ) -> list[tuple[tuple[int, int] | None, list[Shard]]]:
    """Step ranges of at most about `chunk_rows` rows and CHUNK_STEPS steps each, with the shards
    that overlap them. Rows bound DuckDB's aggregation; steps bound it too, and the range's share
    of the step table, which is what grows when each step has few records (few ranks, one
    microbatch).

    Ranges end between files whenever they can: DuckDB decodes a file whole for each range that
    overlaps it, so a file cut into k ranges is read k times. Files that overlap in steps form a
    segment (the shards of 1,024 ranks' recorders that cover the same 1,024 steps hold 4·10⁶
    records); segments are packed into ranges, a segment of up to WHOLE_SEGMENT_ROWS times
    `chunk_rows` is never cut, and only a larger one is cut into equal step ranges. With `only_steps`,
    the same ranges clipped to those steps (one step: one range)."""
    if only_steps is None:
        return _whole_ranges(shards, chunk_rows)
    first, last = only_steps
    clipped: list[tuple[tuple[int, int] | None, list[Shard]]] = []
    for steps, members in _whole_ranges(shards, chunk_rows):
        low, high = steps if steps is not None else only_steps
        if max(low, first) <= min(high, last):
            clipped.append(((max(low, first), min(high, last)), members))
    return clipped or [(only_steps, shards)]

def _whole_ranges(shards: list[Shard], chunk_rows: int) -> list[tuple[tuple[int, int] | None, list[Shard]]]:
    """`step_ranges` over every step of the shards."""
    if any(s.step_range is None for s in shards):
        return [(None, shards)]
    ordered = sorted(shards, key=lambda s: s.step_range or (0, 0))
    segments: list[tuple[int, int, int, list[Shard]]] = []  # (first step, last step, rows, shards)
    for shard in ordered:
        first, last = shard.step_range or (0, 0)
        if segments and first <= segments[-1][1]:
            low, high, rows, members = segments[-1]
            segments[-1] = (low, max(high, last), rows + shard.rows, members + [shard])
        else:
            segments.append((first, last, shard.rows, [shard]))
    total = sum(segment[2] for segment in segments)
    if total <= chunk_rows and _steps(segments[0][0], segments[-1][1], total) <= CHUNK_STEPS:
        return [(None, shards)]
    chunks: list[tuple[tuple[int, int] | None, list[Shard]]] = []
    packed: tuple[int, int, int, list[Shard]] | None = None
    for first, last, rows, members in segments:
        if packed is not None:
            low, high, held, shards = packed
            if held + rows <= chunk_rows and _steps(low, last, held + rows) <= CHUNK_STEPS:
                packed = (low, last, held + rows, shards + members)
                continue
            chunks.append(((low, high), shards))
            packed = None
        if rows <= chunk_rows * WHOLE_SEGMENT_ROWS and _steps(first, last, rows) <= CHUNK_STEPS:
            packed = (first, last, rows, members)
            continue
        count = min(max(math.ceil(rows / chunk_rows), math.ceil(_steps(first, last, rows) / CHUNK_STEPS)),
                    last - first + 1)
        edges = [first + (last - first + 1) * i // count for i in range(count + 1)]
        for low, stop in zip(edges, edges[1:]):
            inside = [s for s in members if s.step_range and s.step_range[0] < stop and s.step_range[1] >= low]
            if inside:
                chunks.append(((low, stop - 1), inside))
    if packed is not None:
        low, high, _, shards = packed
        chunks.append(((low, high), shards))
    return chunks

def _steps(first: int, last: int, rows: int) -> int:
    """Steps a range can hold: its span, and at most one a row whatever the numbering."""
    return min(last - first + 1, rows)
