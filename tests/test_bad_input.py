"""Malformed inputs and CLI calls: each exits 2 with one line naming the file or option, never a
traceback, the input bytes unchanged, and the good files still audited."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tests.logs import UNEVEN, local_mean, records, token_mean, write, write_by_rank
from tokaudit.cli import main

ROOT = Path(__file__).resolve().parents[1]


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tokaudit: error:")]


def no_traceback(*texts: str) -> None:
    for text in texts:
        assert "Traceback" not in text and 'File "' not in text, text


# Each case: file name → (how to make it in a folder, words its one error line must contain)
def _uint64(folder: Path) -> None:
    rows = records(UNEVEN, token_mean)
    table = pa.Table.from_pylist(rows).set_column(
        0, "step", pa.array([r["step"] for r in rows[:-1]] + [1 << 63], pa.uint64())
    )
    pq.write_table(table, folder / "uint64.parquet")


def _duplicate_step(folder: Path) -> None:
    table = pa.Table.from_pylist(records(UNEVEN, token_mean))
    pq.write_table(table.append_column("step", table["step"]), folder / "twice.parquet")


def _fifo(folder: Path) -> None:
    os.mkfifo(folder / "fifo.parquet")


def _dangling(folder: Path) -> None:
    os.symlink(folder / "nowhere.parquet", folder / "dangling.parquet")


def _loop(folder: Path) -> None:
    os.symlink(folder / "loop.parquet", folder / "loop.parquet")


def _directory(folder: Path) -> None:
    (folder / "adir.parquet").mkdir()


def _empty(folder: Path) -> None:
    (folder / "empty.parquet").write_bytes(b"")


def _random(folder: Path) -> None:
    (folder / "random.parquet").write_bytes(os.urandom(4096))


def _huge_world(folder: Path) -> None:
    rows = records(UNEVEN, token_mean, world_size=2**31 - 1)
    write(folder / "huge_world.parquet", rows)


def _beyond_int32(column: str, value: int, one_row: bool = False) -> Any:
    """A file whose `column` holds `value` at its last record, stored as int64 (the step table holds it in 32
    bits); `one_row`: a file of that record alone, read from its footer's statistics."""

    def make(folder: Path) -> None:
        rows = records(UNEVEN, token_mean, **({"positions": 8} if column == "positions" else {}))
        rows[-1][column] = value
        pq.write_table(
            pa.Table.from_pylist(rows[-1:] if one_row else rows),
            folder / f"{column}{'_one' if one_row else ''}.parquet",
        )

    return make


def _one_row(name: str, **values: Any) -> Any:
    """A file of one record with `values`: its footer's statistics are its values (`Shard.record`), which settle
    every check but NaN, so only a value shown out of bounds is read, for the row its line names."""

    def make(folder: Path) -> None:
        row = dict(records(UNEVEN, token_mean, positions=8)[-1], **values)
        pq.write_table(pa.Table.from_pylist([row]), folder / name)

    return make


def _narrow_table() -> pa.Table:
    """A good run's records with T = n + 1; narrow types (a half float, a 16-bit count) go in beside it."""
    return pa.Table.from_pylist([dict(r, positions=r["valid_tokens"] + 1) for r in records(UNEVEN, token_mean)])


def _half_masked(folder: Path) -> None:
    half = pa.array([0.0, 0.0, 0.0, -0.25, 0.0, 0.0], pa.float16())  # a half float has no kernels of its own
    pq.write_table(_narrow_table().append_column("masked_weight_abs_sum", half), folder / "half_masked.parquet")


def _short_positions(folder: Path) -> None:
    table = _narrow_table()
    below = pa.array([n + (-1 if i == 2 else 1) for i, n in enumerate(table["valid_tokens"].to_pylist())], pa.int16())
    pq.write_table(
        table.set_column(table.schema.get_field_index("positions"), "positions", below),
        folder / "short_positions.parquet",
    )


def _renamed(name: str, old: str, new: str) -> Any:
    """A good run's file with one column renamed (an export that upper-cased its names)."""

    def make(folder: Path) -> None:
        table = pa.Table.from_pylist(records(UNEVEN, token_mean, grad_divisor=2.0))
        pq.write_table(table.rename_columns([new if c == old else c for c in table.column_names]), folder / name)

    return make


def _decimal(folder: Path) -> None:
    table = pa.Table.from_pylist(records(UNEVEN, token_mean))
    exact = table["loss_sum"].cast(pa.decimal128(12, 6))
    pq.write_table(
        table.set_column(table.column_names.index("loss_sum"), "loss_sum", exact), folder / "decimal.parquet"
    )


CASES: dict[str, tuple[Any, str]] = {
    # read as absent, GRAD_DIVISOR would leave D at its default (W) where the file says 2: a wrong verdict
    "upper.parquet": (
        _renamed("upper.parquet", "grad_divisor", "GRAD_DIVISOR"),
        "column 'GRAD_DIVISOR' is the log's 'grad_divisor' in other letters: rename it",
    ),
    "step.parquet": (_renamed("step.parquet", "step", "Step"), "column 'Step' is the log's 'step' in other letters"),
    "decimal.parquet": (
        _decimal,
        "column 'loss_sum' has type decimal128(12, 6), expected a float or integer type (write it as a float: "
        "CAST(loss_sum AS DOUBLE))",
    ),
    "uint64.parquet": (_uint64, "column 'step' holds a value beyond the int64 range"),
    "twice.parquet": (_duplicate_step, "column 'step' appears more than once"),
    "fifo.parquet": (_fifo, "not a regular file"),
    "dangling.parquet": (_dangling, "dangling symlink"),
    "loop.parquet": (_loop, "loops back on itself"),
    "adir.parquet": (_directory, "a folder named *.parquet with no Parquet part files in it"),
    "empty.parquet": (_empty, "not a readable Parquet file"),
    "random.parquet": (_random, "not a readable Parquet file"),
    # Once one file's aggregation failed on these ("cannot be aggregated", naming the first files of the log,
    # and hiding every good file): each is now its own line.
    "world_size.parquet": (
        _beyond_int32("world_size", 1 << 40),
        "column 'world_size' holds a value beyond int32, its type in the log format (1099511627776) at row 5",
    ),
    "micro.parquet": (_beyond_int32("micro", 1 << 31), "column 'micro' holds a value beyond int32"),
    "valid_tokens.parquet": (
        _beyond_int32("valid_tokens", 1 << 31),
        "column 'valid_tokens' holds more tokens than a microbatch can hold (above 2³¹ − 1)",
    ),
    "valid_tokens_one.parquet": (
        _beyond_int32("valid_tokens", 1 << 62, one_row=True),
        "column 'valid_tokens' holds more tokens than a microbatch can hold",
    ),
    "positions.parquet": (_beyond_int32("positions", 1 << 40), "column 'positions' holds more positions than"),
    "half_masked.parquet": (
        _half_masked,
        "column 'masked_weight_abs_sum' has a negative sum of absolute values (-0.25) at row 3",
    ),
    "divisor_one.parquet": (
        _one_row("divisor_one.parquet", grad_divisor=-2.0),
        "column 'grad_divisor' is not a finite positive number (-2.0) at row 0",
    ),
    "short_one.parquet": (
        _one_row("short_one.parquet", valid_tokens=5, positions=4),
        "column 'positions' is below 'valid_tokens' (4 < 5) at row 0",
    ),
    "negative_one.parquet": (
        _one_row("negative_one.parquet", valid_tokens=-3),
        "column 'valid_tokens' has a negative count",
    ),
    "scale_nan_one.parquet": (_one_row("scale_nan_one.parquet", grad_scale=float("nan")), "column 'grad_scale' is NaN"),
    # an infinite λ or D weighs every token 0: no weight a log can declare
    "lambda_inf_one.parquet": (
        _one_row("lambda_inf_one.parquet", term_weight=float("inf")),
        "column 'term_weight' is not a finite number ≥ 0 (inf) at row 0",
    ),
    "lambda_negative_one.parquet": (
        _one_row("lambda_negative_one.parquet", term_weight=-0.5),
        "column 'term_weight' is not a finite number ≥ 0 (-0.5) at row 0",
    ),
    # T < n where the file's T and n overlap: no footer shows it, the aggregation counts it and names the file
    "short_positions.parquet": (_short_positions, "column 'positions' is below 'valid_tokens' ("),
}


def test_each_bad_file_is_one_line_and_never_hides_the_good_run(tmp_path: Path) -> None:
    write_by_rank(tmp_path / "logs" / "good", records(UNEVEN, token_mean))
    bad = tmp_path / "logs" / "bad"
    bad.mkdir()
    for make, _ in CASES.values():
        make(bad)
    before = digest(tmp_path / "logs")
    code, out, err = invoke("check", str(tmp_path / "logs"), "--format", "json")
    no_traceback(out, err)
    assert code == 2
    lines = error_lines(err)
    assert len(lines) == len(CASES), lines
    for name, (_, words) in CASES.items():
        (line,) = [line for line in lines if f"{bad / name}:" in line]
        assert words in line, line
    report = json.loads(out)
    assert [r["run"] for r in report["runs"]] == ["good"] and report["runs"][0]["verdict"] == "correct"
    assert digest(tmp_path / "logs") == before, "input modified"


def test_a_world_size_of_two_billion_is_no_memory_error(tmp_path: Path) -> None:
    """Two ranks' records that say W = 2³¹ − 1: the files of every rank above 1 are missing (or W is wrong), so nothing
    is judged: ranks_not_recorded, its ranks counted, not listed."""
    _huge_world(tmp_path)
    code, out, err = invoke("check", str(tmp_path), "--format", "json")
    no_traceback(out, err)
    (finding,) = json.loads(out)["findings"]
    assert code == 0 and finding["code"] == "ranks_not_recorded"
    assert (
        finding["evidence"]["ranks_not_recorded_count"] == 2**31 - 3
        and len(finding["evidence"]["ranks_not_recorded"]) == 64
    )
    assert "rank(s) 2, 3, 4, 5, 6, 7, 8, 9, … (2147483645 in all)" in finding["message"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any folder")
def test_an_unreadable_folder_is_reported(tmp_path: Path) -> None:
    write_by_rank(tmp_path / "good", records(UNEVEN, token_mean))
    locked = tmp_path / "locked"
    write_by_rank(locked, records(UNEVEN, token_mean))
    locked.chmod(0)
    try:
        code, out, err = invoke("check", str(tmp_path))
    finally:
        locked.chmod(0o755)
    assert code == 2 and any(str(locked) in line and "cannot read" in line for line in error_lines(err))


def test_an_unreadable_partition_folder_keeps_its_run_from_being_called_correct(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A run laid out by step (`step=0/`, `step=1/`, `step=2/`, as pyarrow's write_to_dataset leaves it) whose
    `step=2/` cannot be listed: the run was called correct on the two steps read; the folder's line names it (in full,
    as files are named), exit 2, and the run is inconclusive by unreadable_files, as for an unreadable file there.
    (Listing it fails as mode 000 would for a user other than root.)"""
    run = tmp_path / "run"
    pq.write_to_dataset(pa.Table.from_pylist(records(UNEVEN, token_mean)), str(run), partition_cols=["step"])
    locked, scandir = run / "step=2", os.scandir

    def listing(path: Any = ".") -> Any:
        if Path(path).absolute() == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", listing)
    code, out, err = invoke("check", str(run), "--format", "json")
    assert code == 2 and error_lines(err) == [f"tokaudit: error: {locked}: cannot read this folder (Permission denied)"]
    report = json.loads(out)
    assert report["runs"][0]["verdict"] == "inconclusive"
    (unread,) = [f for f in report["findings"] if f["code"] == "unreadable_files"]
    assert unread["evidence"]["files"] == [str(locked)]


def test_the_path_given_is_the_path_read(tmp_path: Path) -> None:
    write_by_rank(tmp_path / "run[1]", records(UNEVEN, local_mean))  # glob characters in the name
    write_by_rank(tmp_path / "run1", records(UNEVEN, token_mean))
    code, out, _ = invoke("check", str(tmp_path / "run[1]"), "--format", "json")
    report = json.loads(out)
    assert code == 1 and [r["run"] for r in report["runs"]] == ["run[1]"]
    assert report["runs"][0]["verdict"] == "incorrect"


def test_output_paths_that_cannot_be_used(tmp_path: Path) -> None:
    logs = write_by_rank(tmp_path / "run", records(UNEVEN, token_mean))
    shard = logs / "rank-00000-000000.parquet"
    before = digest(tmp_path)
    for args, words in [
        (["check", str(logs), "-o", str(shard)], "is one of the logs being audited"),
        (["check", str(logs), "-o", str(tmp_path / "missing" / "report.txt")], "cannot write the report"),
        (["curve", str(logs), "--csv", str(tmp_path / "missing" / "curve.csv")], "cannot write the CSV"),
        (["curve", str(logs), "--plot", str(tmp_path / "curve.xyz")], "--plot writes"),
        (["curve", str(logs), "--plot", str(tmp_path / "missing" / "curve.png")], "cannot write the plot"),
    ]:
        code, out, err = invoke(*args)
        no_traceback(out, err)
        (line,) = error_lines(err)
        assert code == 2 and words in line, (args, line)
    assert digest(tmp_path) == before, "input modified"


@pytest.mark.parametrize(
    "variable, value",
    [
        ("TOKAUDIT_CHUNK_ROWS", "many"),
        ("TOKAUDIT_CHUNK_ROWS", "0"),
        ("TOKAUDIT_MEMORY_LIMIT", "lots"),
        ("TOKAUDIT_MEMORY_LIMIT", "1000000"),
    ],
)  # DuckDB wants a unit
def test_bad_environment_names_the_variable(tmp_path: Path, variable: str, value: str) -> None:
    logs = write_by_rank(tmp_path / "run", records(UNEVEN, token_mean))
    code, out, err = invoke("check", str(logs), env={variable: value})
    no_traceback(out, err)
    (line,) = error_lines(err)
    assert code == 2 and variable in line and str(logs) not in line


def test_a_memory_limit_too_small_for_the_log_is_said_as_such_not_blamed_on_the_files(tmp_path: Path) -> None:
    """DuckDB out of memory while every file decodes: one line naming the limit and what to change, exit 2,
    no file named as if it were damaged."""
    logs = write_by_rank(tmp_path / "run", records(UNEVEN, token_mean))
    code, out, err = invoke("check", str(logs), env={"TOKAUDIT_MEMORY_LIMIT": "1MB"})
    no_traceback(out, err)
    (line,) = error_lines(err)
    assert code == 2 and "TOKAUDIT_MEMORY_LIMIT" in line and "out of memory" in line and str(logs) not in line


def test_text_from_the_log_is_printed_literally(tmp_path: Path) -> None:
    rows = records(UNEVEN, local_mean, run_id="[/x]\x1b[31mred[bold]")
    logs = write_by_rank(tmp_path / "run", rows)
    for fmt in ("table", "markdown", "json"):
        code, out, err = invoke("check", str(logs), "--format", fmt)
        no_traceback(out, err)
        assert code == 1 and "\x1b" not in out, fmt
        if fmt == "json":
            assert json.loads(out)["runs"][0]["run"] == "[/x]\x1b[31mred[bold]"
        else:
            assert "[/x]\\x1b[31mred[bold]" in out, fmt


def test_an_internal_error_is_one_line_and_debug_shows_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs = write_by_rank(tmp_path / "run", records(UNEVEN, token_mean))

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr("tokaudit._auditing.audit_started", broken)
    code, out, err = invoke("check", str(logs))
    no_traceback(out, err)
    (line,) = error_lines(err)
    assert code == 2 and "something unforeseen" in line and "--debug" in line
    result = CliRunner().invoke(main, ["--debug", "check", str(logs)])
    assert isinstance(result.exception, RuntimeError)


def test_a_full_stdout_is_exit_2_without_a_traceback(tmp_path: Path) -> None:
    logs = write_by_rank(tmp_path / "run", records(UNEVEN, token_mean))
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "tokaudit.cli", "check", str(logs), "--format", "json"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
    no_traceback(done.stderr)
    assert done.returncode == 2 and len(error_lines(done.stderr)) == 1


@pytest.mark.parametrize("command", [["weights", "--step", "1"], ["curve"]])
def test_a_post_mortem_of_nothing_readable_names_the_input(tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "no-such-run"
    code, out, err = invoke(command[0], str(missing), *command[1:])
    no_traceback(out, err)
    assert code == 2
    assert error_lines(err) == [f"tokaudit: error: {missing}: no such file or directory"]


@pytest.mark.parametrize("change", ["removed", "unreadable"])
def test_a_log_that_changes_while_it_is_audited_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The evidence of a finding's step is read again after the whole log was aggregated: a shard removed
    or rewritten in between is one line naming the files, exit 2, never a traceback."""
    import duckdb

    import tokaudit._auditing as auditing
    import tokaudit._opening as opening

    write_by_rank(tmp_path / "run", records(UNEVEN, local_mean))
    real = auditing.extremes_at

    def changed(shards: Any, step: int, threads: Any = None) -> Any:
        if change == "unreadable":
            raise duckdb.IOException("IO Error: No files found that match the pattern")
        return real(shards, step, threads).iloc[0:0]

    monkeypatch.setattr(auditing, "extremes_at", changed)
    monkeypatch.setattr(opening, "EVIDENCE_ROWS", 0)  # as a log too large to aggregate every step's evidence
    result = CliRunner().invoke(main, ["check", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("tokaudit: error:")]
    assert len(lines) == 1 and "rank-" in lines[0], result.stderr
    assert ("could not be read again" if change == "unreadable" else "changed while it was audited") in lines[0]
    assert "Traceback" not in result.output


def test_a_thousand_nested_folders_and_a_spark_style_dataset_folder_are_read(tmp_path: Path) -> None:
    """A shard 1,000 folders down is found (no RecursionError), and a run folder holding a dataset folder named
    `x.parquet` with part files (as Spark writes them) is read as those parts, under the run folder's name."""
    deep = tmp_path / "logs"
    deep.mkdir()
    for index in range(1000):  # one level at a time: mkdir(parents=True) recurses
        deep = deep / f"d{index % 10}"
        deep.mkdir()
    (deep / "deep").mkdir()
    for rank in (0, 1):
        write(
            deep / "deep" / f"rank-{rank:05d}-000000.parquet",
            [r for r in records(UNEVEN, token_mean) if r["rank"] == rank],
        )
    dataset = tmp_path / "logs" / "sparky" / "records.parquet"
    dataset.mkdir(parents=True)
    rows = records(UNEVEN, local_mean)
    for rank in (0, 1):
        write(dataset / f"part-{rank:05d}-c000.snappy.parquet", [r for r in rows if r["rank"] == rank])
    (dataset / "_SUCCESS").write_text("")
    try:
        code, out, err = invoke("check", str(tmp_path / "logs"), "--format", "json")
    finally:  # removed bottom up, one folder at a time: shutil.rmtree (pytest's clean-up too) recurses
        for folder in [deep / "deep", deep, *(deep.parents[index] for index in range(999))]:
            for shard in folder.glob("*.parquet"):
                shard.unlink()
            folder.rmdir()
    no_traceback(out, err)
    report = json.loads(out)
    assert error_lines(err) == [] and code == 1, err
    assert {(r["run"], r["verdict"]) for r in report["runs"]} == {("deep", "correct"), ("sparky", "incorrect")}


def test_a_link_out_of_the_folder_given_is_read_and_said(tmp_path: Path) -> None:
    """A shard (or a folder) reached through a link whose target lies outside the folder given is audited, and a
    note on stderr says what is read from where; a link that stays inside says nothing. Files two folders of links
    lead to are read once."""
    elsewhere = write_by_rank(tmp_path / "elsewhere" / "run", records(UNEVEN, token_mean))
    (tmp_path / "logs" / "run").mkdir(parents=True)
    for shard in sorted(elsewhere.glob("*.parquet")):
        (tmp_path / "logs" / "run" / shard.name).symlink_to(shard)
    (tmp_path / "logs" / "folder").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    code, out, err = invoke("check", str(tmp_path / "logs"), "--format", "json")
    no_traceback(out, err)
    notes = [line for line in err.splitlines() if line.startswith("tokaudit: note:")]
    assert code == 0 and json.loads(out)["runs"][0]["verdict"] == "correct"
    assert len(notes) == 3 and all(f"read from {tmp_path / 'elsewhere'}" in note for note in notes), notes
    code, _, err = invoke("check", str(tmp_path))  # the targets are inside the folder given now
    assert "tokaudit: note:" not in err


@pytest.mark.parametrize("link", ["symbolic", "symbolic, the logs given by a link", "hard", "folder"])
def test_a_link_in_another_folder_never_takes_a_shard_from_its_run(tmp_path: Path, link: str) -> None:
    """A broken run's shard linked from a folder that sorts first (`dbg/x.parquet`, or `a_latest` linked to the run's
    folder): the file, read once, was read by the first name the walk met, so `dbg` became a run of its own and the
    broken run, a rank short, inconclusive (exit 0). A name reached through no link below the folder given is read,
    and a link says nothing; a hard link, a name of its own, is read in both folders, as a copy would be: the run
    stays incorrect."""
    run = write_by_rank(tmp_path / "logs" / "exp_b", records(UNEVEN, local_mean))
    shard = run / "rank-00000-000000.parquet"
    (tmp_path / "logs" / "dbg").mkdir()
    if link.startswith("symbolic"):
        (tmp_path / "logs" / "dbg" / "x.parquet").symlink_to(shard)
    elif link == "hard":
        os.link(shard, tmp_path / "logs" / "dbg" / "x.parquet")
    else:
        (tmp_path / "logs" / "a_latest").symlink_to(run, target_is_directory=True)
    given = tmp_path / "logs"
    if link.endswith("by a link"):  # no name below it a link but the one in dbg/, whatever the folder given is
        (tmp_path / "alias").symlink_to(tmp_path / "logs", target_is_directory=True)
        given = tmp_path / "alias"
    code, out, err = invoke("check", str(given), "--format", "json")
    verdicts = {r["run"]: r["verdict"] for r in json.loads(out)["runs"]}
    assert (
        code == 1
        and verdicts["exp_b"] == "incorrect"
        and set(verdicts) == ({"exp_b", "dbg"} if link == "hard" else {"exp_b"})
    )
    assert not [line for line in err.splitlines() if line.startswith("tokaudit: note:")], err


def test_an_iceberg_table_is_one_line_and_none_of_its_files_is_read(tmp_path: Path) -> None:
    """An Iceberg table keeps the files an overwrite replaced in data/ until its snapshots expire, and only its
    metadata/ says which it holds now: refused in one line, never read as loose files; a run beside it is audited."""
    table = tmp_path / "ice"
    write_by_rank(table / "data", records(UNEVEN, local_mean))
    (table / "metadata").mkdir()
    (table / "metadata" / "00001-5e1b.metadata.json").write_text("{}")
    write_by_rank(tmp_path / "plain", records(UNEVEN, token_mean))
    result = CliRunner().invoke(main, ["check", str(tmp_path), "--format", "json"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.splitlines() == [
        f"tokaudit: error: {table}: an Iceberg table (its metadata/ says which of the files under it the table holds "
        "now), which tokaudit does not read: export it as Parquet (spark.table(...).write.parquet(...))"
    ]
    assert [run["run"] for run in json.loads(result.stdout)["runs"]] == ["plain"]
    alone = CliRunner().invoke(main, ["check", str(table)])
    assert alone.exit_code == 2 and alone.stderr.count("tokaudit: error:") == 1, alone.stderr


def test_string_views_and_upper_case_file_names_are_read(tmp_path: Path) -> None:
    """Run ids stored as string_view (what Polars and pyarrow's newer writers may leave) in files named *.PARQUET:
    read as any log, each run's verdict its own."""
    for name, weights in (("good", token_mean), ("bad", local_mean)):
        for rank in (0, 1):
            table = pa.Table.from_pylist([dict(r, run_id=name) for r in records(UNEVEN, weights) if r["rank"] == rank])
            viewed = table["run_id"].cast(pa.string_view())
            table = table.set_column(table.column_names.index("run_id"), "run_id", viewed)
            (tmp_path / name).mkdir(exist_ok=True)
            pq.write_table(table, tmp_path / name / f"RANK-{rank}.PARQUET")
    code, out, err = invoke("check", str(tmp_path), "--format", "json")
    assert code == 1 and err == "", err
    assert {run["run"]: run["verdict"] for run in json.loads(out)["runs"]} == {"good": "correct", "bad": "incorrect"}


def test_a_log_of_files_without_a_row_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Files with the log's columns and no row (a recorder killed before its first flush wrote, a query's empty
    export): nothing to judge, said, exit 2; not an empty report and exit 0 that a CI gate would pass."""
    table = pa.Table.from_pylist(records(UNEVEN, token_mean))
    (tmp_path / "run").mkdir()
    pq.write_table(table.slice(0, 0), tmp_path / "run" / "rank-00000-000000.parquet")
    for args in (["check", str(tmp_path / "run")], ["check", str(tmp_path / "run"), "--format", "junit"]):
        code, out, err = invoke(*args)
        assert code == 2 and error_lines(err) == [
            f"tokaudit: error: {tmp_path / 'run'}: no records: 1 Parquet file(s) of the log's columns, and no row in any"
        ], err
    write_by_rank(tmp_path / "good", records(UNEVEN, token_mean))  # beside a run that has records: still said
    code, out, err = invoke("check", str(tmp_path), "--format", "json")
    assert code == 2 and len(error_lines(err)) == 1 and [r["run"] for r in json.loads(out)["runs"]] == ["good"]


def test_an_empty_pandas_frame_beside_the_shards_is_no_record_and_no_problem(tmp_path: Path) -> None:
    """A logger that flushes its empty buffer at start: `pd.DataFrame(columns=...).to_parquet()` writes the log's
    columns with no row, each of Arrow type null. Beside a correct run's shards it holds nothing to check (its
    values were read, and an Arrow kernel error made the run inconclusive and exit 2)."""
    import pandas as pd

    write_by_rank(tmp_path / "run", records(UNEVEN, token_mean))
    pd.DataFrame(columns=list(records(UNEVEN, token_mean)[0])).to_parquet(tmp_path / "run" / "rank-0-000.parquet")
    code, out, err = invoke("check", str(tmp_path / "run"), "--format", "json")
    assert code == 0 and err == "", err
    assert [run["verdict"] for run in json.loads(out)["runs"]] == ["correct"]


def test_a_nan_loss_that_pandas_wrote_as_a_null_says_so(tmp_path: Path) -> None:
    """pandas writes a float column's NaN as a null: the log no longer holds the NaN (a non-finite loss, a finding of
    its own) but a null, which a required column refuses. The one line says what pandas did."""
    import pandas as pd

    (tmp_path / "run").mkdir()
    # a loss sum's NaN, and a backward scalar's (a mean over no token: zero_token_nonfinite), meet the same fate
    for row, values, said in (
        (3, {"loss_sum": math.nan}, "column 'loss_sum' has a null value at row 3"),
        (
            2,
            {"valid_tokens": 0, "backward_scalar": math.nan},
            "column 'backward_scalar' is null where no probe weights were recorded at row 2",
        ),
    ):
        rows = records(UNEVEN, token_mean)
        rows[row].update(values)
        pd.DataFrame(rows).to_parquet(tmp_path / "run" / "log.parquet")
        code, _, err = invoke("check", str(tmp_path / "run"))
        assert code == 2 and error_lines(err) == [
            f"tokaudit: error: {tmp_path / 'run' / 'log.parquet'}: {said}: pandas writes a NaN as a null; write the "
            "NaN itself (pyarrow keeps it)"
        ], err
