"""Bad input: one line naming the file and the problem, exit code 2, the other files still read,
nothing modified. Good input in any legal shape is accepted."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tests.logs import UNEVEN, UNEVEN_GA, local_mean, records, token_mean, write, write_by_rank
from tokaudit._auditing import audit
from tokaudit.cli import main
from tokaudit._loading import discover, load
from tokaudit._reader import inspect_shard
from tokaudit._schema import WRITER_SCHEMA


def good_run(folder: Path) -> Path:
    return write_by_rank(folder, records(UNEVEN, token_mean))


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def table_without(column: str) -> pa.Table:
    table = pa.Table.from_pylist(records(UNEVEN, token_mean))
    return table.drop_columns([column])


def bad_files(folder: Path) -> dict[str, str]:
    """file name → words its error line must contain."""
    folder.mkdir(parents=True)
    pq.write_table(table_without("valid_tokens"), folder / "missing.parquet")
    typed = pa.Table.from_pylist(records(UNEVEN, token_mean)).set_column(5, "valid_tokens", pa.array(["3"] * 6))
    pq.write_table(typed, folder / "mistyped.parquet")
    # what pandas writes where one record lacks T: the integer column as float, NaN for the missing value
    frame = pa.Table.from_pylist(records(UNEVEN, token_mean, positions=40)).to_pandas()
    frame.loc[2, "positions"] = None
    frame.to_parquet(folder / "pandas_float.parquet")
    negative = records(UNEVEN, token_mean)
    negative[3]["valid_tokens"] = -4
    write(folder / "negative.parquet", negative)
    newer = records(UNEVEN, token_mean, schema_version=2)
    write(folder / "newer.parquet", newer)
    null_step = records(UNEVEN, token_mean)
    null_step[1]["step"] = None
    write(folder / "null.parquet", null_step)
    nan_divisor = records(UNEVEN, token_mean, grad_divisor=float("nan"))
    write(folder / "nan_divisor.parquet", nan_divisor)
    # NaN never shows in a footer's statistics: the aggregation counts it, then names the file
    write(folder / "nan_scale.parquet", records(UNEVEN, token_mean, grad_scale=float("nan")))
    masked = records(UNEVEN, token_mean, masked_weight_abs_sum=0.0)
    masked[2]["masked_weight_abs_sum"] = -0.5  # an absolute sum below 0
    write(folder / "masked.parquet", masked)
    # T < n on one record where the file's T and n overlap: its statistics cannot tell, the aggregation counts it
    below = [dict(r, positions=r["valid_tokens"] + 2) for r in records(UNEVEN, token_mean)]
    below[4]["positions"] = below[4]["valid_tokens"] - 1
    write(folder / "below.parquet", below)
    rank_too_big = records(UNEVEN, token_mean)
    rank_too_big[0]["rank"] = 5
    write(folder / "rank.parquet", rank_too_big)
    (folder / "text.parquet").write_text("step,micro\n1,2\n")
    # Spark's partitionBy("rank"): the column is in the folder's name, not in the file; this one's is no integer
    (folder / "rank=x").mkdir()
    pq.write_table(table_without("rank"), folder / "rank=x" / "part.parquet")
    whole = write(folder / "whole.parquet", records(UNEVEN, token_mean))
    (folder / "truncated.parquet").write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    whole.unlink()
    return {
        "missing.parquet": "missing column 'valid_tokens' (n: valid tokens of the microbatch)",
        "mistyped.parquet": "column 'valid_tokens' has type string, expected an integer type",
        "pandas_float.parquet": "column 'positions' has type double, expected an integer type (a count written as "
        "float: pandas does so where one value is missing, numpy where it was computed as a float; write it as an "
        "integer, with pandas' nullable integer where a value is missing: df.astype({'positions': 'Int64'}))",
        "negative.parquet": "column 'valid_tokens' has a negative count (-4) at row 3",
        "newer.parquet": "schema_version 2 is newer than this tokaudit reads (1)",
        "null.parquet": "column 'step' has a null value at row 1",
        "nan_divisor.parquet": "column 'grad_divisor' is not a finite positive number",
        "nan_scale.parquet": "column 'grad_scale' is NaN",
        "rank.parquet": "column 'rank' is not below 'world_size'",
        "masked.parquet": "column 'masked_weight_abs_sum' has a negative sum of absolute values (-0.5) at row 2",
        "below.parquet": f"column 'positions' is below 'valid_tokens' ({below[4]['positions']} < "
        f"{below[4]['valid_tokens']}) at row 4",
        "text.parquet": "not a readable Parquet file",
        "part.parquet": "the folder 'rank=x' gives 'rank' a value that is not an int64",
        "truncated.parquet": "not a readable Parquet file",
    }


def test_every_bad_file_gets_one_line_and_the_good_run_is_still_audited(tmp_path: Path) -> None:
    good_run(tmp_path / "logs" / "good")
    expected = bad_files(tmp_path / "logs" / "bad")
    before = tree_digest(tmp_path / "logs")
    result = CliRunner().invoke(main, ["check", str(tmp_path / "logs"), "--format", "json"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("tokaudit: error:")]
    assert len(lines) == len(expected)
    for name, words in expected.items():
        (line,) = [line for line in lines if f"/{name}:" in line]
        assert words in line, line
    import json

    report = json.loads(result.stdout)
    assert [r["run"] for r in report["runs"]] == ["good"] and report["runs"][0]["verdict"] == "correct"
    assert len(report["problems"]) == len(expected)
    assert tree_digest(tmp_path / "logs") == before, "input modified"


@pytest.mark.parametrize(
    "setup, words",
    [
        (lambda p: p.mkdir(), "no Parquet files"),
        (lambda p: None, "no such file or directory"),
    ],
)
def test_empty_or_missing_paths(tmp_path: Path, setup: Any, words: str) -> None:
    setup(tmp_path / "runs")
    result = CliRunner().invoke(main, ["check", str(tmp_path / "runs")])
    assert result.exit_code == 2
    assert f"{tmp_path / 'runs'}: {words}" in result.stderr


def test_corrupt_data_pages_are_reported_and_the_rest_read(tmp_path: Path) -> None:
    good_run(tmp_path / "good")
    path = write(tmp_path / "bad" / "rank-00000-000000.parquet", records(UNEVEN * 50, token_mean))
    data = bytearray(path.read_bytes())
    # Overwrite the middle of the data pages, leaving the footer intact.
    for i in range(200, min(len(data) - 400, 1200)):
        data[i] = 0xFF
    path.write_bytes(bytes(data))
    report = audit([tmp_path])
    assert [r.run for r in report.runs] == ["good"]
    assert len(report.problems) == 1 and str(path) in report.problems[0]


def test_killed_writer_temporaries_are_ignored(tmp_path: Path) -> None:
    good_run(tmp_path / "run")
    (tmp_path / "run" / ".rank-00000-000001.parquet.123.tmp").write_bytes(b"PAR1 half")
    (tmp_path / "run" / ".hidden.parquet").write_bytes(b"garbage")
    logset = load([tmp_path])
    assert logset.problems == [] and len(logset.shards) == 2


def test_any_legal_shape_is_accepted(tmp_path: Path) -> None:
    rows = records(UNEVEN, token_mean, run_id="shaped", group="0")
    table = pa.Table.from_pylist(rows)
    narrow = pa.table(
        {
            "backward_scalar": pa.array([r["backward_scalar"] for r in rows], pa.float32()),
            "extra_column": pa.array(["x"] * len(rows)),
            "valid_tokens": pa.array([r["valid_tokens"] for r in rows], pa.int16()),
            "loss_sum": pa.array([r["loss_sum"] for r in rows], pa.float32()),
            "world_size": pa.array([r["world_size"] for r in rows], pa.int8()),
            "rank": pa.array([r["rank"] for r in rows], pa.int16()),
            "micro": pa.array([r["micro"] for r in rows], pa.int8()),
            "step": pa.array([r["step"] for r in rows], pa.int32()),
            "run_id": pa.array([r["run_id"] for r in rows]).dictionary_encode(),
            "group": table["group"].combine_chunks().dictionary_encode(),
        }
    )
    (tmp_path / "run").mkdir()
    pq.write_table(narrow, tmp_path / "run" / "narrow.parquet")
    shard = inspect_shard(tmp_path / "run" / "narrow.parquet")
    assert "valid_tokens" in shard.columns and "extra_column" not in shard.columns
    report = audit([tmp_path], rtol=1e-5)
    assert report.problems == [] and report.runs[0].run == "shaped"
    assert report.runs[0].verdict == "correct"


def test_a_column_of_nulls_alone_reads_as_its_nulls_not_as_a_wrong_type(tmp_path: Path) -> None:
    """A writer that never had a value for a column (pandas' all-None column, pa.Table.from_pylist) stores
    Arrow's null type: an optional column of it is the column's nulls, as if absent, on a rank's file or
    on all; a required one is a null value, as any other."""
    from tokaudit._render.json_report import render_json

    def write_rows(folder: Path, rows: list[dict[str, Any]]) -> None:
        folder.mkdir(parents=True)
        for rank in sorted({r["rank"] for r in rows}):
            pq.write_table(
                pa.Table.from_pylist([r for r in rows if r["rank"] == rank]), folder / f"rank-{rank}.parquet"
            )

    blank = (
        "time",
        "group",
        "term",
        "reported_loss",
        "token_weight_sum",
        "grad_scale",
        "positions",
        "sync",
        "skipped",
        "divisor_known",
        "masked_weight_abs_sum",
        "grad_divisor",
    )
    rows = records(UNEVEN_GA, local_mean, run_id="nulls")
    write_rows(tmp_path / "absent" / "nulls", rows)
    write_rows(tmp_path / "null" / "nulls", [{**r, **dict.fromkeys(blank)} for r in rows])
    # rank 1 alone without a reported loss: its file's column is of the null type, rank 0's of float64
    write_rows(tmp_path / "mixed" / "nulls", [dict(r, reported_loss=None if r["rank"] else 2.0) for r in rows])
    assert pq.read_schema(tmp_path / "null" / "nulls" / "rank-0.parquet").field("sync").type == pa.null()
    expected = render_json(audit([tmp_path / "absent"])).replace(str(tmp_path / "absent"), "LOG")
    assert render_json(audit([tmp_path / "null"])).replace(str(tmp_path / "null"), "LOG") == expected
    assert "local_mean" in expected and '"problems": []' in expected
    mixed = audit([tmp_path / "mixed"])
    assert mixed.problems == [] and mixed.runs[0].verdict == "incorrect"
    write_rows(tmp_path / "required" / "nulls", [dict(r, valid_tokens=None) for r in rows])
    problems = audit([tmp_path / "required"]).problems
    assert len(problems) == 2 and all("column 'valid_tokens' has a null value at row 0" in p for p in problems)


def test_backward_scalar_may_be_null_only_with_probe_weights(tmp_path: Path) -> None:
    rows = records(UNEVEN, token_mean)
    for row in rows:
        row["token_weight_sum"] = row["backward_scalar"] / row["loss_sum"] * row["valid_tokens"]
        row["backward_scalar"] = None
    write(tmp_path / "probe" / "a.parquet", rows)
    assert audit([tmp_path / "probe"]).runs[0].verdict == "correct"
    rows = records(UNEVEN, token_mean)
    rows[0]["backward_scalar"] = None
    write(tmp_path / "noprobe" / "a.parquet", rows)
    report = audit([tmp_path / "noprobe"])
    assert "backward_scalar' is null where no probe weights were recorded" in report.problems[0]


def test_shards_of_one_schema_keep_their_own_footers(tmp_path: Path) -> None:
    """A schema is checked once for all the shards that share it, but each shard's own footer still
    decides its statistics, its dropped-steps note and its problems."""
    from tokaudit._schema import dropped_metadata

    rows = records(UNEVEN, token_mean)
    names = [f.name for f in WRITER_SCHEMA if f.name in rows[0]]
    schema = pa.schema([WRITER_SCHEMA.field(n) for n in names])
    noted = schema.with_metadata(dropped_metadata("run", "0", 1, [(4, 6, 2)]))
    write(tmp_path / "run" / "rank-00000.parquet", [r for r in rows if r["rank"] == 0], schema)
    write(
        tmp_path / "run" / "rank-00001.parquet", [dict(r, step=r["step"] + 10) for r in rows if r["rank"] == 1], noted
    )
    write(tmp_path / "run" / "rank-00002.parquet", [dict(r, valid_tokens=-1) for r in rows if r["rank"] == 0], schema)
    found = load([tmp_path])
    first, second = found.shards
    assert first.dropped is None and second.dropped == {"run": "run", "group": "0", "rank": 1, "steps": [(4, 6, 2)]}
    assert first.signature == second.signature
    assert second.step_range[0] == first.step_range[0] + 10
    assert [p.path.endswith("rank-00002.parquet") and "negative count" in p.problem for p in found.problems] == [True]


def _many_files(folder: Path) -> dict[str, str]:
    """A log of good shards (several schemas, a dropped-steps note) with every kind of bad file among them."""
    from tokaudit._schema import WRITER_SCHEMA, dropped_metadata

    expected = bad_files(folder / "bad")
    rows = records(UNEVEN, token_mean)
    names = [f.name for f in WRITER_SCHEMA if f.name in rows[0]]
    noted = pa.schema([WRITER_SCHEMA.field(n) for n in names]).with_metadata(
        dropped_metadata("good", "0", 1, [(2, 3, 1)])
    )
    for index in range(24):
        shifted = [dict(r, step=r["step"] + 10 * index) for r in rows]
        write(folder / "good" / f"rank-{index:05d}.parquet", shifted, noted if index == 7 else None)
    write(
        folder / "good" / "other-schema.parquet",
        [dict(r, step=r["step"] + 500, positions=2 * r["valid_tokens"]) for r in rows],
    )
    return expected


def test_footers_validated_in_worker_processes_give_the_serial_result(tmp_path: Path, monkeypatch: Any) -> None:
    import subprocess

    import tokaudit._loading as loading

    expected = _many_files(tmp_path / "logs")
    before = tree_digest(tmp_path / "logs")
    serial = load([tmp_path / "logs"], thorough=False)
    started = []
    popen = subprocess.Popen

    def spy(*args: Any, **kwargs: Any) -> Any:
        started.append(args)
        return popen(*args, **kwargs)

    monkeypatch.setattr(loading, "PARALLEL_FILES", 1)
    monkeypatch.setattr(loading, "BATCH_FILES", 4)
    monkeypatch.setattr(loading, "FRAME_FILES", 3)  # several frames a worker
    monkeypatch.setattr(subprocess, "Popen", spy)
    parallel = load([tmp_path / "logs"], thorough=False, workers=3)
    assert len(started) == 2, "two workers share the files with this process"
    # 24 good shards, the other schema's, and the NaN grad_scale and T < n that only the aggregation sees
    assert parallel.shards == serial.shards and len(parallel.shards) == 27
    assert [str(p) for p in parallel.problems] == [str(p) for p in serial.problems]
    # every bad file named once with its problem (the NaN ones need a full read: not from footers)
    footer_visible = {n: w for n, w in expected.items() if not n.startswith(("nan_", "below"))}
    for name, words in footer_visible.items():
        assert [words in p.problem for p in parallel.problems if p.path.endswith(f"/{name}")] == [True], name
    assert sum(s.dropped is not None for s in parallel.shards) == 1
    assert tree_digest(tmp_path / "logs") == before, "input modified"


@pytest.mark.slow
def test_the_commands_start_footer_workers_before_they_import_the_auditor(tmp_path: Path) -> None:
    """`check`, `weights` and `curve` start the validation of a large log (`start_loading`) before they
    import pyarrow, pandas and DuckDB, so that the workers validate while this process imports; the report
    is the one of an audit that loads the log itself. A load started and closed unread leaves no worker
    running."""
    import json
    import subprocess
    import sys

    import tokaudit._loading as loading
    from tokaudit._render.json_report import render_json

    _many_files(tmp_path / "logs")
    script = (
        "import json, subprocess, sys\n"
        "import tokaudit._loading as loading\n"
        "loading.PARALLEL_FILES, loading.BATCH_FILES = 1, 4\n"
        "loading.cores = lambda: 2  # (workers as on two cores, whatever this machine lends the test)\n"
        "seen, popen = [], subprocess.Popen\n"
        "def spy(*args, **kwargs):\n"
        "    seen.append([name in sys.modules for name in ('tokaudit._auditing', 'pandas', 'duckdb', 'pyarrow')])\n"
        "    return popen(*args, **kwargs)\n"
        "subprocess.Popen = spy\n"
        "from tokaudit.cli import main\n"
        "try:\n"
        "    main(json.loads(sys.argv[1]))\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(json.dumps(seen))\n"
    )
    logs = str(tmp_path / "logs")
    for command in (
        ["check", logs, "--format", "json", "-q", "-o", str(tmp_path / "report.json")],
        ["weights", logs, "--step", "1", "--run", "good", "--format", "csv"],
        ["curve", logs, "--run", "good", "--csv", str(tmp_path / "curve.csv")],
    ):
        done = subprocess.run(
            [sys.executable, "-c", script, json.dumps(command)], capture_output=True, text=True, timeout=120
        )
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        assert len(seen) >= 1 and all(not any(imported) for imported in seen), (command[0], seen)
    assert (tmp_path / "report.json").read_text() == render_json(audit([tmp_path / "logs"]))
    assert (tmp_path / "curve.csv").read_text().startswith("step,")

    unstarted = loading.start_loading([tmp_path / "logs"], thorough=False, workers=3)
    assert unstarted.shares == []  # too few files for workers
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "PARALLEL_FILES", 1)
        patch.setattr(loading, "BATCH_FILES", 4)
        with loading.start_loading([tmp_path / "logs"], thorough=False, workers=3) as started:
            workers = started.workers
            assert len(workers) == 2
            half = -(-len(started.files) // 2)
            assert [(s.start, s.end) for s in started.shares] == [(0, half), (half, len(started.files))]
        assert all(worker.poll() is not None for worker in workers) and started.workers == []


_WORKER_FAULTS = {
    "worker fails": "import sys; sys.exit(3)",
    "worker hangs": "import time; time.sleep(120)",
    "worker dies half-way": (
        "import pickle, sys; paths, thorough, sys.path[:] = pickle.load(sys.stdin.buffer); "
        "from tokaudit._loading import serve; serve(paths[:5], thorough, sys.stdout.buffer); "
        "sys.exit(3)"
    ),
    "worker writes garbage": "import sys; sys.stdout.buffer.write((5).to_bytes(8, 'little') + b'hello'); sys.stdout.flush()",
}


@pytest.mark.parametrize("broken", ["no interpreter", *_WORKER_FAULTS])
def test_footers_are_validated_here_when_no_worker_can(tmp_path: Path, monkeypatch: Any, broken: str) -> None:
    """A worker that cannot start, fails, hangs, dies half-way or writes what no worker writes: this
    process validates what it did not answer, and the result is the serial one. No worker is left."""
    import time

    import tokaudit._loading as loading
    import tokaudit._reader as reader

    _many_files(tmp_path / "logs")
    serial = load([tmp_path / "logs"], thorough=False)
    monkeypatch.setattr(loading, "PARALLEL_FILES", 1)
    monkeypatch.setattr(loading, "BATCH_FILES", 4)
    monkeypatch.setattr(loading, "FRAME_FILES", 2)
    if broken == "no interpreter":
        monkeypatch.setattr(loading.sys, "executable", str(tmp_path / "no-python"))
    else:
        monkeypatch.setattr(loading, "_WORKER", _WORKER_FAULTS[broken])
    here: list[Any] = []
    inspect = reader.inspect_batch
    monkeypatch.setattr(reader, "inspect_batch", lambda paths, *args: here.extend(paths) or inspect(paths, *args))
    begun = time.monotonic()
    with loading.start_loading([tmp_path / "logs"], thorough=False, workers=4) as started:
        workers = started.workers
        assert len(workers) == (0 if broken == "no interpreter" else 3)
        fallback = started.result()
    assert time.monotonic() - begun < 30 and all(worker.poll() is not None for worker in workers)
    assert fallback.shards == serial.shards
    assert [str(p) for p in fallback.problems] == [str(p) for p in serial.problems]
    if broken in ("no interpreter", "worker fails", "worker hangs", "worker writes garbage"):
        assert sorted(map(str, here)) == sorted(map(str, started.files))  # every file validated here


def test_footer_workers_are_bounded_by_the_files_and_a_cap(monkeypatch: Any) -> None:
    """Each process takes at least BATCH_FILES files, and at most MAX_WORKERS processes run, this one
    included: 64 cores do not start 64 interpreters. The workers' shares cover the files in order."""
    import io
    import subprocess

    import tokaudit._loading as loading

    started: list[Any] = []

    class Worker:
        """A worker that is started and then stopped."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            started.append(args)
            self.stdin, self.stdout = io.BytesIO(), None
            self.killed = False

        def poll(self) -> int | None:
            return 0 if self.killed else None

        def kill(self) -> None:
            self.killed = True

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(subprocess, "Popen", Worker)
    files = [Path(f"/nowhere/{i}.parquet") for i in range(100 * loading.BATCH_FILES)]
    for workers, count, expected in (
        (64, len(files), loading.MAX_WORKERS - 1),
        (2, len(files), 1),
        (64, 3 * loading.BATCH_FILES, 2),
        (64, loading.BATCH_FILES + 1, 0),
    ):
        started.clear()
        monkeypatch.setattr(loading, "discover", lambda paths, notes=None, found=files[:count]: (found, []))
        with loading.start_loading(["/nowhere"], False, workers) as under_way:
            shares = under_way.shares
            assert len(started) == len(shares) == len(under_way.workers) == expected, (workers, count)
            if shares:
                assert shares[0].start == 0 and shares[-1].end == count
                assert all(a.end == b.start for a, b in zip(shares, shares[1:]))
        assert under_way.workers == [], "closing stops every worker"


def test_a_shard_names_its_one_run_group_and_term_only_when_its_footer_shows_it(tmp_path: Path) -> None:
    """`Shard.names`: a column's one value (min = max, no null), its default when it is absent (the
    run's default is the folder), and None as soon as the footer allows two names, or says nothing (a
    column of nulls only has no min or max)."""
    rows = records(UNEVEN, token_mean)
    cases = {
        "absent": (
            [{k: v for k, v in r.items() if k not in ("run_id", "group", "term")} for r in rows],
            ("folder", "0", "0"),
        ),
        "one": ([dict(r, run_id="it's ∑", group="dp0", term="aux") for r in rows], ("it's ∑", "dp0", "aux")),
        "all null": ([dict(r, run_id=None, term=None) for r in rows], None),
        "two terms": ([dict(r, term="aux" if r["rank"] else "lm") for r in rows], None),
        "a null among values": ([dict(r, group=None if r["rank"] else "dp0") for r in rows], None),
    }
    run_groups = {
        "absent": ("folder", "0"),
        "one": ("it's ∑", "dp0"),
        "all null": None,
        "two terms": ("folder", "0"),
        "a null among values": None,
    }
    for name, (written, expected) in cases.items():
        path = write(tmp_path / name.replace(" ", "_") / "folder" / "rank-all-000000.parquet", written)
        shard = inspect_shard(path)
        assert shard.names == expected, name
        # `Shard.run_group`: the (run, group) alone, also where the term varies (several loss terms in a file)
        assert shard.run_group == run_groups[name], name


def test_files_of_one_parquet_schema_keep_the_arrow_types_their_writers_stored(tmp_path: Path) -> None:
    """A schema seen last is not made again for a file whose Parquet schema and stored Arrow schema are the
    same: files of one Parquet schema whose writers stored other Arrow types (a dictionary of names, a time
    stamp's zone, both stored as UTC) each keep their own, whatever order they are read in."""
    rows = [dict(r, run_id="run") for r in records(UNEVEN, token_mean)]
    names = [f.name for f in WRITER_SCHEMA if f.name in rows[0]]
    plain = pa.schema([WRITER_SCHEMA.field(n) for n in names])
    table = pa.Table.from_pylist(rows, schema=plain)
    coded = table.set_column(table.schema.get_field_index("run_id"), "run_id", table["run_id"].dictionary_encode())
    zoned = table.append_column(
        pa.field("time", pa.timestamp("us", tz="UTC")), pa.array([0] * len(rows), pa.timestamp("us", tz="UTC"))
    )
    naive = table.append_column(
        pa.field("time", pa.timestamp("us", tz="Asia/Tokyo")),
        pa.array([0] * len(rows), pa.timestamp("us", tz="Asia/Tokyo")),
    )
    paths = {}
    for name, written in {"plain": table, "coded": coded, "zoned": zoned, "naive": naive}.items():
        paths[name] = tmp_path / f"{name}.parquet"
        pq.write_table(written, paths[name])
    assert pq.read_metadata(paths["plain"]).schema.equals(pq.read_metadata(paths["coded"]).schema)
    assert pq.read_metadata(paths["zoned"]).schema.equals(pq.read_metadata(paths["naive"]).schema)
    for order in (
        ["plain", "coded", "plain"],
        ["coded", "plain", "coded"],
        ["zoned", "naive", "zoned"],
        ["naive", "zoned", "naive"],
    ):
        for name in order:
            expected = dict((f.name, str(f.type)) for f in pq.read_schema(paths[name]))
            got = dict(inspect_shard(paths[name]).signature)
            assert got == {column: expected[column] for column in got}, (order, name)
    assert dict(inspect_shard(paths["coded"]).signature)["run_id"].startswith("dictionary<values=string")
    assert dict(inspect_shard(paths["zoned"]).signature)["time"] == "timestamp[us, tz=UTC]"


def test_a_shard_names_the_optional_columns_that_hold_no_value_from_its_footer(tmp_path: Path) -> None:
    """`Shard.null_columns`: a nullable column whose every row group counts as many nulls as rows (what
    the recorder writes for a probe or a reported loss it was not given); a value in any row group, or a
    footer without null counts, keeps the column out. Absent columns are not listed (the file lacks them)."""
    rows = records(UNEVEN * 4, token_mean)
    full = pa.schema(
        [WRITER_SCHEMA.field(n) for n in [*rows[0], "reported_loss", "positions", "sync", "token_weight_sum"]]
    )
    valued = [
        dict(r, reported_loss=2.0 if index == len(rows) - 1 else None, positions=None, sync=True, token_weight_sum=None)
        for index, r in enumerate(rows)
    ]
    table = pa.Table.from_pylist(valued, schema=full)
    path = tmp_path / "groups.parquet"
    pq.write_table(table, path, row_group_size=5)  # the one reported loss sits in the last row group
    assert pq.ParquetFile(path).metadata.num_row_groups > 2
    assert inspect_shard(path).null_columns == {"positions", "token_weight_sum"}
    pq.write_table(table.drop_columns(["reported_loss"]), path, row_group_size=5)
    assert inspect_shard(path).null_columns == {"positions", "token_weight_sum"}
    pq.write_table(table, path)  # one row group: statistics and null counts taken in one pass
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    assert inspect_shard(path).null_columns == {"positions", "token_weight_sum"}
    pq.write_table(table, path, write_statistics=False)
    assert inspect_shard(path).null_columns == frozenset()


def test_a_one_row_shard_gives_its_record_from_its_footer_only_where_it_is_exact(tmp_path: Path) -> None:
    """`Shard.record`: each value of a one-row file as its footer's statistics give it, bit for bit, in the
    file's column order (None for a null): a float32, an unsigned and a narrow integer, an integer in a
    float column, a dictionary-encoded string, timestamps in µs with a zone and in ns without one (the
    stored integer), a bool. No record where one value is not certain: a float 0 of either sign (Parquet
    writes min −0.0 and max +0.0 for both), NaN and a string too long for statistics (no min or max),
    a half float, a file written without statistics, and a file of two rows. A 0 of
    masked_weight_abs_sum, whose sign nothing reads (`SIGNLESS_ZEROS`), is taken as 0.0."""
    import math
    import struct

    base = {
        "step": pa.array([7], pa.uint16()),
        "micro": pa.array([0], pa.int8()),
        "rank": pa.array([3], pa.int32()),
        "world_size": pa.array([4], pa.uint64()),
        "loss_sum": pa.array([0.1], pa.float32()),
        "valid_tokens": pa.array([9], pa.int64()),
        "backward_scalar": pa.array([-2.5e-300]),
        "run_id": pa.array(["rün ∑"]).dictionary_encode(),
        "grad_divisor": pa.array([3], pa.int64()),
        "reported_loss": pa.array([None], pa.float64()),
        "sync": pa.array([False]),
        "time": pa.array([1_700_000_000_123_456], pa.timestamp("us", tz="UTC")),
        "positions": pa.array([None], pa.int64()),
        "masked_weight_abs_sum": pa.array([-0.0]),
    }
    path = tmp_path / "one.parquet"
    pq.write_table(pa.table(base), path)
    shard = inspect_shard(path)
    assert [name for name, _ in shard.signature] == list(base)
    assert shard.record is not None
    expected = [
        7,
        0,
        3,
        4,
        struct.unpack("f", struct.pack("f", 0.1))[0],
        9,
        -2.5e-300,
        "rün ∑",
        3,
        None,
        False,
        1_700_000_000_123_456,
        None,
        0.0,
    ]
    assert [type(v) for v in shard.record] == [type(v) for v in expected]
    assert [struct.pack("d", v) if isinstance(v, float) else v for v in shard.record] == [
        struct.pack("d", v) if isinstance(v, float) else v for v in expected
    ]
    ns = dict(base, time=pa.array([1_700_000_000_123_456_789], pa.timestamp("ns")))
    pq.write_table(pa.table(ns), path)
    assert inspect_shard(path).record[11] == 1_700_000_000_123_456_789  # type: ignore[index]

    uncertain = {
        "zero": dict(base, loss_sum=pa.array([0.0])),
        "negative zero": dict(base, backward_scalar=pa.array([-0.0])),
        "nan": dict(base, backward_scalar=pa.array([math.nan])),
        "long string": dict(base, run_id=pa.array(["x" * 5000])),
        "half float": dict(base, grad_divisor=pa.array([2.0], pa.float16())),
    }
    for name, columns in uncertain.items():
        pq.write_table(pa.table(columns), path)
        assert inspect_shard(path).record is None, name
    pq.write_table(pa.table(base), path, write_statistics=False)
    assert inspect_shard(path).record is None
    pq.write_table(pa.concat_tables([pa.table(base)] * 2), path)
    assert inspect_shard(path).record is None


def test_a_half_float_divisor_is_accepted_and_audited_as_its_values(tmp_path: Path) -> None:
    """A float column may have any float width: a half-float grad_divisor, whose statistics
    are bytes and which has no compute kernels of its own, is checked and audited like a double."""
    from tokaudit._render.json_report import render_json

    rows = records(UNEVEN, token_mean)
    table = pa.Table.from_pylist(rows)
    for folder, divisor_type in (("half", pa.float16()), ("double", pa.float64())):
        divisors = pa.array([float(r["world_size"]) for r in rows], pa.float16()).cast(divisor_type)
        (tmp_path / folder / "run").mkdir(parents=True)
        pq.write_table(table.append_column("grad_divisor", divisors), tmp_path / folder / "run" / "a.parquet")
    half, double = audit([tmp_path / "half"]), audit([tmp_path / "double"])
    assert half.problems == [] and half.runs[0].steps == len(UNEVEN)
    assert render_json(half).replace(str(tmp_path / "half"), "") == render_json(double).replace(
        str(tmp_path / "double"), ""
    )


def test_a_one_row_shard_is_validated_from_its_record_as_from_its_statistics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-row file whose record its footer gives (`Shard.record`) is validated from that record
    (`_record_stats`) instead of its statistics read again: the shard (ranges, names, columns of nulls
    only) and every problem are what the statistics give, for good files and for each kind of bad value."""
    import dataclasses

    import tokaudit._reader as reader

    good = records([[[5]]], token_mean)[0]
    cases = {
        "plain": good,
        "named": dict(good, run_id="r ∑", group="g", term="aux", grad_divisor=2, sync=None, reported_loss=None),
        "null divisor": dict(good, grad_divisor=None, positions=7, skipped=True),
        "null count": dict(good, valid_tokens=None),
        "negative count": dict(good, valid_tokens=-1),
        "rank past W": dict(good, rank=3, world_size=2),
        "newer version": dict(good, schema_version=99),
        "negative divisor": dict(good, grad_divisor=-2.0),
        "null scalar": dict(good, backward_scalar=None),
        "negative masked weight": dict(good, masked_weight_abs_sum=-1.0),
    }
    folder = tmp_path / "one"
    for name, row in cases.items():
        write(folder / f"{name.replace(' ', '_')}.parquet", [row])
    huge = tmp_path / "huge.parquet"
    pq.write_table(pa.table({**{k: [v] for k, v in good.items()}, "step": pa.array([2**64 - 1], pa.uint64())}), huge)

    def inspected(path: Path) -> Any:
        try:
            return dataclasses.replace(inspect_shard(path, thorough=False), record=None)
        except Exception as error:
            return str(error)

    paths = [*sorted(folder.glob("*.parquet")), huge]
    from_records = [inspected(path) for path in paths]
    assert sum(isinstance(r, str) for r in from_records) == 8
    assert all(
        inspect_shard(p, thorough=False).record is not None
        for p, r in zip(paths, from_records)
        if not isinstance(r, str)
    )
    monkeypatch.setattr(reader, "footer_record", lambda *args: None)
    assert [inspected(path) for path in paths] == from_records


def test_a_file_reached_by_several_paths_is_found_once(tmp_path: Path) -> None:
    """A hard link, a link to the file and a link to its folder all reach one file: it is listed once, by
    the first path in order; discovery names the files in path order, folder by folder."""
    run = tmp_path / "run"
    first = write(run / "a.parquet", records(UNEVEN, token_mean))
    write(run / "deeper" / "z.parquet", records(UNEVEN, token_mean))
    os.link(first, run / "b.parquet")
    os.symlink(first, run / "c.parquet")
    os.symlink(run, tmp_path / "again")
    files, problems = discover([run, tmp_path / "again", run / "c.parquet"])
    assert not problems
    assert files == [run / "a.parquet", run / "deeper" / "z.parquet"]
    assert all(type(path) is type(run) for path in files)


def test_a_folder_whose_name_begins_with_a_dot_is_skipped_but_never_in_silence(tmp_path: Path) -> None:
    """A run folder `.exp2` (the recorder's folder of a run id ".exp2") beside `exp1`: skipped, as pyarrow skips a
    writer's staging folders (.spark-staging-*), and it was skipped in silence, its incorrect run left out and the
    command's exit 0. Now a note names it; given as a path, it is audited. A dot-folder that holds no Parquet file
    (a .git) is not said."""
    good_run(tmp_path / "runs" / "exp1")
    write_by_rank(tmp_path / "runs" / ".exp2" / "deeper", records(UNEVEN, local_mean))
    (tmp_path / "runs" / ".git").mkdir()
    (tmp_path / "runs" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    result = CliRunner().invoke(main, ["check", str(tmp_path / "runs"), "--format", "json"])
    assert result.exit_code == 0 and [r["run"] for r in json.loads(result.stdout)["runs"]] == ["exp1"]
    assert result.stderr.splitlines() == [
        f"tokaudit: note: {tmp_path / 'runs' / '.exp2'}: a folder whose name begins with '.' is skipped (writers stage "
        "files there), and it holds Parquet files: give it as a path to audit them"
    ]
    given = CliRunner().invoke(main, ["check", str(tmp_path / "runs" / ".exp2"), "--format", "json"])
    assert given.exit_code == 1 and json.loads(given.stdout)["runs"][0]["verdict"] == "incorrect"


def test_what_a_writer_keeps_beside_its_data_is_skipped_and_said(tmp_path: Path) -> None:
    """Spark's `_temporary/` (an uncommitted task's parts: here the same records with other weights) and
    `_spark_metadata/` (a streaming sink's own, not a log) are skipped as pyarrow skips them, in one note; the
    report is the one of the data alone. Another folder whose name begins with '_' is read (the recorder's folder of a
    run id `_debug`), and so is a path given: each path is taken literally."""
    good = good_run(tmp_path / "plain" / "run")
    run = tmp_path / "spark" / "run"
    for shard in sorted(good.glob("*.parquet")):
        write(run / f"part-{shard.stem}.parquet", pq.read_table(shard).to_pylist())
    write(run / "_temporary" / "0" / "part-00000.parquet", records(UNEVEN, local_mean))
    (run / "_spark_metadata").mkdir()
    pq.write_table(pa.table({"txn": [1]}), run / "_spark_metadata" / "0.parquet")
    (run / "_SUCCESS").write_text("")
    result = CliRunner().invoke(main, ["check", str(tmp_path / "spark"), "--format", "json"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        f"tokaudit: note: {tmp_path / 'spark'}: 2 folder(s) a writer keeps beside its data skipped (Spark's _temporary "
        "of uncommitted tasks, a streaming sink's _spark_metadata, whose list of committed files is not read: every "
        "part file beside it is), as pyarrow skips them"
    ]
    plain = CliRunner().invoke(main, ["check", str(tmp_path / "plain"), "--format", "json"])
    assert result.stdout == plain.stdout
    good_run(tmp_path / "spark" / "_debug")
    runs = json.loads(CliRunner().invoke(main, ["check", str(tmp_path / "spark"), "--format", "json"]).stdout)["runs"]
    assert sorted(run["run"] for run in runs) == ["_debug", "run"]
    files, problems = discover([run / "_temporary"])
    assert files == [run / "_temporary" / "0" / "part-00000.parquet"] and not problems


def test_a_folder_of_parquet_files_named_otherwise_says_so(tmp_path: Path) -> None:
    """.pq, and Hive's files of no extension (000000_0) that begin as Parquet does; not a _SUCCESS marker."""
    write(tmp_path / "run" / "rank-0.pq", records(UNEVEN, token_mean))
    write(tmp_path / "hive" / "000000_0", records(UNEVEN, token_mean))
    (tmp_path / "hive" / "_SUCCESS").write_text("")
    files, problems = discover([tmp_path])
    assert files == [] and [(p.path, p.problem) for p in problems] == [
        (
            str(tmp_path),
            "no Parquet files (*.parquet) in this folder (2 file(s) are named .pq, .parq or with no extension: "
            "tokaudit reads *.parquet, rename them)",
        )
    ]


def test_parquet_files_of_no_extension_beside_parquet_ones_are_said(tmp_path: Path) -> None:
    """A rank's Hive-named file (000001_0) beside another's .parquet: not read, and said in a note rather than left
    out in silence (the run would read as missing a rank); a _SUCCESS marker is no such file, nor pyarrow's summary
    of a dataset's schema (_common_metadata: a footer, no row)."""
    rows = records(UNEVEN, token_mean)
    write(tmp_path / "run" / "rank-0.parquet", [r for r in rows if r["rank"] == 0])
    write(tmp_path / "run" / "000001_0", [r for r in rows if r["rank"] == 1])
    (tmp_path / "run" / "_SUCCESS").write_text("")
    pq.write_metadata(pq.read_schema(tmp_path / "run" / "rank-0.parquet"), tmp_path / "run" / "_common_metadata")
    notes: list[str] = []
    files, problems = discover([tmp_path], notes)
    assert [f.name for f in files] == ["rank-0.parquet"] and not problems
    assert notes == [
        f"{tmp_path}: 1 file(s) with no extension begin as Parquet files do (Hive names them 000000_0), not read: "
        "name them *.parquet to audit them"
    ]


def test_a_rank_s_file_named_pq_beside_the_others_is_said(tmp_path: Path) -> None:
    """One rank's shard saved as rank-1.pq beside rank-0.parquet: not read (*.parquet is what is read), and it was
    left out in silence, the run read as missing a rank; now a note says so."""
    rows = records(UNEVEN, token_mean)
    write(tmp_path / "run" / "rank-0.parquet", [r for r in rows if r["rank"] == 0])
    write(tmp_path / "run" / "rank-1.pq", [r for r in rows if r["rank"] == 1])
    notes: list[str] = []
    files, problems = discover([tmp_path], notes)
    assert [f.name for f in files] == ["rank-0.parquet"] and not problems
    assert notes == [f"{tmp_path}: 1 file(s) named .pq or .parq, not read: name them *.parquet to audit them"]


def test_a_folder_of_only_unusable_files_is_not_also_called_empty(tmp_path: Path, monkeypatch: Any) -> None:
    """A folder, named relative to where the command runs, whose one *.parquet is a dangling link: one line,
    the link's, and not also "no Parquet files" for the folder."""
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "nowhere.parquet", tmp_path / "run" / "dangling.parquet")
    monkeypatch.chdir(tmp_path)
    files, problems = discover(["run"])
    assert files == []
    assert [(p.path, p.problem) for p in problems] == [
        (str(tmp_path / "run" / "dangling.parquet"), "a link to nothing (dangling symlink)")
    ]


def test_a_local_footer_read_from_the_file_s_last_bytes_gives_what_pyarrow_s_reader_gives(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A local file's footer is read with one pread of its end and parsed from memory (`local_footer`):
    every file below (a good run, Arrow types a writer stored, a footer longer than one read, bad files of
    every kind) gives the shard, or the problem, that pyarrow's reader of the file gives, and its schema."""
    import tokaudit._reader as reader
    import tokaudit._footers as footers

    folder = tmp_path / "logs"
    good_run(folder / "good")
    bad_files(folder / "bad")
    rows = [dict(r, run_id="run") for r in records(UNEVEN, token_mean)]
    table = pa.Table.from_pylist(rows)
    typed = table.set_column(
        table.schema.get_field_index("run_id"), "run_id", table["run_id"].dictionary_encode()
    ).append_column(
        pa.field("time", pa.timestamp("us", tz="Asia/Tokyo")),
        pa.array([0] * len(rows), pa.timestamp("us", tz="Asia/Tokyo")),
    )
    pq.write_table(typed, folder / "typed.parquet")
    long = folder / "long-footer.parquet"
    pq.write_table(table.replace_schema_metadata({"note": "x" * 3 * footers.TAIL_BYTES}), long)
    assert pq.read_metadata(long).serialized_size > footers.TAIL_BYTES
    whole = (folder / "typed.parquet").read_bytes()
    (folder / "bad" / "empty.parquet").write_bytes(b"")
    (folder / "bad" / "magic-only.parquet").write_bytes(b"PAR1")
    (folder / "bad" / "footer-too-long.parquet").write_bytes(whole[:-8] + (len(whole)).to_bytes(4, "little") + b"PAR1")
    (folder / "bad" / "footer-garbled.parquet").write_bytes(whole[:-400] + b"\xff" * 392 + whole[-8:])
    (folder / "headless.parquet").write_bytes(b"\0" * 4 + whole[4:])  # what pyarrow's reader never looks at
    many = records(UNEVEN * 3000, token_mean)
    many[5000]["step"] = None  # found by reading the column, from the file: more than the footer's read
    write(folder / "bad" / "null-far.parquet", many)
    assert (folder / "bad" / "null-far.parquet").stat().st_size > 2 * footers.TAIL_BYTES
    files = sorted(folder.rglob("*.parquet"))

    def inspected() -> list[Any]:
        out: list[Any] = []
        for path in files:
            try:
                out.append(inspect_shard(path))
            except reader.LogFormatError as error:
                out.append((error.path, error.problem))
        return out

    fast = inspected()
    for path in [p for p in files if "bad" not in p.parts]:
        footer = footers.local_footer(str(path))
        assert footer is not None, path
        assert footer.metadata.equals(pq.read_metadata(path))
        assert footer.schema_arrow.equals(pq.read_schema(path), check_metadata=True)
    assert sum(isinstance(item, tuple) for item in fast) == len(list((folder / "bad").iterdir()))
    monkeypatch.setattr(reader, "local_footer", lambda path: None)
    assert inspected() == fast
