"""The engine gives the same per-step table whether it aggregates a log at once or a step range at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from tests.logs import UNEVEN_GA, local_mean, records, write
from tokaudit.engine import Engine
from tokaudit.reader import load


def test_chunked_aggregation_equals_whole(tmp_path: Path) -> None:
    rows = records(UNEVEN_GA * 4, local_mean, positions=8)
    for first in range(0, 12, 3):  # shards of 3 steps each, as a rotating writer leaves them
        write(tmp_path / "run" / f"rank-all-{first:06d}.parquet", [r for r in rows if first <= r["step"] < first + 3])
    write(tmp_path / "run" / "rank-all-999999.parquet", [r for r in rows if r["step"] == 7])  # duplicates
    shards = load([tmp_path]).shards
    assert all(s.step_range is not None for s in shards)
    whole = Engine.open(shards)
    chunked = Engine.open(shards, chunk_rows=10)
    assert len(chunked._chunks()) > 1
    expected, got = whole.step_table(1e-4), chunked.step_table(1e-4)
    pd.testing.assert_frame_equal(expected, got)
    assert whole.duplicates == chunked.duplicates == {"run": (4, 7, 7, 1)}
    # After aggregating, per-step queries see the whole (deduplicated) log again.
    assert len(chunked.records_at("run", 7)) == 4
    assert set(got.rank_mask[got.step == 11]) == {0b11}


def test_of_two_copies_without_time_the_later_file_wins(tmp_path: Path) -> None:
    """The shards' order decides, whatever names DuckDB is given (a plain path, or a link for a
    path with pattern characters)."""
    rows = records(UNEVEN_GA, local_mean)
    write(tmp_path / "run" / "rank-all-000000.parquet", rows)
    changed = [dict(r, loss_sum=r["loss_sum"] + 1.0) for r in rows if r["step"] == 1]
    write(tmp_path / "run" / "rank-all-000001[copy].parquet", changed)  # later in path order
    engine = Engine.open(load([tmp_path]).shards)
    engine.step_table(1e-4)
    got = engine.records_at("run", 1).sort_values(["rank", "micro"])
    want = sorted((r["rank"], r["micro"], r["loss_sum"]) for r in changed)
    assert [(int(a), int(b), float(c)) for a, b, c in zip(got["rank"], got["micro"], got["loss_sum"])] == want
    engine.close()


def test_an_audit_can_be_held_to_one_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trackers' audit runs beside training: `audit(threads=1)` reaches DuckDB, the report is the same."""
    import tokaudit.auditing as auditing

    write(tmp_path / "run" / "rank-all-000000.parquet", records(UNEVEN_GA, local_mean))
    seen: list[int] = []
    original = Engine.open

    def counting(*args: Any, **kwargs: Any) -> Engine:
        engine = original(*args, **kwargs)
        seen.append(int(engine.connection.execute("SELECT current_setting('threads')").fetchone()[0]))
        return engine

    monkeypatch.setattr(auditing.Engine, "open", counting)
    one = auditing.audit([tmp_path], threads=1)
    every = auditing.audit([tmp_path])
    assert seen[0] == 1 and seen[1] >= 1
    assert [f.code for f in one.findings] == [f.code for f in every.findings] and one.findings


def test_the_step_table_is_lean_and_its_ranges_are_joined_without_a_second_copy(tmp_path: Path) -> None:
    """The memory bound's mechanism at small scale: counts come back as 4-byte integers (float64 with
    NaN where no record said), never DuckDB's 16-byte sums or pandas' masked NA; and the ranges of a
    large log are joined a column at a time, each range's part let go once copied, so the join
    allocates the table once (a concat of whole frames holds it twice)."""
    import tracemalloc

    import numpy as np

    from tokaudit.engine import INTEGER_COLUMNS, _join

    rows = records(UNEVEN_GA * 4, local_mean, positions=8)
    write(tmp_path / "run" / "rank-all-000000.parquet", rows)
    steps = Engine.open(load([tmp_path]).shards, chunk_rows=10).step_table(1e-4)
    for column in INTEGER_COLUMNS:
        assert steps[column].dtype in (np.int32, np.float64), (column, steps[column].dtype)
    assert steps.skipped_true.isna().all() and steps.skipped_true.dtype == np.float64  # no `skipped` column
    assert not any(isinstance(t, pd.api.extensions.ExtensionDtype) and t.kind in "iu" for t in steps.dtypes)

    parts, rows_per_part, names = 4, 250_000, [f"c{i}" for i in range(8)]
    columns = {name: [np.full(rows_per_part, float(i)) for i in range(parts)] for name in names}
    whole = parts * rows_per_part * 8 * len(names)
    tracemalloc.start()
    try:
        frame = _join(columns)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert list(frame.columns) == names and len(frame) == parts * rows_per_part
    assert frame.c3.iloc[-1] == 3.0 and frame.c3.iloc[0] == 0.0
    assert peak < whole * 1.25, f"joining allocated {peak / whole:.2f}× the table"
