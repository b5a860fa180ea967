"""How far the aggregation is: each range as it starts, in the log's records, and DuckDB's progress inside it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import duckdb
import pytest

from tests.logs import UNEVEN_GA, local_mean, records, write
from tokaudit._engine import Aggregating, Engine, step_ranges
from tokaudit._engine import watch
from tokaudit._engine.watch import Watch, shares
from tokaudit._loading import load


def test_each_range_s_share_is_its_records_and_the_shares_add_up_to_one() -> None:
    assert shares([300, 100]) == [(0.0, 0.75), (0.75, 0.25)]
    assert shares([0, 0]) == [(0.0, 0.5), (0.5, 0.5)]  # none known: equal
    at = Aggregating(1, 2, (10, 19), 0.75, 0.25)
    assert at.started and at.done == 0.75
    assert Aggregating(1, 2, (10, 19), 0.75, 0.25, within=0.5).done == 0.875
    assert Aggregating(1, 2, (10, 19), 0.75, 0.25, within=1.5).done == 1.0  # never past the whole


def test_the_engine_tells_each_range_as_it_starts_in_step_order(tmp_path: Path) -> None:
    rows = records(UNEVEN_GA * 4, local_mean)  # 12 steps, 4 records each
    for first in range(0, 12, 3):  # four shards of three steps
        write(tmp_path / "run" / f"rank-all-{first:06d}.parquet", [r for r in rows if first <= r["step"] < first + 3])
    shards = load([tmp_path]).shards
    engine = Engine.open(shards, chunk_rows=12, threads=1)  # a range of a shard each
    ranges = step_ranges(engine.shards, engine.chunk_rows, threads=1)
    told: list[Aggregating] = []
    engine.step_table(told.append)
    started = [at for at in told if at.started]
    assert [at.steps for at in started] == [steps for steps, _ in ranges] == [(0, 2), (3, 5), (6, 8), (9, 11)]
    assert [at.done for at in started] == [0.0, 0.25, 0.5, 0.75]  # a range of 12 records of 48 each
    assert all(0.0 <= at.done <= 1.0 for at in told)


class _Progressing:
    """A connection whose running query says these percentages, one each time it is asked (−1: no query)."""

    def __init__(self, percents: list[float]) -> None:
        self.percents = percents
        self.asked = threading.Event()

    def query_progress(self) -> float:
        if not self.percents:
            self.asked.set()
            return -1.0
        return self.percents.pop(0)


def _said(percents: list[float], covering: tuple[float, float] = (0.0, 1.0)) -> list[float]:
    connection = _Progressing(percents)
    said: list[float] = []
    watch = Watch(connection, said.append)  # type: ignore[arg-type]
    watch.covering(*covering)
    thread = threading.Thread(target=watch.poll)
    thread.start()
    assert connection.asked.wait(10)
    watch.stop.set()
    thread.join()
    return said


def test_the_watch_says_duckdb_s_progress_in_the_part_of_the_range_the_query_covers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(watch, "POLL_SECONDS", 0.001)
    assert _said([-1.0, 10.0, 50.0, 100.0]) == [0.1, 0.5, 1.0]
    # a second query over the same records (duplicates left out) starts at 0 again: the share never goes back
    assert _said([40.0, 80.0, 0.0, 30.0, 90.0]) == [0.4, 0.8, 0.9]
    # a window of the second half of a segment: its query's progress is a share of that half
    assert _said([0.0, 50.0, 100.0], covering=(0.5, 0.5)) == [0.5, 0.75, 1.0]


def test_a_running_query_s_progress_reaches_the_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """DuckDB's own progress, read from another thread while the query runs: the bar moves inside one range."""
    monkeypatch.setattr(watch, "POLL_SECONDS", 0.01)
    connection = duckdb.connect()
    told: list[Aggregating] = []
    with watch.watching(connection, told.append, Aggregating(0, 1, None, 0.0, 1.0)):
        start = time.monotonic()
        while time.monotonic() - start < 10 and len(told) < 2:
            connection.execute("SELECT count(DISTINCT i % 1000003), sum(i * i) FROM range(30000000) t(i)").fetchall()
    assert told[0].started and len(told) > 1, told
    assert all(0.0 < at.within <= 1.0 for at in told[1:])
    assert connection.execute("SELECT current_setting('enable_progress_bar')").fetchall() == [(False,)]
