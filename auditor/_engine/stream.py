"""A segment that no step range may cut (a pandas or pyarrow file per rank, each one row group over every step), read
once in step order: its files' batches merged into windows of whole steps, each aggregated as a range of its own.

Aggregated whole, such a segment holds every step's groups in DuckDB at once: past its memory limit the grouping
spills, and a segment of a million steps takes several times the time of the same records in ranges. Files that a
rank's log was written to are in step order; where one is not, `windows` says so and the segment is read whole.
Each file being read holds a buffer per column: a segment of many files is aggregated whole (DuckDB reads them
within its memory limit), as is one whose row groups span fewer steps, where the grouping fits."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokaudit._engine.ranges import CHUNK_ROWS, CHUNK_STEPS, units
from tokaudit._engine.tables import Duplicates, add_duplicates
from tokaudit._reader import Shard
from tokaudit._schema import COLUMNS_BY_NAME


BATCH_ROWS = 262_144
"""Rows decoded from one file at a time, at most: fewer where many files share a window (`windows`)."""

BUFFER_BYTES = 262_144
"""What one column of a file being read holds of it (pyarrow's buffered stream, not the whole column chunk)."""

MAX_FILES = 32
"""The most files a segment read in windows may have: each holds a buffer per column while it is read."""

WIDE_ROW_GROUP = 500_000
"""Steps a row group must span for its segment to be read in windows. DuckDB gives each thread a row group: one
that spans more steps than its hash table holds at once is flushed, unreduced, again and again, and the grouping
spills; below that the one aggregation is the faster (docs/performance.md, "Logs as other tools write them")."""


class Unsorted(Exception):
    """A file's steps go back, or one is missing: its records cannot be cut into windows of whole steps in one read."""


class Undecodable(Exception):
    """A file pyarrow cannot read (`name`, as DuckDB knows it): whether it is damaged is DuckDB's to say."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def streamable(shards: Sequence[Shard], threads: int = 1, range_rows: int = CHUNK_ROWS) -> bool:
    """A segment worth reading in windows, and one that can be. Worth it where a row group of it spans more than
    WIDE_ROW_GROUP steps, or where it has fewer row groups than DuckDB has `threads` and more records than a range
    holds (`range_rows`): DuckDB reads a row group on one thread, and the query's whole aggregation runs on the
    thread that reads it, where the windows' Arrow batches reach every thread. It can be where it has at most
    MAX_FILES files, each a local file read from its rows (not a footer's record, not object storage), all of one
    schema, one default run and the same columns given by their folders."""
    row_groups = sum(len(units(shard)) or 1 for shard in shards)
    lone = row_groups < threads and sum(shard.rows for shard in shards) > range_rows
    return (
        0 < len(shards) <= MAX_FILES
        and (lone or max(_widest(shard) for shard in shards) > WIDE_ROW_GROUP)
        and all(s.store is None and s.record is None for s in shards)
        and len({s.signature for s in shards}) == 1
        and len({(s.default_run, s.run_override, tuple(c for c, _ in s.partition)) for s in shards}) == 1
    )


def _widest(shard: Shard) -> int:
    """The most steps one unit of a shard a range may not cut spans (`ranges.units`; at most one a row). Without step
    statistics, its rows: such a file is a unit of its own, and may hold a step a row (where its steps are not in
    order, `windows` says so and it is read whole)."""
    return max((min(last - first + 1, rows) for first, last, rows in units(shard)), default=shard.rows)


def row_groups(shard: Shard, steps: tuple[int, int] | None) -> list[int] | None:
    """The row groups of a shard that hold steps of a range, None for every one: the whole log, or a file whose footer
    does not give each row group's steps, which a range holds whole (`ranges.units`). A range never cuts a row
    group, so these hold the range's records of the file and no other."""
    if steps is None or not shard.step_groups:
        return None
    return [i for i, (first, last, _) in enumerate(shard.step_groups) if first <= steps[1] and steps[0] <= last]


class _File:
    """One file's batches in step order (those of some row groups), and its rows read but not yet in a window."""

    def __init__(self, path: str, name: str, groups: list[int] | None, columns: list[str], batch_rows: int) -> None:
        # the names (run, group, term) as dictionaries: a string a row costs several times the decoding of the
        # numbers, where a dictionary holds the one name of a file once
        names = [c for c in columns if c in COLUMNS_BY_NAME and COLUMNS_BY_NAME[c].kind == "string"]
        self.file = pq.ParquetFile(path, buffer_size=BUFFER_BYTES, pre_buffer=False, read_dictionary=names)
        every = range(self.file.metadata.num_row_groups)
        self.groups, self.columns, self.batch_rows = list(every if groups is None else groups), columns, batch_rows
        self.batches: Iterator[pa.RecordBatch] = iter(())
        self.name = name
        self.pending: pa.Table | None = None
        self.steps = np.empty(0, dtype=np.int64)
        """The pending rows' steps, in order."""
        self.numbers = np.empty(0, dtype=np.int64)
        """The pending rows' numbers in the file."""
        self.next_row = 0
        """The file row number of the next row read."""
        self.last: int | None = None
        """The last step read."""
        self.done = False

    def _next(self) -> pa.RecordBatch | None:
        """The next batch of the row groups, in order."""
        batch = next(self.batches, None)
        while batch is None and self.groups:
            group = self.groups.pop(0)
            self.next_row = sum(self.file.metadata.row_group(i).num_rows for i in range(group))
            self.batches = self.file.iter_batches(batch_size=self.batch_rows, row_groups=[group], columns=self.columns)
            batch = next(self.batches, None)
        return batch

    def read(self) -> None:
        """The next batch into `pending`, or `done`: Unsorted where its steps go back or one is NULL, Undecodable
        where pyarrow cannot read it."""
        try:
            batch = self._next()
        except (pa.ArrowException, OSError):
            raise Undecodable(self.name) from None
        if batch is None:
            self.done = True
            return
        column = batch.column("step")
        if column.null_count:
            raise Unsorted(self.name)
        steps = column.to_numpy().astype(np.int64, copy=False)
        numbers = np.arange(self.next_row, self.next_row + len(steps), dtype=np.int64)
        self.next_row += len(steps)
        if len(steps) == 0:
            return
        if np.any(steps[1:] < steps[:-1]) or (self.last is not None and steps[0] < self.last):
            raise Unsorted(self.name)
        self.last = int(steps[-1])
        table = pa.Table.from_batches([batch])
        self.pending = table if self.pending is None else pa.concat_tables([self.pending, table])
        self.steps = np.concatenate([self.steps, steps])
        self.numbers = np.concatenate([self.numbers, numbers])

    def below(self, bound: int | None) -> int:
        """Pending rows whose step is below `bound` (None: every one)."""
        return len(self.steps) if bound is None else int(np.searchsorted(self.steps, bound, side="left"))

    def take(self, bound: int | None) -> pa.Table | None:
        """The pending rows below `bound`, with `filename` and `file_row_number` as DuckDB's scan of the file gives
        them; the rest stay pending."""
        count = self.below(bound)
        if count == 0 or self.pending is None:
            return None
        taken = self.pending.slice(0, count).replace_schema_metadata(None)
        numbers = self.numbers[:count]
        self.pending, self.steps, self.numbers = self.pending.slice(count), self.steps[count:], self.numbers[count:]
        # the name as a dictionary of one (DuckDB reads it as VARCHAR): not `count` copies of the string
        name = pa.DictionaryArray.from_arrays(pa.array(np.zeros(count, dtype=np.int32)), pa.array([self.name]))
        return taken.append_column("filename", name).append_column("file_row_number", pa.array(numbers))


def windows(files: Sequence[tuple[str, str, list[int] | None]], columns: list[str], rows: int) -> Iterator[pa.Table]:
    """The records of these files ((path, the name DuckDB knows it by, the row groups to read, None: every one)) in
    windows of whole steps, in step order, each of about `rows` records (more where one step holds more) and at most
    CHUNK_STEPS steps, every row decoded once. Unsorted where a file's steps go back, Undecodable where pyarrow
    cannot read one, either of which may come after some windows: the caller then sets aside what it made of them."""
    batch_rows = max(4_096, min(BATCH_ROWS, rows // (4 * max(len(files), 1))))
    readers = []
    for path, name, groups in files:
        try:
            readers.append(_File(path, name, groups, columns, batch_rows))
        except (pa.ArrowException, OSError):
            raise Undecodable(name) from None
    try:
        while True:
            reading = [r for r in readers if not r.done]
            fresh = next((r for r in reading if r.last is None), None)
            if fresh is not None:  # a file none of whose rows is read yet may hold any step
                fresh.read()
                continue
            # Each file's steps only go up: every row of a step below the least last step read has been read (every
            # row, once no file is left to read).
            bound = min(r.last or 0 for r in reading) if reading else None
            first = min((int(r.steps[0]) for r in readers if len(r.steps)), default=None)
            if first is None and not reading:
                return
            if first is not None and (bound is None or bound > first + CHUNK_STEPS):
                bound = first + CHUNK_STEPS  # a window of CHUNK_STEPS steps is ready
            elif sum(r.below(bound) for r in readers) < rows:
                min(reading, key=lambda r: r.last or 0).read()
                continue
            parts = [part for part in (r.take(bound) for r in readers) if part is not None]
            if parts:
                yield _merged(parts)
    finally:
        for reader in readers:
            reader.file.close()


def _merged(parts: list[pa.Table]) -> pa.Table:
    """The files' parts of one window as one table in step order. Each part is in step order already: a stable sort
    merges them (numpy's timsort finds the runs), and DuckDB's grouping by step then meets each step's records
    together, not one file's steps after another's (a window's query takes about two thirds of the time)."""
    table = pa.concat_tables([parts[0], *(p.cast(parts[0].schema) for p in parts[1:])])
    if len(parts) == 1:
        return table
    return table.take(np.argsort(table.column("step").to_numpy(), kind="stable"))


def windowed(
    files: Sequence[tuple[str, str, list[int] | None]],
    columns: list[str],
    rows: int,
    aggregated: Callable[[pa.Table], tuple[dict[str, Any], dict[str, Duplicates]]],
) -> tuple[list[dict[str, Any]], dict[str, Duplicates]]:
    """A segment's step table in parts, one a window (`windows`), each by `aggregated`, and the repeated keys of them
    all: every record of a step, and so every copy of a key, is in one window."""
    tables: list[dict[str, Any]] = []
    found: dict[str, Duplicates] = {}
    for window in windows(files, columns, rows):
        table, more = aggregated(window)
        add_duplicates(found, more)
        tables.append(table)
        del window
        pa.default_memory_pool().release_unused()  # Arrow's allocator keeps what a window freed
    return tables, found
