"""A segment of more steps than a range holds, read once in windows of whole steps: every record once, with the file
row number DuckDB's scan gives it, and the same step table as the one aggregation of the segment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tokaudit._engine.database as database
import tokaudit._engine.stream as stream
from tests.logs import records, token_mean, local_mean
from tokaudit._engine import Engine
from tokaudit._loading import load


def _file(path: Path, steps: list[int], row_group_size: int | None = None) -> Path:
    """A file of one column `step` and a `value` that names each row (its file and its row number)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    values = [f"{path.name}:{row}" for row in range(len(steps))]
    pq.write_table(
        pa.table({"step": pa.array(steps, pa.int64()), "value": values}), path, row_group_size=row_group_size
    )
    return path


def _read(files: list[tuple[str, str, list[int] | None]], rows: int) -> list[pa.Table]:
    return list(stream.windows(files, ["step", "value"], rows))


def test_windows_hold_whole_steps_in_order_and_every_row_once_with_its_row_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream, "CHUNK_STEPS", 4)
    a = _file(tmp_path / "a.parquet", [0, 0, 1, 2, 2, 2, 5, 6, 9, 9, 9, 9, 10, 17], row_group_size=5)
    b = _file(tmp_path / "b.parquet", [1, 1, 1, 3, 4, 5, 5, 6, 7, 8, 12, 20])
    c = _file(tmp_path / "c.parquet", [2] * 9 + [3])  # one step of many rows
    files = [(str(f), f.name, [0, 1, 2] if f == a else [0]) for f in (a, b, c)]
    found = _read(files, rows=6)
    assert len(found) > 3
    steps = [w.column("step").to_pylist() for w in found]
    assert all(max(one) < min(two) for one, two in zip(steps, steps[1:]))  # whole steps, in order
    assert all(max(one) - min(one) < 4 for one in steps)  # at most CHUNK_STEPS steps a window
    assert all(one == sorted(one) for one in steps)  # the files' parts merged: each window in step order
    rows = [row for w in found for row in zip(w.column("filename").to_pylist(), w.column("file_row_number").to_pylist(),
                                             w.column("value").to_pylist())]  # fmt: skip
    assert sorted(value for _, _, value in rows) == sorted(
        f"{f.name}:{row}" for f, count in ((a, 14), (b, 12), (c, 10)) for row in range(count)
    )
    assert all(value == f"{name}:{number}" for name, number, value in rows)


def test_the_last_rows_read_are_windows_of_at_most_chunk_steps_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files read whole in their first batch: once nothing is left to read, what is pending is still cut every
    CHUNK_STEPS steps, not handed over as one window."""
    monkeypatch.setattr(stream, "CHUNK_STEPS", 4)
    a = _file(tmp_path / "a.parquet", list(range(5)))
    b = _file(tmp_path / "b.parquet", [0, 3, 3, 4])
    found = _read([(str(a), "a", None), (str(b), "b", None)], rows=1000)
    assert [sorted(set(w.column("step").to_pylist())) for w in found] == [[0, 1, 2, 3], [4]]


def test_windows_read_only_the_row_groups_asked_for_with_their_file_row_numbers(tmp_path: Path) -> None:
    f = _file(tmp_path / "a.parquet", list(range(12)), row_group_size=4)
    (window,) = _read([(str(f), "a", [1])], rows=100)
    assert window.column("step").to_pylist() == [4, 5, 6, 7]
    assert window.column("file_row_number").to_pylist() == [4, 5, 6, 7]
    assert window.column("value").to_pylist() == ["a.parquet:4", "a.parquet:5", "a.parquet:6", "a.parquet:7"]


@pytest.mark.parametrize("steps", [[0, 1, 2, 1, 3], [0, 1, None, 2]], ids=["a step goes back", "a step is missing"])
def test_a_file_whose_steps_are_not_in_order_is_said_to_be(tmp_path: Path, steps: list[Any]) -> None:
    f = _file(tmp_path / "a.parquet", steps, row_group_size=2)
    with pytest.raises(stream.Unsorted):
        _read([(str(f), "a", [0, 1, 2])], rows=2)


def _log(folder: Path, unsorted: bool = False) -> None:
    """A file per rank of one row group over every step, as pandas leaves a log: four ranks of two microbatches
    and 40 steps, a sync each, two loss terms, and one record written again by a later file."""
    rows = records([[[1 + (s * 3 + r) % 7, 2 + (s + r) % 5] for r in range(4)] for s in range(40)], token_mean)
    rows += [dict(r, term="aux", backward_scalar=0.5 * r["backward_scalar"]) for r in rows]
    for row in rows:
        row["sync"] = row["micro"] == 1 or (row["step"] == 9 and row["rank"] == 2)
    frame = pd.DataFrame(rows)
    for rank in range(4):
        mine = frame[frame["rank"] == rank].sort_values(["step", "micro"], kind="stable")
        if unsorted and rank == 3:
            mine = pd.concat([mine[mine.step >= 20], mine[mine.step < 20]])
        mine.to_parquet(folder / f"part-{rank:05d}.parquet", index=False)
    again = frame[(frame["rank"] == 1) & (frame["step"] == 17)].assign(loss_sum=lambda f: f.loss_sum + 1.0)
    again.to_parquet(folder / "part-00001-again.parquet", index=False)


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The windows the engine aggregates, and whether a file out of order ended them."""
    seen: dict[str, Any] = {"rows": [], "unsorted": False}
    original = stream.windows

    def counting(*args: Any, **kwargs: Any) -> Any:
        try:
            for window in original(*args, **kwargs):
                seen["rows"].append(window.num_rows)
                yield window
        except stream.Unsorted:
            seen["unsorted"] = True
            raise

    monkeypatch.setattr(stream, "windows", counting)
    return seen


@pytest.mark.parametrize("unsorted", [False, True], ids=["files in step order", "a file out of order"])
def test_a_segment_read_in_windows_gives_the_table_of_one_aggregation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unsorted: bool
) -> None:
    """Windows of at most 6 steps over a segment of 40: the same table and repeated keys as the one query over the
    segment; a file out of step order is found, and the segment is then read whole."""
    (tmp_path / "run").mkdir()
    _log(tmp_path / "run", unsorted)
    shards = load([tmp_path]).shards
    monkeypatch.setattr(stream, "CHUNK_STEPS", 6)
    assert not stream.streamable(shards)  # row groups of 40 steps: aggregated whole
    monkeypatch.setattr(stream, "WIDE_ROW_GROUP", 30)
    assert stream.streamable(shards)
    seen = _counting(monkeypatch)
    windowed = Engine.open(shards, chunk_rows=100)
    table = windowed.step_table()
    if unsorted:
        assert seen["unsorted"]
    else:
        assert len(seen["rows"]) >= 7 and sum(seen["rows"]) == 640 + 4 and not seen["unsorted"]
    monkeypatch.setattr(database, "streamable", lambda *_: False)
    whole = Engine.open(shards, chunk_rows=100)
    pd.testing.assert_frame_equal(whole.step_table(), table)
    assert whole.duplicates == windowed.duplicates and windowed.duplicates["run"].dropped == 4
    assert len(table) == 80


def test_the_report_of_a_log_read_in_windows_is_that_of_it_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokaudit import audit
    from tokaudit._render.json_report import render_json

    _pandas_log(tmp_path / "run")
    monkeypatch.setattr(stream, "CHUNK_STEPS", 6)
    monkeypatch.setattr(stream, "WIDE_ROW_GROUP", 30)
    seen = _counting(monkeypatch)
    windowed = render_json(audit([tmp_path]))
    assert len(seen["rows"]) >= 7
    monkeypatch.setattr(database, "streamable", lambda *_: False)
    whole = render_json(audit([tmp_path]))
    assert windowed == whole and '"local_mean"' in whole


def test_a_damaged_file_of_a_segment_read_in_windows_is_named_and_the_others_audited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose pages are damaged (its footer intact) in a segment read in windows: as read whole, the audit
    names the file and audits the others, never an internal error."""
    from tokaudit import audit
    from tokaudit._render.json_report import render_json

    _pandas_log(tmp_path / "run")
    damaged = tmp_path / "run" / "part-2.parquet"
    data = bytearray(damaged.read_bytes())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    data[4:footer] = b"\xff" * (footer - 4)  # every page, not the footer
    damaged.write_bytes(bytes(data))
    monkeypatch.setattr(stream, "CHUNK_STEPS", 6)
    monkeypatch.setattr(stream, "WIDE_ROW_GROUP", 30)
    whole: list[int] = []  # segments aggregated whole
    queried = database.Engine._queried

    def counting(self: database.Engine, steps: Any, shards: Any, scan: str | None = None) -> Any:
        whole.extend([len(shards)] if scan is None else [])
        return queried(self, steps, shards, scan)

    monkeypatch.setattr(database.Engine, "_queried", counting)
    windowed = audit([tmp_path])
    assert any("part-2.parquet: corrupt data" in p for p in windowed.problems), windowed.problems
    assert windowed.runs[0].rows == 3 * 2 * 40 and "ranks_not_recorded" in {f.code.value for f in windowed.findings}
    assert whole == []  # DuckDB read the damaged file alone, not the whole segment, before it was named
    monkeypatch.setattr(database, "streamable", lambda *_: False)
    assert render_json(audit([tmp_path])) == render_json(windowed)


def test_a_file_pyarrow_alone_cannot_read_is_aggregated_whole_by_duckdb(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where pyarrow fails on a file that DuckDB reads, the file is no damaged file: the segment is aggregated whole,
    with the report of the windows' audit, nothing named."""
    from tokaudit import audit
    from tokaudit._render.json_report import render_json

    _pandas_log(tmp_path / "run")
    monkeypatch.setattr(stream, "CHUNK_STEPS", 6)
    monkeypatch.setattr(stream, "WIDE_ROW_GROUP", 30)
    expected = render_json(audit([tmp_path]))
    batch = stream._File._next

    def failing(self: Any) -> Any:
        if self.name.endswith("part-2.parquet"):
            raise pa.ArrowInvalid("a reader of pyarrow's own")
        return batch(self)

    monkeypatch.setattr(stream._File, "_next", failing)
    assert render_json(audit([tmp_path])) == expected


def test_a_file_whose_footer_gives_no_row_group_s_steps_is_read_whole(tmp_path: Path) -> None:
    """A file of several row groups whose footer gives the file's steps but not each row group's (no null counts, as
    some writers leave it): a range holds it whole, so its windows read every row group, not the first alone."""
    import dataclasses

    from tokaudit._reader import Shard

    f = tmp_path / "run" / "part-0.parquet"
    f.parent.mkdir()
    table = pa.Table.from_pandas(pd.DataFrame(records([[[3]] for _ in range(12)], token_mean)), preserve_index=False)
    pq.write_table(table, f, row_group_size=4)
    (shard,) = load([tmp_path]).shards
    assert shard.step_groups and stream.row_groups(shard, (4, 7)) == [1]
    whole = Shard(**{**{f.name: getattr(shard, f.name) for f in dataclasses.fields(shard)}, "step_groups": ()})
    assert stream.row_groups(whole, (0, 11)) is None
    (window,) = stream.windows([(str(f), "a", stream.row_groups(whole, (0, 11)))], ["step"], rows=100)
    assert window.column("step").to_pylist() == window.column("file_row_number").to_pylist() == list(range(12))


def _pandas_log(folder: Path) -> None:
    """4 ranks × 40 steps of 2 microbatches, a rank-local mean, as pandas writes it: a file per rank, one row group."""
    folder.mkdir()
    frame = pd.DataFrame(records([[[1 + (s * 3 + r) % 7, 2] for r in range(4)] for s in range(40)], local_mean))
    for rank in range(4):
        frame[frame["rank"] == rank].to_parquet(folder / f"part-{rank}.parquet", index=False)


@pytest.mark.parametrize("shuffled", [False, True], ids=["steps in order", "steps out of order"])
def test_a_file_without_statistics_wider_than_a_row_group_may_be_is_read_in_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffled: bool
) -> None:
    """No footer gives its steps, so no range can cut it: once aggregated whole whatever its size (a million steps
    ran DuckDB out of memory), it is read in windows where its rows could span more steps than a row group may; a file
    out of step order is found and read whole. The report is the one of it read whole either way."""
    from tokaudit import audit
    from tokaudit._render.json_report import render_json

    frame = pd.DataFrame(records([[[1 + s % 5], [2 + s % 3]] for s in range(60)], local_mean))
    frame = frame.sample(frac=1.0, random_state=0) if shuffled else frame
    (tmp_path / "run").mkdir()
    pq.write_table(
        pa.Table.from_pandas(frame, preserve_index=False), tmp_path / "run" / "all.parquet", write_statistics=False
    )
    (shard,) = load([tmp_path]).shards
    assert shard.step_range is None
    monkeypatch.setattr(stream, "CHUNK_STEPS", 6)
    monkeypatch.setattr(stream, "WIDE_ROW_GROUP", 100)
    assert stream.streamable([shard])  # 120 rows: it may span 120 steps
    seen = _counting(monkeypatch)
    windowed = render_json(audit([tmp_path]))
    assert seen["unsorted"] == shuffled and (len(seen["rows"]) >= 10 or shuffled)
    monkeypatch.setattr(database, "streamable", lambda *_: False)
    assert render_json(audit([tmp_path])) == windowed and '"local_mean"' in windowed


def test_a_segment_of_fewer_row_groups_than_threads_is_read_in_windows_that_reach_every_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compaction job's file, every rank in one row group of 40 steps (fewer than a wide row group spans): DuckDB
    would aggregate it on the one thread that reads the row group. With two threads and more records than a range
    holds it is read in windows; with one thread, or as few records as a range holds, in one query. The same table."""
    frame = pd.DataFrame(records([[[1 + (s * 3 + r) % 7, 2] for r in range(4)] for s in range(40)], local_mean))
    (tmp_path / "run").mkdir()
    frame.sort_values(["step", "rank", "micro"]).to_parquet(tmp_path / "run" / "all.parquet", index=False)
    shards = load([tmp_path]).shards
    monkeypatch.setattr(stream, "CHUNK_STEPS", 6)
    assert stream.streamable(shards, threads=2, range_rows=100)
    assert not stream.streamable(shards, threads=1, range_rows=100)
    assert not stream.streamable(shards, threads=2, range_rows=320)  # its 320 records: a range's worth
    seen = _counting(monkeypatch)
    windowed = Engine.open(shards, threads=2, chunk_rows=100).step_table()
    assert len(seen["rows"]) >= 7 and sum(seen["rows"]) == 320 and not seen["unsorted"]
    windows = len(seen["rows"])
    whole = Engine.open(shards, threads=1, chunk_rows=100).step_table()
    assert len(seen["rows"]) == windows  # one query
    pd.testing.assert_frame_equal(whole, windowed)
    assert len(whole) == 40 and whole["ranks"].eq(4).all()


def test_names_that_differ_from_file_to_file_read_in_windows_give_the_report_of_the_log_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run, group and term of a window's records are read as dictionaries, one a file: two runs across the files
    and two terms within each give the report of the one aggregation."""
    from tokaudit import audit
    from tokaudit._render.json_report import render_json

    frame = pd.DataFrame(records([[[1 + (s * 3 + r) % 7, 2] for r in range(4)] for s in range(40)], local_mean))
    frame["run_id"] = ["first" if rank < 2 else "second" for rank in frame["rank"]]
    frame.loc[frame["micro"] == 1, "term"] = "aux"
    (tmp_path / "run").mkdir()
    for rank in range(4):
        frame[frame["rank"] == rank].to_parquet(tmp_path / "run" / f"part-{rank}.parquet", index=False)
    monkeypatch.setattr(stream, "CHUNK_STEPS", 6)
    monkeypatch.setattr(stream, "WIDE_ROW_GROUP", 30)
    seen = _counting(monkeypatch)
    windowed = render_json(audit([tmp_path]))
    assert len(seen["rows"]) >= 7 and not seen["unsorted"]
    monkeypatch.setattr(database, "streamable", lambda *_: False)
    whole = render_json(audit([tmp_path]))
    assert windowed == whole and '"first"' in whole and '"second"' in whole and '"aux"' in whole
