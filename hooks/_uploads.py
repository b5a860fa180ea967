"""Shards waiting to be written: a backlog bounded in bytes, and for object storage one thread that uploads it,
so that training never waits on a store that is slow, frozen or gone.

A local folder is written at each flush in the training thread (a disk answers at once, or fails at once);
what cannot be written waits in the backlog and is tried again at the next flush. An object store is written
by the uploader thread: a flush only hands it the records. After a failed upload it waits STORE_RETRY_S (or
for `close()`) before trying again. Either way, past BACKLOG_BYTES the oldest records are dropped and their
steps written down in the next shard; what `close()` could not write is said in one last warning.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from tokaudit.hooks._columns import ranges

BACKLOG_BYTES = 64 << 20
"""Records kept in memory while writes fail (a full disk, a store that is down): a few hundred thousand."""
STORE_RETRY_S = 30.0
"""After a failed upload, the next attempt waits this long (or for close())."""
CLOSE_WAIT_S = 60.0
"""How long close() waits for the uploader's last attempt (each request is bounded by the store's timeout)."""

Warn = Callable[[str, str], None]
Writer = Any
"""A shard writer: `write(table, metadata)` (`ShardWriter`, `StoreShardWriter`)."""
Metadata = Callable[[dict[int, int]], dict[bytes, bytes]]
"""The footer of the next shard, given the steps whose records were dropped ({step: records})."""


class Backlog:
    """Tables of records waiting to be written, in order, at most BACKLOG_BYTES; the steps of those dropped."""

    def __init__(self, warn: Warn, where: str) -> None:
        self.lock = threading.Lock()
        self.where = where
        """The folder or URL the shards go to, for the messages."""
        self.tables: list[pa.Table] = []
        self.dropped: dict[int, int] = {}
        """Step → records that could not be kept, written down in the next shard."""
        self.in_flight = 0
        """Rows taken by a write that has not returned yet."""
        self.in_flight_tables: list[pa.Table] = []
        """Those rows' tables, spooled at close() if their write never returns."""
        self.failed = 0
        """Tables at the front of `tables` that the last failed write held: retried alone, under the same name, so
        that one published after all is never published twice (`StoreShardWriter.landed`)."""
        self.error: BaseException | None = None
        """What the last write that failed raised."""
        self.warn = warn

    def __bool__(self) -> bool:
        with self.lock:
            return bool(self.tables)

    def add(self, table: pa.Table) -> None:
        with self.lock:
            self.tables.append(table)
            self._trim()

    def note_dropped(self, step: int, count: int) -> None:
        with self.lock:
            self.dropped[step] = self.dropped.get(step, 0) + count

    def write(self, writer: Callable[[], Writer], metadata: Metadata) -> BaseException | None:
        """One attempt to write every table waiting (the writer made on first use); on failure the tables wait
        again, and the error is returned. What a failed write held goes first and alone: skipped where it was
        published after all, else written again under the name it had (`StoreShardWriter.landed`)."""
        with self.lock:
            tables, failed, self.tables, self.failed = self.tables, self.failed, [], 0
        batch: list[pa.Table] = []
        try:
            if failed and getattr(writer(), "landed", lambda: False)():
                tables, failed = tables[failed:], 0
            while tables:
                batch = tables[:failed] if 0 < failed < len(tables) else tables
                with self.lock:
                    dropped = dict(self.dropped)
                    self.in_flight, self.in_flight_tables = sum(t.num_rows for t in batch), batch
                writer().write(pa.concat_tables(batch) if len(batch) > 1 else batch[0], metadata(dropped))
                self._written(dropped)
                tables, failed = tables[len(batch) :], 0
        except Exception as error:
            with self.lock:
                self.tables[:0] = tables
                # the tables of the write that failed, at the front (none written yet: those that failed before)
                self.failed = len(batch) or failed
                self.in_flight, self.in_flight_tables, self.error = 0, [], error
                self._trim()
            self.warn(
                "write",
                f"tokaudit: could not write a shard to {self.where} ({error!r}); the records are kept "
                "and written at a later flush, training goes on",
            )
            return error
        return None

    def _written(self, dropped: dict[int, int]) -> None:
        """A shard was written with these dropped steps in its footer; those dropped meanwhile wait for the next."""
        with self.lock:
            self.in_flight, self.in_flight_tables = 0, []
            for step, count in dropped.items():
                left = self.dropped.get(step, 0) - count
                if left > 0:
                    self.dropped[step] = left
                else:
                    self.dropped.pop(step, None)

    def say_unwritten(self, spool: Callable[[list[pa.Table]], str]) -> None:
        """At close: the records still waiting (or in an upload that did not return) kept in the local spool
        (`spool` writes them, and says where), and one warning with their steps and how to upload them later;
        lost only where the spool cannot be written either."""
        with self.lock:
            tables = self.tables + self.in_flight_tables  # an upload that never returned may still land: a copy
            steps: dict[int, int] = {}
            for table in tables:
                _count_steps(table, steps)
            count = sum(t.num_rows for t in tables)
        if not count:
            return
        listed = ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b, _ in ranges(steps)[:8])
        said = (
            f"tokaudit: {count} record(s) could not be written to {self.where} by close() (steps {listed}; "
            f"last error: {error_words(self.error)})"
        )
        try:
            kept = spool(tables)
        except Exception as error:
            self.warn("unwritten", f"{said}; nor kept in the local spool ({error!r}): they are lost")
            return
        self.warn("unwritten", f"{said}; they are kept in {kept}: `tokaudit sync` writes them there once it answers")

    def _trim(self) -> None:
        """Past BACKLOG_BYTES the oldest tables go; their steps are written down as dropped (lock held)."""
        if sum(t.nbytes for t in self.tables) <= BACKLOG_BYTES:
            return
        self.warn(
            "backlog",
            f"tokaudit: more than {BACKLOG_BYTES >> 20} MiB of records are waiting to be written; "
            "the oldest are dropped and their steps written down in the next shard",
        )
        while len(self.tables) > 1 and sum(t.nbytes for t in self.tables) > BACKLOG_BYTES:
            _count_steps(self.tables.pop(0), self.dropped)
            self.failed = max(0, self.failed - 1)


def error_words(error: BaseException | None) -> str:
    """The last write's error in words: "none" when none failed (an upload still running at close)."""
    if error is None:
        return "none; an upload was still running"
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}".rstrip(": ")


def _count_steps(table: pa.Table, counts: dict[int, int]) -> None:
    """The table's records added to `counts`, step by step."""
    for step in table.column("step").to_pylist():
        counts[int(step)] = counts.get(int(step), 0) + 1


class Uploader:
    """The thread that writes a backlog to object storage: woken by each flush, paused after a failure."""

    def __init__(self, backlog: Backlog, writer: Callable[[], Writer]) -> None:
        self.backlog = backlog
        self.writer = writer
        self.metadata: Metadata = lambda dropped: {}
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def kick(self, metadata: Metadata) -> None:
        """Write what is waiting, with this footer, as soon as the thread may."""
        self.metadata = metadata
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="tokaudit-uploads", daemon=True)
            self.thread.start()
        self.wake.set()

    def close(self) -> None:
        """One last attempt, whatever failed before; waits for it at most CLOSE_WAIT_S."""
        if self.thread is None:
            return
        self.stop.set()
        self.wake.set()
        self.thread.join(CLOSE_WAIT_S)

    def _run(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            stopping = self.stop.is_set()
            failed = self.backlog.write(self.writer, self.metadata) is not None
            if stopping:
                return
            if failed:
                self.stop.wait(STORE_RETRY_S)  # a store that failed costs seconds a try: the records wait
