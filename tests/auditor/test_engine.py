"""The engine gives the same per-step table whether it aggregates a log at once or a step range at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.logs import UNEVEN_GA, local_mean, records, token_mean, write, write_by_rank
from tokaudit._auditing import audit
from tokaudit._engine import EVIDENCE, Duplicates, Engine, step_ranges
from tokaudit._reader import NULLABLE_COLUMNS
from tokaudit._loading import load


def test_chunked_aggregation_equals_whole(tmp_path: Path) -> None:
    rows = records(UNEVEN_GA * 4, local_mean, positions=8)
    for first in range(0, 12, 3):  # shards of 3 steps each, as a rotating writer leaves them
        write(tmp_path / "run" / f"rank-all-{first:06d}.parquet", [r for r in rows if first <= r["step"] < first + 3])
    write(tmp_path / "run" / "rank-all-999999.parquet", [r for r in rows if r["step"] == 7])  # duplicates
    shards = load([tmp_path]).shards
    assert all(s.step_range is not None for s in shards)
    whole = Engine.open(shards)
    chunked = Engine.open(shards, chunk_rows=10)
    assert len(step_ranges(chunked.shards, chunked.chunk_rows)) > 1
    expected, got = whole.step_table(), chunked.step_table()
    pd.testing.assert_frame_equal(expected, got)
    assert _counts(whole.duplicates) == _counts(chunked.duplicates) == {"run": (4, 7, 7, 1)}
    # After aggregating, per-step queries see the whole (deduplicated) log again.
    assert len(chunked.records_at("run", 7)) == 4
    assert set(got.rank_mask[got.step == 11]) == {0b11}


def test_a_column_that_some_ranges_lack_joins_as_nan_there_and_as_values_elsewhere(tmp_path: Path) -> None:
    """A count that is NULL in one range only (a file without `skipped`, one with it) comes back from
    that range as NaN and from the others as integers: joined, it is float64 with NaN exactly where no
    record said, and the other values as they were, as when the log is aggregated at once."""
    import numpy as np

    rows = records(UNEVEN_GA * 4, local_mean)
    write(
        tmp_path / "run" / "rank-all-000000.parquet", [dict(r, skipped=r["rank"] == 1) for r in rows if r["step"] < 6]
    )
    write(tmp_path / "run" / "rank-all-000006.parquet", [r for r in rows if r["step"] >= 6])
    shards = load([tmp_path]).shards
    chunked = Engine.open(shards, chunk_rows=10)
    assert len(step_ranges(chunked.shards, chunked.chunk_rows)) > 1
    got, whole = chunked.step_table(), Engine.open(shards).step_table()
    pd.testing.assert_frame_equal(whole, got)
    assert got.skipped_true.dtype == np.float64
    assert got.skipped_true.isna().tolist() == [step >= 6 for step in got.step]
    assert got.skipped_true[got.step < 6].tolist() == [2.0] * 6  # rank 1's two microbatches
    assert isinstance(got.run.dtype, pd.CategoricalDtype) and list(got.run.cat.categories) == ["run"]


def test_of_two_copies_without_time_the_later_file_wins(tmp_path: Path) -> None:
    """The shards' order decides, whatever names DuckDB is given (a plain path, or a link for a
    path with pattern characters)."""
    rows = records(UNEVEN_GA, local_mean)
    write(tmp_path / "run" / "rank-all-000000.parquet", rows)
    changed = [dict(r, loss_sum=r["loss_sum"] + 1.0) for r in rows if r["step"] == 1]
    write(tmp_path / "run" / "rank-all-000001[copy].parquet", changed)  # later in path order
    engine = Engine.open(load([tmp_path]).shards)
    engine.step_table()
    got = engine.records_at("run", 1).sort_values(["rank", "micro"])
    want = sorted((r["rank"], r["micro"], r["loss_sum"]) for r in changed)
    assert [(int(a), int(b), float(c)) for a, b, c in zip(got["rank"], got["micro"], got["loss_sum"])] == want
    engine.close()


@pytest.mark.parametrize("fixed_name", ["0b6f-0.parquet", "f3a9-0.parquet"])
def test_of_other_writers_files_the_one_modified_last_wins_whatever_its_name(tmp_path: Path, fixed_name: str) -> None:
    """A run logged with pyarrow's write_to_dataset (files named by random UUIDs, no launch in their footers) as a
    rank-local mean, then fixed and launched again into the same folder: the later file's records are judged,
    whichever name sorts last, and the finding says how the copy kept was chosen. The earlier launch's updates may
    have trained the model (a resume that numbered its steps again) or not (a replay): inconclusive."""
    import os

    run = tmp_path / "exp1"
    first = write(
        run / ("f3a9-0.parquet" if fixed_name.startswith("0") else "0b6f-0.parquet"), records(UNEVEN_GA, local_mean)
    )
    fixed = write(run / fixed_name, records(UNEVEN_GA, token_mean))
    os.utime(first, ns=(1_700_000_000_000_000_000,) * 2)
    os.utime(fixed, ns=(1_700_000_060_000_000_000,) * 2)  # a minute later
    report = audit([run])
    (finding,) = report.findings
    assert report.runs[0].verdict == "inconclusive" and finding.code.value == "duplicate_records"
    assert (
        "(the file modified last, at equal times the later name, as these files do not say which launch"
        in finding.message
    )
    assert "the earlier launch's records weigh their tokens wrong (local_mean)" in finding.message
    assert finding.undecidable and finding.evidence["kept_by_modification_time"] is True


@pytest.mark.parametrize(
    ("first", "second", "verdict"),
    [
        (local_mean, token_mean, "inconclusive"),
        (token_mean, local_mean, "inconclusive"),
        (token_mean, token_mean, "correct"),
        (local_mean, local_mean, "incorrect"),
    ],
)
@pytest.mark.parametrize("later", [0, 1])
def test_two_launches_in_files_that_do_not_say_which_came_first_read_the_same_whichever_was_modified_last(
    tmp_path: Path, first: Any, second: Any, verdict: str, later: int
) -> None:
    """Two launches of one run id, each a file per rank (another writer's: no launch in the footers), the second
    numbering its steps from 0 again. Which was written last only the files' times say, and a copy that did not keep
    them turns it round: a launch that weighs its tokens wrong, the other right, is inconclusive either way; two
    right launches correct, two wrong incorrect."""
    import os

    for launch, mean in enumerate((first, second)):
        rows = records(UNEVEN_GA, mean)
        for rank in sorted({row["rank"] for row in rows}):
            path = write(
                tmp_path / "run" / f"rank-{rank:05d}-{launch:06d}.parquet", [r for r in rows if r["rank"] == rank]
            )
            seconds = 1_700_000_060 if launch == later else 1_700_000_000
            os.utime(path, ns=(seconds * 1_000_000_000,) * 2)
    report = audit([tmp_path / "run"])
    assert [run.verdict for run in report.runs] == [verdict]


def _written(path: Path, rows: list[dict[str, Any]], seconds: int) -> None:
    """Rows as another writer's file (no launch in its footer), modified at `seconds` past an epoch."""
    import os

    write(path, rows)
    os.utime(path, ns=((1_700_000_000 + seconds) * 1_000_000_000,) * 2)


def test_a_launch_s_copies_judged_alone_are_the_copies_left_out_not_files_whose_ranges_overlap(tmp_path: Path) -> None:
    """Which records an earlier launch holds is read from the copies left out, not guessed from the files' ranges:
    - a later launch written as hashed parts (each of every rank and step), both launches right: correct, no part
      judged alone as a launch (each holds part of a step's records);
    - three launches, the first a rank-local mean replayed by the second, the third resumed over the second's last
      steps: inconclusive, as two launches are (the first's copies, judged with the second's, were inconclusive);
    - an export of the right steps beside files whose other steps weigh wrong, recorded once: incorrect (those steps
      have no copy, so no order of the copies could make them right)."""
    counts = UNEVEN_GA * 4  # 12 steps
    rows = records(counts, token_mean)
    _written(tmp_path / "hashed" / "a.parquet", [r for r in rows if r["step"] < 8], 0)
    later = records(counts, token_mean, step_offset=0)
    later = [dict(r, loss_sum=r["loss_sum"] * 1.5, backward_scalar=r["backward_scalar"] * 1.5) for r in later]
    for part in (0, 1):
        _written(tmp_path / "hashed" / f"part-{part}.parquet", [r for i, r in enumerate(later) if i % 2 == part], 60)
    wrong = records(counts, local_mean)
    _written(tmp_path / "three" / "a.parquet", [r for r in wrong if r["step"] < 6], 0)
    _written(tmp_path / "three" / "b.parquet", [r for r in rows if r["step"] < 9], 60)
    _written(tmp_path / "three" / "c.parquet", [r for r in later if r["step"] >= 7], 120)
    mixed = [w if w["step"] in (5, 6) else r for r, w in zip(rows, wrong)]
    exported = [r for r in rows if r["step"] < 2 or r["step"] > 9]  # in float32: other bits, right values
    exported = [dict(r, loss_sum=float(np.float32(r["loss_sum"]))) for r in exported]
    _written(tmp_path / "hull" / "export.parquet", exported, 0)
    for rank in (0, 1):
        _written(tmp_path / "hull" / f"rank{rank}.parquet", [r for r in mixed if r["rank"] == rank], 60)
    verdicts = {run: audit([tmp_path / run]).runs[0].verdict for run in ("hashed", "three", "hull")}
    assert verdicts == {"hashed": "correct", "three": "inconclusive", "hull": "incorrect"}


def test_a_folder_of_many_runs_is_read_in_a_scan_a_schema_with_the_report_of_a_scan_a_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """150 runs, each a folder of 2 small shards (a sweep's folder): audited within DuckDB's default memory, where a
    scan a run took it all; and the report of runs read in one scan, each file's run joined, is the report of a scan
    a run, on runs named by their folder, by their run_id, and by folder and run_id (one id in two folders)."""
    from tokaudit._engine import sql

    for index in range(150):
        write_by_rank(
            tmp_path / "sweep" / f"lr-{index:03d}", records(UNEVEN_GA, local_mean if index % 7 else token_mean)
        )
    report = audit([tmp_path / "sweep"])
    assert len(report.runs) == 150 and {r.verdict for r in report.runs} == {"correct", "incorrect"}
    mixed = tmp_path / "mixed"
    write_by_rank(mixed / "plain", records(UNEVEN_GA, token_mean))
    write_by_rank(mixed / "a" / "x", records(UNEVEN_GA, token_mean, run_id="exp"))
    write_by_rank(mixed / "b" / "x", records(UNEVEN_GA, local_mean, run_id="exp"))
    write_by_rank(mixed / "named", records(UNEVEN_GA, local_mean, run_id="other"))
    from tokaudit._render.json_report import render_json

    per_run = render_json(audit([mixed]))
    monkeypatch.setattr(sql, "RUN_SCANS", 0)
    monkeypatch.setattr("tokaudit._engine.database.RUN_SCANS", 0)
    assert render_json(audit([mixed])) == per_run


def test_an_audit_can_be_held_to_one_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trackers' audit runs beside training: `audit(threads=1)` reaches DuckDB, the report is the same."""
    import tokaudit._auditing as auditing

    write(tmp_path / "run" / "rank-all-000000.parquet", records(UNEVEN_GA, local_mean))
    seen: list[int] = []
    original = Engine.open

    def counting(*args: Any, **kwargs: Any) -> Engine:
        engine = original(*args, **kwargs)
        seen.append(int(engine.connection.execute("SELECT current_setting('threads')").fetchone()[0]))
        return engine

    monkeypatch.setattr(Engine, "open", counting)
    one = auditing.audit([tmp_path], threads=1)
    every = auditing.audit([tmp_path])
    assert seen[0] == 1 and seen[1] >= 1
    assert [f.code for f in one.findings] == [f.code for f in every.findings] and one.findings


def test_an_engine_s_database_keeps_no_threads_for_asynchronous_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DuckDB 2 gives every database 8 threads for asynchronous I/O besides `threads`: an engine's has none,
    and a DuckDB without that setting still opens the log, with the same table."""
    import duckdb

    import tokaudit._engine.connection as engine_module

    write(tmp_path / "run" / "rank-all-000000.parquet", records(UNEVEN_GA, local_mean))
    shards = load([tmp_path]).shards
    plain = duckdb.connect()
    known = plain.execute("SELECT count(*) FROM duckdb_settings() WHERE name = 'async_threads'").fetchone()
    assert known is not None
    if known[0]:
        assert int(plain.execute("SELECT current_setting('async_threads')").fetchone()[0]) > 0
    plain.close()
    engine = Engine.open(shards)
    if known[0]:
        assert int(engine.connection.execute("SELECT current_setting('async_threads')").fetchone()[0]) == 0
    table = engine.step_table()
    engine.close()
    monkeypatch.setattr(engine_module, "_QUIET_IO", {"a_setting_no_duckdb_has": 0})
    older = Engine.open(shards)
    pd.testing.assert_frame_equal(older.step_table(), table)
    older.close()


def test_the_step_table_is_lean_and_its_ranges_are_joined_without_a_second_copy(tmp_path: Path) -> None:
    """The memory bound's mechanism at small scale: counts come back as 4-byte integers (float64 with
    NaN where no record said), never DuckDB's 16-byte sums or pandas' masked NA; and the ranges of a
    large log are joined a column at a time, each range's part let go once copied (what the join holds at
    its peak is measured in bench/)."""
    import numpy as np

    from tokaudit._engine import STEP_COLUMNS
    from tokaudit._engine.tables import join_columns

    rows = records(UNEVEN_GA * 4, local_mean, positions=8)
    write(tmp_path / "run" / "rank-all-000000.parquet", rows)
    steps = Engine.open(load([tmp_path]).shards, chunk_rows=10).step_table()
    for column in (c.name for c in STEP_COLUMNS if c.type == "INTEGER" and not c.evidence):
        assert steps[column].dtype in (np.int32, np.float64), (column, steps[column].dtype)
    assert steps.skipped_true.isna().all() and steps.skipped_true.dtype == np.float64  # no `skipped` column
    assert not any(isinstance(t, pd.api.extensions.ExtensionDtype) and t.kind in "iu" for t in steps.dtypes)

    parts, rows_per_part, names = 4, 250_000, [f"c{i}" for i in range(8)]
    columns = {name: [np.full(rows_per_part, float(i)) for i in range(parts)] for name in names}
    frame = pd.DataFrame(join_columns(columns), copy=False)
    assert list(frame.columns) == names and len(frame) == parts * rows_per_part
    assert frame.c3.iloc[-1] == 3.0 and frame.c3.iloc[0] == 0.0
    assert not columns, "each column's parts are let go as it is joined"

    # A column made of another's very parts (`sql.aliases`) is joined with it:
    # their parts are let go then, not when the alias's turn comes, and the alias is the joined array.
    import weakref

    import tokaudit._engine.tables as engine_module

    shared = [np.arange(5.0), np.arange(5.0, 10.0)]
    alive = [weakref.ref(part) for part in shared]
    columns = {"weight_low": shared, "between": [np.ones(5), np.zeros(5)], "token_weight_low": list(shared)}
    del shared
    seen: list[bool] = []
    original = engine_module.constant_of

    def constant(parts: list[Any]) -> Any:
        if parts[0][0] == 1.0:  # the column in between: the aliased parts must be gone by now
            seen.append(all(ref() is None for ref in alive))
        return original(parts)

    engine_module.constant_of = constant
    try:
        joined = join_columns(columns)
    finally:
        engine_module.constant_of = original
    assert seen == [True] and list(joined) == ["weight_low", "between", "token_weight_low"]
    assert joined["token_weight_low"] is joined["weight_low"] and joined["weight_low"].tolist() == list(range(10))


def test_one_record_per_rank_is_aggregated_without_a_per_rank_table_and_gives_the_same_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logs of one microbatch (every record microbatch 0, from the footers) skip the per-(rank, step)
    hash table. Its table must be the general one's, whatever the records hold: zero-token ranks, a
    missing rank, non-finite values, probe weights on some records, unknown sync, two loss terms, and a
    step written twice (found and deduplicated the same way)."""
    import tokaudit._engine.database as engine_module
    from tests.logs import token_mean

    counts = [[[5], [0], [7], [3]], [[4], [9], [2], [6]], [[1], [1], [8], [0]], [[6], [6], [6], [6]]] * 3
    rows = records(counts, local_mean, positions=16, reported_loss=2.3)
    rows += [dict(r, term="aux", backward_scalar=0.01 * r["backward_scalar"]) for r in records(counts, token_mean)]
    for index, row in enumerate(rows):
        if index % 7 == 0:
            row.update(token_weight_sum=1.0, token_weight_min=0.5, token_weight_max=1.5, masked_weight_abs_sum=0.0)
        row["sync"] = None if index % 5 == 0 else index % 3 != 0
    rows[9]["backward_scalar"] = float("nan")
    rows = [r for r in rows if not (r["step"] == 5 and r["rank"] == 2)]  # a missing rank
    for rank in range(4):
        write(tmp_path / "run" / f"rank-{rank:05d}-000000.parquet", [r for r in rows if r["rank"] == rank])
    write(tmp_path / "run" / "rank-00001-000001.parquet", [r for r in rows if r["rank"] == 1 and r["step"] == 6])
    shards = load([tmp_path]).shards
    assert engine_module.one_record_form(shards)

    fast = Engine.open(shards, chunk_rows=25)
    fast_steps = fast.step_table()
    fast_extremes = Engine.open(shards, chunk_rows=25, extremes=True).step_table()
    monkeypatch.setattr(engine_module, "one_record_form", lambda shards: False)
    general = Engine.open(shards, chunk_rows=25)
    general_steps = general.step_table()
    pd.testing.assert_frame_equal(general_steps, fast_steps)
    # and the evidence columns, aggregated in both forms
    general_extremes = Engine.open(shards, chunk_rows=25, extremes=True).step_table()
    pd.testing.assert_frame_equal(general_extremes, fast_extremes)
    pd.testing.assert_frame_equal(general_extremes.drop(columns=list(EVIDENCE)), general_steps)
    assert fast.duplicates == general.duplicates and _counts(fast.duplicates) == {"run": (2, 6, 6, 1)}
    assert fast_steps.repeated_micro.sum() == 0  # deduplicated before the table was kept

    # The mechanism: one grouping (per step) instead of five, none of them per record.
    def groupings(one_record: bool) -> int:
        sql = "EXPLAIN (FORMAT json) " + engine_module.step_sql(one_record)
        return sum(text.count("GROUP_BY") for _, text in fast.connection.execute(sql).fetchall())

    assert groupings(True) == 1 and groupings(False) == 5
    # and the columns that equal another (M = 1, e·n_r = e·n, a rank a record) are that column's memory, not a copy
    import numpy as np

    assert set(engine_module.aliases(True)) == {
        "ranks",
        "microbatches_high",
        "weight_by_record_m_low",
        "weight_by_record_m_high",
        "weight_by_rank_low",
        "weight_by_rank_high",
    }
    for name, same in engine_module.aliases(True).items():
        assert np.shares_memory(fast_steps[name].to_numpy(), fast_steps[same].to_numpy()), name
        assert not np.shares_memory(general_steps[name].to_numpy(), general_steps[same].to_numpy()), name


@pytest.mark.parametrize("ranks", [4, 70], ids=["ranks-below-64", "ranks-past-64"])
def test_the_one_record_form_finds_a_rank_written_twice_as_the_general_form_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranks: int
) -> None:
    """Below 64 ranks (records − distinct ranks, as set bits) and past it (where the general form is taken), a
    rank whose step is written twice is found and deduplicated as by the general form."""
    import tokaudit._engine.database as engine_module
    from tests.logs import token_mean

    rows = records([[[1 + (rank * 7 + step) % 11] for rank in range(ranks)] for step in range(3)], token_mean)
    write(tmp_path / "run" / "ranks-low.parquet", [r for r in rows if r["rank"] < ranks // 2])
    write(tmp_path / "run" / "ranks-high.parquet", [r for r in rows if r["rank"] >= ranks // 2])
    write(tmp_path / "run" / "again.parquet", [r for r in rows if r["rank"] == ranks - 2 and r["step"] == 1])
    shards = load([tmp_path]).shards
    assert engine_module.one_record_form(shards) == (ranks < 64)
    fast = Engine.open(shards)
    fast_steps = fast.step_table()
    monkeypatch.setattr(engine_module, "one_record_form", lambda shards: False)
    general = Engine.open(shards)
    pd.testing.assert_frame_equal(general.step_table(), fast_steps)
    assert fast.duplicates == general.duplicates and _counts(fast.duplicates) == {"run": (1, 1, 1, 1)}


def test_the_one_record_form_is_taken_only_when_every_footer_says_microbatch_0(tmp_path: Path) -> None:
    from tokaudit._engine.sql import one_record_form

    write(tmp_path / "a" / "rank-00000.parquet", records([[[3], [4]]], local_mean))
    write(tmp_path / "b" / "rank-00000.parquet", records([[[3, 4], [4, 1]]], local_mean))
    one, two = load([tmp_path / "a"]).shards, load([tmp_path / "b"]).shards
    assert one_record_form(one)
    assert not one_record_form(two) and not one_record_form(one + two) and not one_record_form([])
    wide = [one[0].__class__(**{**{f: getattr(one[0], f) for f in one[0].__slots__}, "rank_range": (0, 64)})]
    assert not one_record_form(wide)


def test_ranges_end_between_files_so_that_no_file_is_read_twice(tmp_path: Path) -> None:
    """Recorder layout: every rank's shard covers the same steps (a generation of files). Ranges end
    where generations do, so each file is in one range, however large a generation is; the table is the whole
    aggregation's."""
    counts = [[[3, 1], [2, 2], [0, 4]]] * 12  # 3 ranks × 2 microbatches: 6 records a step
    rows = records(counts, local_mean)
    for first in range(0, 12, 4):  # generations of 4 steps: 24 records in 3 files
        for rank in range(3):
            write(
                tmp_path / "run" / f"rank-{rank:05d}-{first:06d}.parquet",
                [r for r in rows if r["rank"] == rank and first <= r["step"] < first + 4],
            )
    shards = load([tmp_path]).shards
    whole = Engine.open(shards).step_table()
    for chunk_rows, ranges in ((30, 3), (50, 2), (10, 3)):  # 24 > 10: a generation is still whole
        engine = Engine.open(shards, chunk_rows=chunk_rows)
        chunks = step_ranges(engine.shards, engine.chunk_rows)
        assert len(chunks) == ranges
        assert sorted(s.path for _, members in chunks for s in members) == sorted(s.path for s in shards)
        pd.testing.assert_frame_equal(whole, engine.step_table())
    engine = Engine.open(shards, chunk_rows=4)  # a generation of 24 records is never cut, however small a range
    chunks = step_ranges(engine.shards, engine.chunk_rows)
    assert [steps for steps, _ in chunks] == [(0, 3), (4, 7), (8, 11)]
    pd.testing.assert_frame_equal(whole, engine.step_table())


def test_no_row_group_is_decoded_in_two_ranges_whatever_the_writer(tmp_path: Path) -> None:
    """Logs as pandas or pyarrow leave them: a file per rank, either of one row group over every step (no range
    can end inside it) or of row groups of 8 steps (ranges end between them). Each row group, as pyarrow's own
    footer reader lists it, overlaps exactly one range, and the table is the whole aggregation's."""
    import pyarrow.parquet as pq

    rows = records([[[3, 1], [2, 2], [0, 4]]] * 24, local_mean)
    for row_group_size, expected in ((10_000, [None]), (16, [(0, 7), (8, 15), (16, 23)])):
        folder = tmp_path / f"groups-{row_group_size}" / "run"
        for rank in range(3):
            table = pd.DataFrame([r for r in rows if r["rank"] == rank])
            folder.mkdir(parents=True, exist_ok=True)
            table.to_parquet(folder / f"part-{rank}.parquet", index=False, row_group_size=row_group_size)
        shards = load([folder]).shards
        chunks = step_ranges(shards, 10)
        assert [steps for steps, _ in chunks] == expected
        for shard in shards:
            metadata = pq.ParquetFile(shard.path).metadata
            step = metadata.schema.names.index("step")
            for number in range(metadata.num_row_groups):
                statistics = metadata.row_group(number).column(step).statistics
                overlapping = [
                    steps
                    for steps, members in chunks
                    if shard in members
                    and (steps is None or (statistics.min <= steps[1] and statistics.max >= steps[0]))
                ]
                assert len(overlapping) == 1
        pd.testing.assert_frame_equal(Engine.open(shards).step_table(), Engine.open(shards, chunk_rows=10).step_table())


def test_a_range_holds_a_row_group_for_each_thread_past_its_rows_if_it_must(tmp_path: Path) -> None:
    """DuckDB reads a row group on one thread: one file of row groups larger than a range's rows (pyarrow's 1Mi-row
    default) is cut into ranges of `threads` row groups, not of one, and the table is the whole aggregation's."""
    import pyarrow.parquet as pq

    rows = records([[[3, 1], [2, 2], [5, 4]]] * 12, local_mean)  # 6 records a step, in step order
    folder = tmp_path / "run"
    folder.mkdir()
    pd.DataFrame(rows).to_parquet(folder / "log.parquet", index=False, row_group_size=12)  # 2 steps a row group
    assert pq.ParquetFile(folder / "log.parquet").metadata.num_row_groups == 6
    shards = load([folder]).shards
    assert [steps for steps, _ in step_ranges(shards, 10)] == [(2 * i, 2 * i + 1) for i in range(6)]
    assert [steps for steps, _ in step_ranges(shards, 10, threads=2)] == [(0, 3), (4, 7), (8, 11)]
    assert [steps for steps, _ in step_ranges(shards, 30, threads=2)] == [(0, 3), (4, 7), (8, 11)]
    assert [steps for steps, _ in step_ranges(shards, 10, threads=4)] == [(0, 7), (8, 11)]
    pd.testing.assert_frame_equal(
        Engine.open(shards).step_table(), Engine.open(shards, chunk_rows=10, threads=2).step_table()
    )


def test_the_evidence_of_one_step_is_the_whole_aggregation_s(tmp_path: Path) -> None:
    """Where the heaviest and lightest token were is aggregated only for the steps a finding names, again
    and alone, from the files whose footers can hold them: it must equal the same columns aggregated
    over the whole log (ties, a repeated key, several groups and terms, steps spread over files)."""
    from tests.logs import token_mean
    from tokaudit._checks import check_run, whole_run
    from tokaudit._engine import EVIDENCE, extremes_at

    counts = [
        [[5, 2], [0, 3], [7, 7]],
        [[4, 4], [9, 1], [2, 2]],
        [[1, 1], [1, 1], [8, 0]],
        [[6, 3], [6, 3], [2, 6]],
    ] * 2
    rows = records(counts, local_mean, group="A") + records(counts, token_mean, group="B")
    rows += [dict(r, term="aux") for r in records(counts, lambda S, n, **_: S / max(n, 1), group="A")]
    for rank in range(3):
        mine = [r for r in rows if r["rank"] == rank]
        write(tmp_path / "run" / f"rank-{rank:05d}-000000.parquet", [r for r in mine if r["step"] < 4])
        write(tmp_path / "run" / f"rank-{rank:05d}-000001.parquet", [r for r in mine if r["step"] >= 4])
    write(tmp_path / "run" / "rank-00001-000002.parquet", [r for r in rows if r["rank"] == 1 and r["step"] == 5])
    shards = load([tmp_path]).shards
    whole = Engine.open(shards, chunk_rows=7, extremes=True).step_table()
    keys = ["run", "grp", "term", "step"]
    for step in sorted(set(whole.step)):
        alone = extremes_at(shards, step)
        expected = whole[whole.step == step][keys + list(EVIDENCE)]
        pd.testing.assert_frame_equal(
            alone.reset_index(drop=True), expected.reset_index(drop=True), check_categorical=False
        )

    # The audit's findings, from a table without the columns, name the same tokens as from one with them.
    lean = Engine.open(shards).step_table()
    assert not set(EVIDENCE) & set(lean.columns)
    report = audit([tmp_path])
    with_columns, _, _ = check_run("run", whole_run(whole), 1e-4, Duplicates(1, 5, 5, 1))
    evidence = [(f.code, f.term, f.evidence.get("heaviest"), f.evidence.get("lightest")) for f in with_columns]
    assert sorted(map(str, evidence)) == sorted(
        str((f.code, f.term, f.evidence.get("heaviest"), f.evidence.get("lightest"))) for f in report.findings
    )
    assert any(f.evidence.get("heaviest") for f in report.findings)


def test_a_large_range_comes_back_in_step_order(tmp_path: Path) -> None:
    """DuckDB hands a large result back in record batches that need not follow its ORDER BY (DuckDB
    2.0, insertion order not preserved): the table is put back in step order, whatever the batches."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    steps = 20_000
    for rank in range(2):
        pq.write_table(
            pa.table(
                {
                    "step": np.arange(steps),
                    "micro": np.zeros(steps, np.int32),
                    "rank": np.full(steps, rank, np.int32),
                    "world_size": np.full(steps, 2, np.int32),
                    "loss_sum": np.arange(steps) + 1.0,
                    "valid_tokens": np.full(steps, 3),
                    "backward_scalar": np.ones(steps),
                }
            ),
            tmp_path / f"rank-{rank}.parquet",
            row_group_size=4096,
        )
    engine = Engine.open(load([tmp_path]).shards, chunk_rows=10 * steps, threads=2)
    table = engine.step_table()
    assert (table.step.to_numpy() == np.arange(steps)).all()
    assert (table.loss.to_numpy() == 2 * (np.arange(steps) + 1.0)).all()  # each row still its own step's


def test_a_window_of_steps_is_aggregated_in_the_whole_log_s_ranges_clipped(tmp_path: Path) -> None:
    """only_steps of many steps: the whole log's ranges (so memory stays bounded), clipped to the window,
    and the table is the whole table's rows for those steps; one step is one range."""
    counts = [[[3, 1], [0, 4]], [[2, 2], [5, 1]], [[1, 1], [1, 6]]] * 20
    rows = records(counts, local_mean)
    for rank in range(2):
        for part in range(6):
            write(
                tmp_path / "run" / f"rank-{rank:05d}-{part:06d}.parquet",
                [r for r in rows if r["rank"] == rank and 10 * part <= r["step"] < 10 * part + 10],
            )
    shards = load([tmp_path]).shards
    whole = Engine.open(shards, chunk_rows=20).step_table()
    window = Engine.open(shards, chunk_rows=20, only_steps=(15, 33))
    assert [steps for steps, _ in step_ranges(shards, 20, (15, 33))] == [(15, 19), (20, 29), (30, 33)]
    expected = whole[(whole.step >= 15) & (whole.step <= 33)].reset_index(drop=True)
    pd.testing.assert_frame_equal(window.step_table(), expected, check_categorical=False)
    assert [steps for steps, _ in step_ranges(shards, 20, (25, 25))] == [(25, 25)]


def test_names_become_the_categories_pandas_would_make() -> None:
    """The step table's run, group and term: sorted categories and the same codes as pd.Categorical,
    whatever order, repeats and characters the names come in."""
    import numpy as np

    from tokaudit._engine.tables import categorical

    for names in (["b", "a", "c", "a", "b"], ["ß", "z", "é", "a b", "z"], ["only"] * 4, []):
        values = np.array(names, dtype=object)
        got, want = categorical(values), pd.Categorical(values)
        assert list(got.categories) == list(want.categories) == sorted(set(names))
        assert got.codes.tolist() == want.codes.tolist() and got.tolist() == names


def test_a_table_of_several_names_is_put_in_order_a_column_at_a_time() -> None:
    """Several (run, group, term) come back step by step, interleaved: the table is put in (run, group,
    term, step) order as pandas' stable sort would, one column at a time (what that saves over sort_values is
    measured in bench/), and columns that were one array stay one array."""
    import numpy as np

    from tokaudit._engine.tables import reorder

    rows = 20_000
    random = np.random.default_rng(7)
    names = np.array(["b", "a", "c"], dtype=object)[random.integers(0, 3, rows)]
    shared = random.random(rows)
    joined = {
        "run": pd.Categorical(names),
        "grp": pd.Categorical(np.full(rows, "0", dtype=object)),
        "term": pd.Categorical(names[::-1].copy()),
        "step": random.permutation(rows).astype(np.int64),
        "e": shared,
        "e_alias": shared,
        **{f"c{i}": random.random(rows) for i in range(6)},
    }
    want = pd.DataFrame(joined).sort_values(["run", "grp", "term", "step"], kind="stable", ignore_index=True)
    order = np.lexsort((joined["step"], joined["term"].codes, joined["grp"].codes, joined["run"].codes))
    reorder(joined, order)
    pd.testing.assert_frame_equal(pd.DataFrame(joined), want)
    assert joined["e"] is joined["e_alias"]


def test_a_column_that_never_changes_is_held_as_one_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W, D and the counts a run that never changed its set-up repeats on every step are held as their
    one value (a read-only array of stride 0), range by range and joined: the table equals the one made
    without that, and only what is constant bit for bit is (0.0 and -0.0 differ, NaN is one value)."""
    import numpy as np

    import tokaudit._engine.tables as engine_module
    from tokaudit._engine.tables import constant_of

    rows = records(UNEVEN_GA * 4, local_mean, positions=8)
    write(tmp_path / "run" / "rank-all-000000.parquet", rows)
    shards = load([tmp_path]).shards
    held = Engine.open(shards, chunk_rows=10).step_table()
    constant = {
        name
        for name in held.columns
        if not isinstance(held[name].dtype, pd.CategoricalDtype) and held[name].to_numpy().strides == (0,)
    }
    assert {
        "world_low",
        "world_high",
        "divisor_low",
        "divisor_high",
        "records",
        "ranks",
        "nonfinite_valid",
        "skipped_true",
    } <= constant
    assert not {"step", "tokens", "loss", "weight_low", "weight_high"} & constant
    monkeypatch.setattr(engine_module, "constant_of", lambda parts: None)
    pd.testing.assert_frame_equal(held, Engine.open(shards, chunk_rows=10).step_table())

    assert constant_of([np.array([0.0, -0.0])]) is None
    assert constant_of([np.array([2.0, 2.0]), np.array([2.0]), np.array([3.0])]) is None
    assert constant_of([np.array([1, 1], dtype=np.int32), np.array([1.0])]) is None  # joined as float64
    nan = constant_of([np.array([np.nan, np.nan]), np.array([np.nan])])
    assert nan is not None and len(nan) == 3 and np.isnan(nan).all() and nan.strides == (0,)
    seven = constant_of([np.full(4, 7, dtype=np.int32), np.broadcast_to(np.int32(7), (3,))])
    assert seven is not None and seven.dtype == np.int32 and seven.tolist() == [7] * 7 and not seven.flags.writeable


def test_a_range_of_one_run_group_and_term_is_aggregated_without_hashing_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When every footer of a range shows one (run, group, term), the query neither hashes the names per
    record nor aggregates them per step: they are passed as parameters (any text, quotes included). The
    table is the one the general query makes; a range whose files name two runs takes the general query."""
    import tokaudit._engine.database as engine_module

    rows = [dict(r, run_id='it\'s "x" ∑ {names}', group="dp'0") for r in records(UNEVEN_GA * 4, local_mean)]
    for first in range(0, 12, 3):
        write(tmp_path / "run" / f"rank-all-{first:06d}.parquet", [r for r in rows if first <= r["step"] < first + 3])
    other = [dict(r, run_id="second") for r in records(UNEVEN_GA, local_mean)]
    write(tmp_path / "run" / "rank-all-999999.parquet", other)
    shards = load([tmp_path]).shards
    assert engine_module.one_name_of(shards) is None
    single = [s for s in shards if s.names == ('it\'s "x" ∑ {names}', "dp'0", "0")]
    assert len(single) == 4 and engine_module.one_name_of(single) == single[0].names
    used: list[bool] = []
    original = engine_module.step_sql

    def recording(one_record: bool, evidence: bool = False, one_name: bool = False, *absent: Any) -> str:
        used.append(one_name)
        return original(one_record, evidence, one_name, *absent)

    monkeypatch.setattr(engine_module, "step_sql", recording)
    fast = Engine.open(single, chunk_rows=10).step_table()
    both = Engine.open(shards).step_table()
    assert all(used[:-1]) and not used[-1]
    monkeypatch.setattr(engine_module, "one_name_of", lambda shards: None)
    pd.testing.assert_frame_equal(fast, Engine.open(single, chunk_rows=10).step_table())
    pd.testing.assert_frame_equal(both, Engine.open(shards).step_table())
    assert set(both.run.astype(str)) == {'it\'s "x" ∑ {names}', "second"}


def test_the_same_log_gives_the_same_sums_bit_for_bit_whatever_the_threads_did(tmp_path: Path) -> None:
    """DuckDB's threads each sum the records they happened to read, then add their partial sums: with a
    plain floating-point sum the last bits of ΣS, Σe·S and the mean of local means changed from one run
    to the next (so did `curve --csv`). Compensated sums (fsum, favg) carry what each addition rounded
    off, so the partial sums add up to the same double. Losses spanning six orders of magnitude, over
    files read by four threads, make a plain sum differ between runs (this test fails against
    `sum`/`avg` in every run we made)."""
    import numpy as np

    generator = np.random.default_rng(7)
    ranks, steps, micros = 32, 64, 2
    for rank in range(ranks):
        rows = []
        for step in range(steps):
            for micro in range(micros):
                n = int(generator.integers(1, 512))
                loss = n * float(10 ** generator.uniform(-3, 3))
                rows.append(
                    {
                        "step": step,
                        "micro": micro,
                        "rank": rank,
                        "world_size": ranks,
                        "loss_sum": loss,
                        "valid_tokens": n,
                        "backward_scalar": loss / n,
                    }
                )
        write(tmp_path / "run" / f"rank-{rank:05d}-000000.parquet", rows)
    shards = load([tmp_path]).shards
    tables = []
    for _ in range(6):
        engine = Engine.open(shards, threads=4)
        try:
            tables.append(engine.step_table())
        finally:
            engine.close()
    for column in ("loss", "objective", "mean_of_local_means"):
        bits = {tables[i][column].to_numpy().tobytes() for i in range(len(tables))}
        assert len(bits) == 1, f"{column}: {len(bits)} different results in {len(tables)} runs"


def test_without_a_probe_the_token_extremes_are_the_mean_weights_array(tmp_path: Path) -> None:
    """A log with no probe value (by its footers): the probe-or-mean token extremes (token_weight_low, token_weight_high) are weight_low
    and weight_high bit for bit, so the table holds one array for both (16 bytes a step), range by range and joined;
    the table equals the one that aggregates them. With probe values the columns stay apart and keep their own
    values; arrays are compared as bits (0.0 and −0.0 differ, NaN is NaN)."""
    import numpy as np

    from tokaudit._engine.tables import same_bits

    rows = records(UNEVEN_GA * 4, local_mean)
    write(tmp_path / "plain" / "rank-all-000000.parquet", rows)
    shards = load([tmp_path / "plain"]).shards
    for chunk_rows in (10, None):
        shared = Engine.open(shards, chunk_rows=chunk_rows).step_table()
        assert np.shares_memory(shared.token_weight_low.to_numpy(), shared.weight_low.to_numpy())
        assert np.shares_memory(shared.token_weight_high.to_numpy(), shared.weight_high.to_numpy())
    engine = Engine.open(shards, chunk_rows=10)
    engine.prune = False  # the probe's columns read as the files have them: aggregated
    apart = engine.step_table()
    assert not np.shares_memory(apart.token_weight_low.to_numpy(), apart.weight_low.to_numpy())
    pd.testing.assert_frame_equal(shared, apart)

    probed = [
        dict(
            r,
            token_weight_sum=r["backward_scalar"] * r["valid_tokens"] / r["loss_sum"],
            token_weight_min=0.5 * r["backward_scalar"] / r["loss_sum"],
            token_weight_max=2.0 * r["backward_scalar"] / r["loss_sum"],
        )
        for r in rows
    ]
    write(tmp_path / "probed" / "rank-all-000000.parquet", probed)
    table = Engine.open(load([tmp_path / "probed"]).shards).step_table()
    assert not np.shares_memory(table.token_weight_low.to_numpy(), table.weight_low.to_numpy())
    assert (table.token_weight_high > table.weight_high).all() and (table.token_weight_low < table.weight_low).all()

    assert not same_bits(np.array([0.0]), np.array([-0.0])) and same_bits(np.array([np.nan]), np.array([np.nan]))
    assert not same_bits(np.array([1], dtype=np.int32), np.array([1.0]))


def test_a_log_aggregated_in_ranges_answers_per_step_queries_for_the_whole_log(tmp_path: Path) -> None:
    """A log aggregated in ranges still answers for the whole log afterwards: the records of its last step and
    the last step every rank has recorded."""
    rows = records(UNEVEN_GA * 4, local_mean)
    for index, start in enumerate(range(0, len(rows), 8)):
        write(tmp_path / "run" / f"rank-all-{index:06d}.parquet", rows[start : start + 8])
    shards = load([tmp_path]).shards
    engine = Engine.open(shards, chunk_rows=10)
    try:
        engine.step_table()
        step = rows[-1]["step"]
        assert len(engine.records_at("run", step)) == sum(r["step"] == step for r in rows)
        assert engine.complete_through() == {("run", "0"): max(r["step"] for r in rows)}
    finally:
        engine.close()


def _same_table(one: pd.DataFrame, other: pd.DataFrame) -> list[str]:
    """The columns in which two step tables differ: name, order, dtype, or any bit (0.0 is not −0.0)."""
    from tokaudit._engine.tables import same_bits

    assert list(one.columns) == list(other.columns)
    return [
        c
        for c in one.columns
        if one[c].dtype != other[c].dtype
        or not (
            one[c].equals(other[c])
            if one[c].dtype.name == "category"
            else same_bits(one[c].to_numpy(), other[c].to_numpy())
        )
    ]


@pytest.mark.parametrize(
    "counts", [[[[5], [0], [7], [3]], [[4], [9], [2], [6]]], UNEVEN_GA], ids=["one micro", "two micro"]
)
def test_columns_no_record_holds_are_read_as_nulls_and_change_no_bit(tmp_path: Path, counts: Any) -> None:
    """A scan of files that lack an optional column or hold only nulls in it (`Shard.null_columns`) reads it as a
    typed NULL, not from the files. The step table must be the one read in full bit for bit: ranges with nothing
    recorded (the recorder's full schema with null columns, and files without the columns), a range where every
    optional column holds values on some records only, W and D that vary, a microbatch index past 64, and the
    evidence columns, joined across ranges."""
    import pyarrow as pa

    from tests.logs import token_mean
    from tokaudit._engine.sql import valueless_columns
    from tokaudit._schema import WRITER_SCHEMA

    optional = sorted(NULLABLE_COLUMNS)
    plain = records(counts * 6, local_mean)
    divisor = plain[0]["world_size"] * 1.1  # a D no float32 holds
    plain = [dict(r, grad_divisor=divisor) for r in plain]
    full = pa.schema([WRITER_SCHEMA.field(n) for n in [*plain[0], *optional]])
    quiet = plain[: len(plain) // 3]
    write(tmp_path / "log" / "a-000000.parquet", quiet[: len(quiet) // 2], schema=full)  # every value null
    write(tmp_path / "log" / "b-000000.parquet", quiet[len(quiet) // 2 :])  # the columns absent
    loud = records(counts * 6, token_mean, grad_divisor=divisor)[len(plain) // 3 :]
    for index, row in enumerate(loud):
        if index % 3 == 0:
            row.update(
                token_weight_sum=0.01 * row["valid_tokens"],
                token_weight_min=-0.0,
                token_weight_max=0.5,
                masked_weight_abs_sum=0.25,
                divisor_known=False,
            )
        if index % 4 == 1:
            row.update(reported_loss=2.25, positions=row["valid_tokens"] + 16, sync=index % 8 == 1, skipped=False)
        if index % 5 == 2:
            row.update(world_size=8, grad_divisor=2.0 * divisor, precision_bits=8)
        if row["micro"] == 1:
            row["micro"] = 65
    write(tmp_path / "log" / "c-000000.parquet", loud, schema=full)
    shards = load([tmp_path / "log"]).shards
    by_name = {s.path.name: s for s in shards}
    assert by_name["a-000000.parquet"].null_columns == set(optional)
    assert valueless_columns([by_name["a-000000.parquet"], by_name["b-000000.parquet"]]) == set(optional)
    assert not valueless_columns(shards)
    for extremes in (False, True):
        tables = {}
        for prune in (True, False):
            engine = Engine.open(shards, chunk_rows=len(quiet) // 2, extremes=extremes)
            engine.prune = prune
            tables[prune] = engine.step_table()
            engine.close()
        assert len(tables[True]) == len(counts) * 6
        assert not _same_table(tables[True], tables[False])
        assert tables[True].reported.gt(0).any() and tables[True].probed.gt(0).any()
        assert tables[True].world_high.nunique() == 2 and tables[True].divisor_high.nunique() == 2


def test_a_column_that_reads_only_absent_columns_is_its_declared_value_and_not_computed() -> None:
    """With nothing recorded in the optional columns, the query aggregates none of them: each column that reads
    them is its declared `absent` value (what its reduction gives over NULL alone), an alias where that names a
    column and a constant the query leaves out where it is a literal; the step table's equality with the full read
    is the test above."""
    import re

    from tokaudit._engine import STEP_COLUMNS
    from tokaudit._engine.sql import aliases, constants, step_sql

    for one_record in (False, True):
        query = step_sql(one_record, True, False, frozenset(NULLABLE_COLUMNS))
        aggregated = query.split("weighted AS")[1].split("\nSELECT ")[0]  # not the final selection
        for name in NULLABLE_COLUMNS - {"divisor_known", "positions"} | {
            "probe_low",
            "probe_high",
            "probe_spread",
            "masked_share",
        }:
            assert not re.search(rf"\b{name}\b(?! AS)", re.sub(rf"AS {name}\b", "", aggregated)), (one_record, name)
        gone = [c for c in STEP_COLUMNS if c.reads]
        held = {
            **aliases(one_record, frozenset(NULLABLE_COLUMNS)),
            **constants(one_record, frozenset(NULLABLE_COLUMNS)),
        }
        assert gone and all(
            c.name in held
            or f"AS {c.name}," in query
            or query.rstrip().endswith(f"AS {c.name}")
            or f"AS {c.name}\n" in query
            for c in gone
        )


def test_a_nan_divisor_that_no_footer_shows_is_counted_and_its_file_named(tmp_path: Path) -> None:
    """A NaN divisor is in no footer's statistics (D looks constant there): the aggregation counts it, and the
    report names the file and leaves it out."""
    from tokaudit._render.json_report import render_json

    plain = [dict(r, grad_divisor=2.2) for r in records(UNEVEN_GA * 6, local_mean)]
    nan = [dict(r, grad_divisor=float("nan") if index == 1 else r["grad_divisor"]) for index, r in enumerate(plain[:8])]
    write(tmp_path / "nan" / "a-000000.parquet", nan)
    write(tmp_path / "nan" / "b-000000.parquet", plain[8:])
    assert load([tmp_path / "nan" / "a-000000.parquet"], thorough=False).shards[0].divisor_range == (2.2, 2.2)
    report = render_json(audit([tmp_path / "nan"]))
    assert "a-000000.parquet" in report and "not a finite positive number" in report


@pytest.mark.slow
def test_one_row_shards_are_read_from_their_footers_and_change_no_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-row shard whose footer gives its record (`Shard.record`) is aggregated from that record, not
    from the file: the step tables (whole, in ranges, with the evidence columns), the records of a step,
    the steps complete so far, the duplicates and the report are the files' bit for bit. The log mixes
    what a footer gives (the recorder's full schema with its time stamp, nulls, a float32 loss, a
    dictionary-encoded run id, an integer divisor, a masked weight of 0.0 or −0.0, whose sign nothing
    reads) with what it does not (a loss of 0.0 or −0.0, a NaN
    scalar: those files are read), a shard of many rows, and repeated keys that the time, then the later
    file, decide. Once loaded, the footer-given shards are not opened again: moved away, they still give
    the same table."""
    import shutil
    from datetime import datetime, timezone

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.logs import token_mean
    from tokaudit._render.json_report import render_json
    from tokaudit._schema import WRITER_SCHEMA

    rows = records(UNEVEN_GA * 5, token_mean)
    moment = datetime(2026, 11, 30, tzinfo=timezone.utc)
    log = tmp_path / "log" / "run"
    log.mkdir(parents=True)
    for index, row in enumerate(rows):
        row = dict(
            row,
            grad_divisor=float(row["world_size"]),
            time=moment,
            reported_loss=None if index % 3 else 2.5,
            sync=row["micro"] == 1,
            positions=row["valid_tokens"] + index % 4,
            divisor_known=True,
            masked_weight_abs_sum=(0.0, -0.0, 0.5, None)[index % 4],
        )
        schema = WRITER_SCHEMA
        if index % 7 == 1:
            row["loss_sum"] = 0.0 if index % 2 else -0.0
        if index == 9:
            row["backward_scalar"] = float("nan")
        if index % 5 == 2:
            schema = pa.schema([WRITER_SCHEMA.field(n) for n in row]).set(4, pa.field("loss_sum", pa.float32()))
        if index % 5 == 3:
            schema = pa.schema([WRITER_SCHEMA.field(n) for n in row])
            schema = schema.set(schema.get_field_index("grad_divisor"), pa.field("grad_divisor", pa.int64()))
            row["grad_divisor"] = row["world_size"]
        if index % 5 == 4:
            row["run_id"] = "run"  # the folder's name, given
        table = pa.table({n: pa.array([row.get(n)], type=schema.field(n).type) for n in schema.names}, schema=schema)
        if index % 5 == 4:
            table = table.set_column(
                table.schema.get_field_index("run_id"), "run_id", table["run_id"].dictionary_encode()
            )
        pq.write_table(table, log / f"one-{index:04d}.parquet")
    many = [
        dict(r, loss_sum=r["loss_sum"] * 2) for r in records(UNEVEN_GA * 2, token_mean, step_offset=len(UNEVEN_GA) * 5)
    ]
    write(log / "many-0000.parquet", many)
    # repeated keys: the later file wins whatever the times (a record with a later time in an earlier file loses)
    later = dict(rows[4], loss_sum=rows[4]["loss_sum"] + 1, time=datetime(2026, 12, 1, tzinfo=timezone.utc))
    write(log / "aaa-repeat.parquet", [later], schema=pa.schema([WRITER_SCHEMA.field(n) for n in later]))
    write(log / "zzz-repeat.parquet", [dict(rows[6], loss_sum=rows[6]["loss_sum"] + 1)])

    shards = load([tmp_path / "log"]).shards
    known = [s for s in shards if s.record is not None]
    assert 0 < len(known) < len(shards) - 1 and not any(s.rows > 1 for s in known)
    assert len({s.signature for s in known}) >= 4

    def tables(footer_rows: bool) -> tuple[list[pd.DataFrame], Any]:
        got = []
        for chunk_rows, extremes in ((None, False), (7, False), (None, True)):
            engine = Engine.open(shards, chunk_rows=chunk_rows, extremes=extremes)
            engine.footer_rows = footer_rows
            got.append(engine.step_table())
            if chunk_rows is None and not extremes:
                facts = (engine.duplicates, engine.records_at("run", 2), engine.complete_through())
            engine.close()
        return got, facts

    (from_footers, facts), (from_files, file_facts) = tables(True), tables(False)
    for one, other in zip(from_footers, from_files):
        assert _same_table(one, other) == []
    repeated = sorted({rows[4]["step"], rows[6]["step"]})
    assert facts[0] == file_facts[0] and _counts(facts[0]) == {"run": (2, repeated[0], repeated[-1], len(repeated))}
    pd.testing.assert_frame_equal(facts[1], file_facts[1])
    assert facts[2] == file_facts[2]
    assert from_footers[0].loss.notna().all() and len(from_footers[0]) == len(UNEVEN_GA) * 7

    report = render_json(audit([tmp_path / "log"]))
    monkeypatch.setattr(Engine, "footer_rows", False)
    assert render_json(audit([tmp_path / "log"])) == report
    monkeypatch.undo()

    # the mechanism: the footer-given shards alone, their files gone once loaded
    only = tmp_path / "only" / "run"
    only.mkdir(parents=True)
    for shard in known:
        shutil.copy(str(shard.path), only / shard.path.name)
    loaded = load([tmp_path / "only"]).shards
    expected = Engine.open(loaded).step_table()
    shutil.rmtree(tmp_path / "only")
    engine = Engine.open(loaded)
    assert _same_table(engine.step_table(), expected) == []
    engine.footer_rows = False
    with pytest.raises(Exception):
        engine.step_table()
    engine.close()


def _footer_row_cases() -> Any:
    """One record of random columns, types and values (the special floats, nulls, long and unicode
    strings, dictionaries, time stamps of two units), as (Arrow columns)."""
    from hypothesis import strategies as st
    import pyarrow as pa

    plain = st.floats(allow_nan=False, allow_infinity=False, width=64).filter(lambda x: x != 0)
    # mostly values a footer gives; the ones it does not (0 of either sign, NaN) often enough to be met
    floats = st.one_of(plain, plain, plain, st.sampled_from([0.0, -0.0, float("nan"), float("inf"), 5e-324, -1.5]))
    text = st.one_of(st.text(max_size=8), st.just("x" * 5000), st.just("rün ∑"))

    def optional(values: Any) -> Any:
        return st.one_of(st.none(), values)

    @st.composite
    def case(draw: Any) -> dict[str, pa.Array]:
        world = draw(st.integers(1, 8))
        columns: dict[str, pa.Array] = {
            "step": pa.array(
                [draw(st.integers(0, 10**6))], draw(st.sampled_from([pa.int64(), pa.int32(), pa.uint32()]))
            ),
            "micro": pa.array([draw(st.integers(0, 70))], draw(st.sampled_from([pa.int32(), pa.int8()]))),
            "rank": pa.array([draw(st.integers(0, world - 1))], pa.int32()),
            "world_size": pa.array([world], pa.int32()),
            "loss_sum": pa.array([draw(floats)], pa.float64()),
            "valid_tokens": pa.array([draw(st.integers(0, 1000))], pa.int64()),
            "backward_scalar": pa.array([draw(floats)], pa.float64()),
        }
        if draw(st.booleans()):
            columns["loss_sum"] = columns["loss_sum"].cast(pa.float32(), safe=False)
        optional_columns = {
            "run_id": (text, pa.string()),
            "group": (text, pa.string()),
            "term": (text, pa.string()),
            "grad_divisor": (st.sampled_from([0.5, 2.0, 3.0, 1e300]), pa.float64()),
            "divisor_known": (st.booleans(), pa.bool_()),
            "grad_scale": (floats, pa.float64()),
            "positions": (st.integers(0, 10**6), pa.int64()),
            "token_weight_sum": (floats, pa.float64()),
            "token_weight_min": (floats, pa.float64()),
            "token_weight_max": (floats, pa.float64()),
            "masked_weight_abs_sum": (st.sampled_from([0.0, -0.0, 0.25]), pa.float64()),
            "reported_loss": (floats, pa.float64()),
            "sync": (st.booleans(), pa.bool_()),
            "skipped": (st.booleans(), pa.bool_()),
        }
        for name, (values, arrow_type) in optional_columns.items():
            if draw(st.booleans()):
                array = pa.array([draw(optional(values))], arrow_type)
                if arrow_type == pa.string() and draw(st.booleans()):
                    array = array.dictionary_encode()
                columns[name] = array
        if draw(st.booleans()):
            unit = draw(st.sampled_from(["us", "ns"]))
            columns["time"] = pa.array([draw(optional(st.integers(0, 2**62)))], pa.int64()).cast(
                pa.timestamp(unit, "UTC" if unit == "us" else None)
            )
        if draw(st.booleans()) and columns["grad_divisor" if "grad_divisor" in columns else "rank"].null_count == 0:
            columns["grad_divisor"] = pa.array([draw(st.integers(1, 9))], pa.int64())
        return columns

    return case()


def test_a_footer_record_is_what_a_scan_of_its_file_gives_bit_for_bit(tmp_path: Path) -> None:
    """For random one-row files, the record a footer gives (`Shard.record`) aggregates as a scan of the file does:
    the step table the same bits, NaN and −0.0 included. Files the footer cannot give (a float 0, NaN, a long
    string) are simply not compared."""
    import itertools

    import pyarrow as pa
    import pyarrow.parquet as pq
    from hypothesis import given, settings

    from tests.auditor.test_properties import SETTINGS
    from tokaudit.errors import LogFormatError
    from tokaudit._reader import inspect_shard

    numbers = itertools.count()
    given_records = []

    # The same cases every run: how many reach the footer path is asserted below, never left to chance.
    @settings(SETTINGS, max_examples=40, derandomize=True, database=None)
    @given(_footer_row_cases())
    def check(columns: dict[str, pa.Array]) -> None:
        path = tmp_path / "run" / f"one-{next(numbers):05d}.parquet"
        path.parent.mkdir(exist_ok=True)
        pq.write_table(pa.table(columns), path)
        try:
            shard = inspect_shard(path, thorough=False)
        except LogFormatError:
            return  # a value no audit can use (a rank past W is not drawn; a null required value is)
        if shard.record is None:
            return
        given_records.append(shard)
        tables = {}
        for footer_rows in (True, False):
            engine = Engine.open([shard])
            engine.footer_rows = footer_rows
            try:
                tables[footer_rows] = engine.step_table()
            finally:
                engine.close()
        assert len(tables[True]) == 1 and _same_table(tables[True], tables[False]) == []

    check()
    assert len(given_records) >= 5, "the cases must reach the footer path"


def test_a_range_whose_file_cannot_be_decoded_names_the_file_and_audits_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file whose pages are damaged (its footer intact) in a late step range: the audit names the file and
    audits every other range."""
    rows = records(UNEVEN_GA * 10, local_mean, positions=8)
    for first in range(0, 30, 3):
        write(tmp_path / "run" / f"rank-all-{first:06d}.parquet", [r for r in rows if first <= r["step"] < first + 3])
    late = tmp_path / "run" / "rank-all-000024.parquet"
    data = bytearray(late.read_bytes())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    data[4:footer] = b"\xff" * (footer - 4)  # every page, not the footer
    late.write_bytes(bytes(data))
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", "24")
    report = audit([tmp_path])
    assert any("rank-all-000024.parquet: corrupt data" in p for p in report.problems)
    assert report.runs[0].steps == 27


def test_a_file_removed_while_the_audit_reads_is_said_gone_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late step range's file deleted once the audit has listed the log (as the first range starts): named as
    gone, the other ranges audited."""
    rows = records(UNEVEN_GA * 10, token_mean)
    for first in range(0, 30, 3):
        write(tmp_path / "run" / f"rank-all-{first:06d}.parquet", [r for r in rows if first <= r["step"] < first + 3])
    late = tmp_path / "run" / "rank-all-000024.parquet"
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", "24")
    monkeypatch.setattr("tokaudit._opening.PROGRESS_ROWS", 0)  # progress said of a log this small
    report = audit([tmp_path], progress=lambda *_: late.unlink(missing_ok=True))
    assert not late.exists() and report.runs[0].steps == 27
    assert f"{late}: gone: removed or renamed since the audit listed it" in report.problems, report.problems


def test_the_engine_s_database_does_not_take_float_statistics_for_the_truth(tmp_path: Path) -> None:
    """pyarrow leaves NaN out of a float column's statistics and writes no NaN count; DuckDB 2 by default
    then skips the row group of `WHERE isnan(x)` and answers max(x) from the statistics. A NaN is what the
    audit looks for: in the engine's database a filter and an aggregate over the raw column find it."""
    rows = records([[[3, 2]]], lambda S, N, W, **_: W * S / N, grad_divisor=1.0)
    rows[1]["grad_divisor"] = float("nan")
    path = write(tmp_path / "run" / "a.parquet", rows)
    shards = load([path], thorough=False).shards
    assert shards[0].divisor_range == (1.0, 1.0)  # the footer does not show it
    engine = Engine.open(shards)
    try:
        found = engine.connection.execute(
            f"SELECT count(*), max(grad_divisor) FROM read_parquet('{path}') WHERE isnan(grad_divisor)"
        ).fetchall()
    finally:
        engine.close()
    ((count, highest),) = found
    assert count == 1 and highest != highest  # NaN


def test_the_heat_map_is_each_valid_record_s_q_in_its_cell(tmp_path: Path) -> None:
    """rank_weights, by its definition computed record by record in pandas: q = e·N, N the valid tokens of the
    record's step (per group and term; over every term in a pooled run), a record counted where n > 0 and q is
    finite, each run's ranks and steps cut into at most `rows` × `columns` cells of equal spans."""
    import numpy as np

    def term_rows(term: str, scale: float) -> list[dict[str, Any]]:
        return [
            dict(r, term=term, backward_scalar=r["backward_scalar"] * scale) for r in records(UNEVEN_GA * 3, local_mean)
        ]

    mixed = records(
        [[[3, 2], [0, 0], [2, 9], [5, 1], [1, 3]]] + [[[3, 2], [0, 0], [2, 4], [5, 1], [1, 3]]] * 6,
        local_mean,
        run_id="mixed",
    )  # a rank without tokens; rank 2's 9 tokens its cell's lowest q
    mixed[4]["backward_scalar"] = float("nan")  # rank 2's first microbatch: no weight, its second counted
    for rank in range(5):
        write(tmp_path / "mixed" / f"rank-{rank:05d}-000000.parquet", [r for r in mixed if r["rank"] == rank])
    pooled = term_rows("0", 1.0) + term_rows("aux", 0.5)
    write(tmp_path / "pooled" / "rank-all-000000.parquet", [dict(r, run_id="pooled") for r in pooled])
    grouped = [dict(r, run_id="grouped", group=str(r["rank"] % 2)) for r in records(UNEVEN_GA * 2, local_mean)]
    write(tmp_path / "grouped" / "rank-all-000000.parquet", grouped)
    rows, columns = 2, 3
    got = Engine.open(load([tmp_path]).shards).rank_weights(rows, columns, pooled=["pooled"])

    table = pd.DataFrame(mixed + [dict(r, run_id="pooled") for r in pooled] + grouped)
    table["group"] = table["group"].fillna("")
    table["term"] = np.where(table.run_id == "pooled", "", table["term"].fillna(""))
    table["N"] = table.groupby(["run_id", "group", "term", "step"]).valid_tokens.transform("sum")
    table["q"] = table.backward_scalar / table.loss_sum / table.world_size * table.N
    valid = table[(table.valid_tokens > 0) & np.isfinite(table.q)].copy()
    expected = []
    for run, mine in valid.groupby("run_id"):
        low, high, top = mine.step.min(), mine.step.max(), mine["rank"].max()
        row = mine["rank"] if top < rows else mine["rank"] * rows // (top + 1)
        col = mine.step - low if high - low < columns else (mine.step - low) * columns // (high - low + 1)
        for (r, c), cell in mine.groupby([row.rename("row"), col.rename("col")]):
            expected.append(
                (
                    run,
                    r,
                    c,
                    cell["rank"].min(),
                    cell["rank"].max(),
                    cell.step.min(),
                    cell.step.max(),
                    cell.q.min(),
                    cell.q.max(),
                )
            )
    assert len({run for run, *_ in expected}) == 3 and len(expected) > 9  # every run, cells of several ranks and steps
    found = [
        (
            str(r.run),
            int(r.row),
            int(r.col),
            int(r.rank_first),
            int(r.rank_last),
            int(r.step_first),
            int(r.step_last),
            r.q_low,
            r.q_high,
        )
        for r in got.itertuples()
    ]
    assert [cell[:7] for cell in found] == [cell[:7] for cell in sorted(expected)]
    assert np.allclose([cell[7:] for cell in found], [cell[7:] for cell in sorted(expected)], rtol=1e-15, atol=0)


def _counts(found: dict[str, Duplicates]) -> dict[str, tuple[int, int, int, int]]:
    """Records left out, first and last step, steps: per run."""
    return {run: (d.dropped, d.first, d.last, d.steps) for run, d in found.items()}


def test_the_later_published_shard_wins_whatever_the_clocks(tmp_path: Path) -> None:
    """A job on a node whose clock ran 3 h ahead recorded steps 0–5 as local means, then died; the fixed job resumed
    at step 3 with the token mean, its shards numbered after the dead job's. The later shards' records are judged:
    local_mean on steps 0–2 only, never on the resumed steps whose dead copies carry the later times."""
    from datetime import datetime, timedelta, timezone

    ahead = datetime(2026, 12, 6, 12, tzinfo=timezone.utc) + timedelta(hours=3)
    now = datetime(2026, 12, 6, 12, tzinfo=timezone.utc)
    counts = [[[1, 3], [5, 2]]] * 6
    dead = [dict(r, time=ahead) for r in records(counts, local_mean)]
    fixed = [dict(r, time=now) for r in records(counts, token_mean) if r["step"] >= 3]
    run = tmp_path / "exp"
    for rank in (0, 1):
        write(run / f"rank-{rank:05d}-000000.parquet", [r for r in dead if r["rank"] == rank])
        write(run / f"rank-{rank:05d}-000001.parquet", [r for r in fixed if r["rank"] == rank])
    report = audit([run])
    found = {f.code.value: f for f in report.findings}
    assert (found["local_mean"].steps.first, found["local_mean"].steps.last) == (0, 2)
    assert found["duplicate_records"].steps.count == 3


def test_the_documented_query_is_the_one_generated_and_the_one_that_runs(tmp_path: Path) -> None:
    """docs/design.md shows the step query of the recorder's layout; it is what `step_sql` writes from the
    declarations, and what the engine runs on such a log (several microbatches, one run, group and term, a
    value in every optional column)."""
    import re

    from tokaudit._engine import step_sql
    from tokaudit._engine.columns import WIDE_MICRO

    design = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    documented = re.search(r"```sql\n(.*?)```", design, re.S)
    generated = step_sql(one_record=False, evidence=False, one_name=True, absent=frozenset({WIDE_MICRO}))
    assert documented is not None and documented.group(1) == generated, (
        "docs/design.md's query is stale: paste the output of python -c 'from tokaudit._engine import step_sql; "
        'print(step_sql(False, False, True, frozenset({"micro >= 64"})), end="")\''
    )
    every = dict(
        token_weight_sum=1.0,
        token_weight_min=0.5,
        token_weight_max=1.5,
        masked_weight_abs_sum=0.0,
        reported_loss=2.0,
        sync=True,
        skipped=False,
        positions=64,
        divisor_known=True,
        term_weight=1.0,
        precision_bits=24,
    )
    rows = records(UNEVEN_GA * 4, local_mean, **every)
    for rank in (0, 1):
        write(tmp_path / "run" / f"rank-{rank:05d}-000000.parquet", [r for r in rows if r["rank"] == rank])
    shards = load([tmp_path]).shards
    assert {c for s in shards for c in s.columns} >= NULLABLE_COLUMNS
    engine = Engine.open(shards)
    try:
        engine.step_table()
        assert engine.last_query == generated
    finally:
        engine.close()


def test_every_declared_column_is_in_the_table_of_every_form_in_the_declared_order(tmp_path: Path) -> None:
    """The declarations are the table: every StepColumn is a column of the step table in each form, in the
    declared order (the evidence columns with evidence only), and every per-rank and per-microbatch value is
    read by some column's reduction."""
    from tokaudit._engine import EVIDENCE, STEP_COLUMNS
    from tokaudit._engine.columns import PARTIALS

    rows = records(UNEVEN_GA * 4, local_mean)
    write(tmp_path / "micro" / "run" / "rank-all-000000.parquet", rows)
    write(tmp_path / "one" / "run" / "rank-all-000000.parquet", records([[[5], [0], [7]], [[4], [9], [2]]], local_mean))
    for folder in ("micro", "one"):
        for evidence in (False, True):
            table = Engine.open(load([tmp_path / folder]).shards, extremes=evidence).step_table()
            expected = [c.name for c in STEP_COLUMNS if evidence or c.name not in EVIDENCE]
            assert list(table.columns) == ["run", "grp", "term", "step", *expected]
    for partial in PARTIALS:
        assert any(partial.name in column.aggregate for column in STEP_COLUMNS), partial.name


def test_ranges_aggregated_each_by_an_engine_of_its_own_give_the_same_table(tmp_path: Path) -> None:
    """The seam a cluster plugs into: each range aggregated alone by `aggregate_range` (what a Ray worker runs),
    through an ordered map, gives the table and the repeated keys of the one engine bit for bit: several ranges,
    a repeated key whose later file wins, two groups and terms."""
    from tokaudit._engine import RangeTask, aggregate_range

    rows = records(UNEVEN_GA * 4, local_mean, positions=8)
    rows += [dict(r, group="dp1", term="aux", backward_scalar=0.5 * r["backward_scalar"]) for r in rows]
    for first in range(0, 12, 3):
        write(tmp_path / "run" / f"rank-all-{first:06d}.parquet", [r for r in rows if first <= r["step"] < first + 3])
    write(
        tmp_path / "run" / "rank-all-999999.parquet",
        [dict(r, loss_sum=r["loss_sum"] + 1.0) for r in rows if r["step"] == 7],
    )  # a later copy, other values
    shards = load([tmp_path]).shards
    seen: list[RangeTask] = []

    def mapped(function: Any, tasks: Any) -> Any:
        seen.extend(tasks)
        return map(function, tasks)

    one = Engine.open(shards, chunk_rows=10)
    apart = Engine.open(shards, chunk_rows=10, ranges_map=mapped)
    assert not _same_table(one.step_table(), apart.step_table())
    assert len(seen) > 1 and all(isinstance(task, RangeTask) for task in seen) and aggregate_range is not None
    assert one.duplicates == apart.duplicates and _counts(apart.duplicates) == {"run": (8, 7, 7, 1)}


def test_a_pandas_copy_beside_one_launch_is_no_later_launch(tmp_path: Path) -> None:
    """One launch of 4 ranks whose ranks 0 and 1 say W = 2 and take the token mean over their pair, ranks 2 and 3
    W = 4 over all four (broken: world_size_inconsistent). A pandas backup of rank 0's shard beside it (a file that
    says no launch) repeats rank 0's keys, which is no launch recording the step again: ranks 2 and 3 were taken
    for an earlier launch's ranks past W = 2 and left out, and the run read correct."""
    import json

    from tokaudit._schema import PROVENANCE_KEY

    counts = [[[5, 3], [2, 7]], [[4, 4], [9, 1]], [[3, 6], [6, 2]]]
    pair = records(counts, token_mean, world_size=2)
    four = [r for r in records([step * 2 for step in counts], token_mean, world_size=4) if r["rank"] >= 2]
    folder = tmp_path / "run"
    facts = json.dumps({"launch": {"id": "a", "first_shard": 0}}).encode()
    for rank in range(4):
        mine = [r for r in pair + four if r["rank"] == rank]
        write(folder / f"rank-{rank:05d}-000000.parquet", mine, metadata={PROVENANCE_KEY: facts})
    alone = audit([folder])
    pd.read_parquet(folder / "rank-00000-000000.parquet").to_parquet(folder / "rank0_backup.parquet")
    copied = audit([folder])
    assert alone.runs[0].verdict == copied.runs[0].verdict == "incorrect"
    assert "world_size_inconsistent" in {f.code.value for f in alone.findings} & {f.code.value for f in copied.findings}


def test_an_earlier_launch_in_files_that_say_no_launch_is_still_an_earlier_launch(tmp_path: Path) -> None:
    """A run on 4 ranks written by another writer (no launch in its footers), then relaunched on 2 by the recorder
    over the same steps, both the token mean: each step is the later launch's W = 2 records (the earlier's ranks 2
    and 3 stayed beside them when only launches that say so could record a step again: incorrect)."""
    import json
    import os

    from tokaudit._schema import PROVENANCE_KEY

    counts = [[[5, 3], [2, 7], [4, 4], [9, 1]], [[3, 6], [6, 2], [1, 8], [2, 2]]]
    wide = records(counts, token_mean)
    narrow = records([step[:2] for step in counts], token_mean)
    facts = json.dumps({"launch": {"id": "b", "first_shard": 1}}).encode()
    for rank in range(4):
        earlier = write(tmp_path / "run" / f"rank-{rank:05d}-000000.parquet", [r for r in wide if r["rank"] == rank])
        os.utime(earlier, ns=(1_700_000_000_000_000_000,) * 2)
    for rank in range(2):
        mine = [r for r in narrow if r["rank"] == rank]
        write(tmp_path / "run" / f"rank-{rank:05d}-000001.parquet", mine, metadata={PROVENANCE_KEY: facts})
    report = audit([tmp_path / "run"])
    (finding,) = report.findings
    assert report.runs[0].verdict == "correct" and finding.code.value == "duplicate_records", report.findings
