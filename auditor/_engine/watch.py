"""How far the aggregation is: the step range being aggregated and, from a thread, DuckDB's progress inside it."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import duckdb

POLL_SECONDS = 0.2
"""How often the running query's progress is asked for: a bar that moves, at no cost to the query."""


@dataclass(frozen=True)
class Aggregating:
    """Where the step table's aggregation is: range `index` (from 0) of `ranges`, over steps `steps` (None: every
    step), which holds the share `width` of the log's records after the share `start` of them, with the share
    `within` of its own aggregated (0 when it starts)."""

    index: int
    ranges: int
    steps: tuple[int, int] | None
    start: float
    width: float
    within: float = 0.0

    @property
    def done(self) -> float:
        """The share of the log's records aggregated, 0 to 1."""
        return min(self.start + self.width * min(max(self.within, 0.0), 1.0), 1.0)

    @property
    def started(self) -> bool:
        """Whether this is the range's start (not a share of it from the thread)."""
        return self.within == 0.0

    @property
    def what(self) -> str:
        """ "aggregating steps a–b" ("aggregating steps" where the range is every step)."""
        return "aggregating steps" + (f" {self.steps[0]:,}–{self.steps[1]:,}" if self.steps else "")

    def __str__(self) -> str:
        """ "aggregating steps a–b (i/n)" as the range starts, then with the share of the log done ("…, 40%")."""
        return f"{self.what} ({self.index + 1}/{self.ranges})" + ("" if self.started else f", {self.done:.0%}")


def shares(sizes: Sequence[int]) -> list[tuple[float, float]]:
    """Per range of these sizes (records), its (start, width) as shares of them all: equal where none is known."""
    total = sum(sizes)
    weights = [size / total for size in sizes] if total else [1 / len(sizes)] * len(sizes)
    return [(sum(weights[:index]), weight) for index, weight in enumerate(weights)]


Told = Callable[[Aggregating], None]
"""What is told where the aggregation is."""


class Watch:
    """One range's progress while its queries run: every POLL_SECONDS a thread reads DuckDB's progress in the
    running query and says the range's share done, that progress scaled to the part of the range the query
    covers (`covering`: a window's part of a segment). The share said never goes back (a second query over the
    same records, to leave duplicates out, starts again at 0)."""

    def __init__(self, connection: duckdb.DuckDBPyConnection, say: Callable[[float], None]) -> None:
        self.connection, self.say = connection, say
        self.part = (0.0, 1.0)
        self.said = 0.0
        self.stop = threading.Event()

    def covering(self, start: float, width: float) -> None:
        """The queries from now on aggregate the range's records from share `start`, `width` of them."""
        self.part = (start, width)

    def poll(self) -> None:
        while not self.stop.wait(POLL_SECONDS):
            try:
                percent = self.connection.query_progress()
            except duckdb.Error:  # the connection went away under the thread: nothing left to say
                return
            start, width = self.part
            share = start + width * min(percent, 100.0) / 100 if percent >= 0 else start
            if share > self.said:
                self.said = share
                self.say(share)


@contextmanager
def watching(connection: duckdb.DuckDBPyConnection, progress: Told | None, at: Aggregating) -> Iterator[Watch | None]:
    """Range `at` being aggregated while the block runs: `progress` is told it starts, then its share done by a
    `Watch` over the connection's queries (None: nothing is told). DuckDB counts its progress only while its
    progress bar is on (never printed: `enable_progress_bar_print`)."""
    if progress is None:
        yield None
        return
    progress(at)
    watch = Watch(connection, lambda within: progress(dataclasses.replace(at, within=within)))
    connection.execute("SET enable_progress_bar = true")
    thread = threading.Thread(target=watch.poll, name="tokaudit-progress", daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        watch.stop.set()
        thread.join()
        try:
            connection.execute("SET enable_progress_bar = false")
        except duckdb.Error:  # a connection an interrupt left unusable is closed by its owner
            pass
