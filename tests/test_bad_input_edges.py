"""Bad input at the edges: names that are not UTF-8, footer notes no recorder writes, a W of two billion over
one shard per rank, values at the ends of the float range, a memory limit of more than the memory. Each is one
line or none, never an internal error, and the good run beside it is still audited."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import warnings
from typing import Any
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tests.logs import UNEVEN, local_mean, records, token_mean, write, write_by_rank
from tokaudit.cli import main


def check(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["check", *args], env=env)
    for text in (result.stdout, result.stderr):
        assert "Traceback" not in text and "internal error" not in text, text
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_by_rank(tmp_path / "logs" / "good", records(UNEVEN, token_mean))


def renamed_to(path: Path, name: bytes) -> None:
    """`path` renamed to these bytes, which are no UTF-8 (pyarrow writes no such name)."""
    os.rename(os.fsencode(path), os.path.join(os.fsencode(path.parent), name))


def test_a_folder_whose_name_is_not_utf8_is_one_line_and_the_good_run_is_audited(good: Path) -> None:
    renamed_to(write_by_rank(good.parent / "bad", records(UNEVEN, local_mean)), b"run\xff\xfe")
    code, out, err = check(str(good.parent), "--format", "json")
    (line,) = err.splitlines()
    assert code == 2
    assert (
        line
        == f"tokaudit: error: {good.parent}/run\\xff\\xfe: the name is not UTF-8 (its other bytes shown as \\xNN): rename it"
    )
    report = json.loads(out)
    assert [(r["run"], r["verdict"]) for r in report["runs"]] == [("good", "correct")]


def test_a_folder_whose_name_is_not_utf8_and_holds_no_parquet_file_is_passed_over(good: Path) -> None:
    """A tracker's folder beside the shards reads nothing: no line, the audit as without it."""
    (good / "tensorboard").mkdir()
    (good / "tensorboard" / "events.out").write_bytes(b"")
    renamed_to(good / "tensorboard", b"tensorboard\xe9")
    code, out, err = check(str(good), "--format", "json")
    assert code == 0 and err == "" and json.loads(out)["runs"][0]["verdict"] == "correct"


def test_a_folder_whose_name_is_not_utf8_and_holds_a_link_to_a_run_is_one_line(good: Path) -> None:
    """The walk follows links to folders: a run reached through one is said, never passed over in silence."""
    elsewhere = write_by_rank(good.parent.parent / "elsewhere", records(UNEVEN, local_mean))
    (good.parent / "exp").mkdir()
    os.symlink(elsewhere, good.parent / "exp" / "bad")
    renamed_to(good.parent / "exp", b"exp-\xff")
    code, _, err = check(str(good.parent))
    (line,) = err.splitlines()
    assert code == 2 and line.endswith("exp-\\xff: the name is not UTF-8 (its other bytes shown as \\xNN): rename it")


def test_a_tree_below_a_folder_whose_name_is_not_utf8_is_one_line_naming_that_folder(good: Path) -> None:
    """Hive's rank=N folders below it, a Delta table inside it: the one folder at fault is named, once."""
    for rank in (0, 1):
        write_by_rank(good.parent / "hive" / f"rank={rank}", records(UNEVEN, token_mean))
    (good.parent / "hive" / "rank=1" / "_delta_log").mkdir()
    renamed_to(good.parent / "hive", b"hive\xff")
    code, out, err = check(str(good.parent), "--format", "json")
    (line,) = err.splitlines()
    assert code == 2 and line.endswith("/hive\\xff: the name is not UTF-8 (its other bytes shown as \\xNN): rename it")
    assert [r["run"] for r in json.loads(out)["runs"]] == ["good"]


def test_a_link_not_utf8_back_to_a_folder_already_read_is_passed_over(good: Path) -> None:
    os.symlink(".", os.path.join(os.fsencode(good), b"r\xe9sultats"))
    code, out, err = check(str(good), "--format", "json")
    assert code == 0 and err == "" and json.loads(out)["runs"][0]["verdict"] == "correct"


def test_a_missing_path_whose_name_is_not_utf8_is_said_missing(good: Path) -> None:
    code, _, err = check(os.fsdecode(os.fsencode(good.parent) + b"/gone\xff"))
    assert code == 2 and err.strip().endswith("gone\\xff: no such file or directory")


@pytest.mark.parametrize("fmt", ["json", "junit", "html", "markdown", "github", "table"])
def test_a_file_whose_name_is_not_utf8_leaves_every_report_readable(good: Path, fmt: str) -> None:
    (good / "r.parquet").write_bytes(b"not parquet")
    renamed_to(good / "r.parquet", b"r\xff\xfe.parquet")
    output = good.parent.parent / f"report.{fmt}"
    code, _, err = check(str(good), "--format", fmt, "--output", str(output))
    assert code == 2 and "r\\xff\\xfe.parquet: the name is not UTF-8" in err
    text = output.read_bytes().decode("utf-8")  # strict: no byte of the name comes through raw
    if fmt == "json":
        report = json.loads(text)  # the run is not called correct with a file of it unread, which its finding names
        assert report["runs"][0]["verdict"] == "inconclusive"
        assert report["findings"][0]["evidence"]["files"] == [f"{good}/r\\xff\\xfe.parquet"]
    elif fmt == "junit":
        ElementTree.fromstring(text)


@pytest.mark.parametrize(
    "key, note",
    [
        (b"tokaudit.provenance", b'{"launch": {"first_shard": 9223372036854775808}}'),  # 2^63: no int64
        (b"tokaudit.provenance", b"[" * 100_000 + b"]" * 100_000),  # nested past Python's recursion limit
    ],
)
def test_a_provenance_note_no_recorder_writes_is_read_as_none(good: Path, key: bytes, note: bytes) -> None:
    """The provenance is what the recorder adds of its set-up; one that cannot be read says nothing, and the records
    are audited."""
    write_by_rank(good.parent / "bad", records(UNEVEN, local_mean), metadata={key: note})
    code, out, _ = check(str(good.parent), "--format", "json")
    runs = {r["run"]: r["verdict"] for r in json.loads(out)["runs"]}
    assert code == 1 and runs == {"good": "correct", "bad": "incorrect"}


def test_a_world_size_of_two_billion_over_one_shard_per_rank_takes_no_memory_of_its_size(tmp_path: Path) -> None:
    """Where each rank has its own shards the footers are asked whether every rank below W has one: answered
    without a set of W ranks. Run under a 4 GiB address space, so a regression fails here instead of taking the
    machine's memory."""
    logs = write_by_rank(tmp_path / "run", records(UNEVEN, token_mean, world_size=2**31 - 1))

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    done = subprocess.run(
        [sys.executable, "-m", "tokaudit", "check", str(logs), "--format", "json"],
        capture_output=True,
        text=True,
        preexec_fn=limited,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr  # (the files of the ranks above 1 are not given, or W is wrong)
    assert [f["code"] for f in json.loads(done.stdout)["findings"]] == ["ranks_not_recorded"]


@pytest.mark.parametrize(
    "columns",
    [
        {"reported_loss": float("inf")},
        {"reported_loss": float("-inf")},
        {"reported_loss": 1e308},
        {"grad_scale": 1e308},
    ],
)
def test_values_at_the_ends_of_the_float_range_leave_no_numpy_warning_on_stderr(
    tmp_path: Path, columns: dict[str, float]
) -> None:
    logs = write_by_rank(tmp_path / "run", records(UNEVEN, token_mean, **columns))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # (pytest keeps warnings off stderr: one raised is seen)
        code, out, err = check(str(logs), "--format", "json")
    assert code in (0, 1) and err == "", err
    assert json.loads(out)["runs"][0]["run"] == "run"


@pytest.mark.parametrize("value", ["101%", "0%", "0MB", "99999999999TB", "18446744073709551616B", "1PiB"])
def test_a_memory_limit_of_no_memory_or_more_than_all_of_it_names_the_variable(good: Path, value: str) -> None:
    """One line naming the variable and the units DuckDB reads (a pebibyte is none of them, though below the bound)."""
    code, _, err = check(str(good), env={"TOKAUDIT_MEMORY_LIMIT": value})
    (line,) = err.splitlines()
    assert code == 2 and "TOKAUDIT_MEMORY_LIMIT" in line and str(good) not in line
    assert "in B, KB, KiB, MB, MiB, GB, GiB, TB, TiB," in line


@pytest.mark.parametrize("rtol", ["0.5", "0.6", "0.99"])
def test_a_tolerance_of_half_or_more_is_refused_as_usage(good: Path, rtol: str) -> None:
    """Two weights within 2·rtol of each other are one: from 0.5 every weight is one with every other."""
    code, _, err = check(str(good), "--rtol", rtol)
    (line,) = err.splitlines()
    assert code == 2 and line.startswith("tokaudit: error: --rtol must be above 0 and below 0.5")


@pytest.mark.parametrize("rtol", [None, "0.1", [0.1]])
def test_a_tolerance_that_is_no_number_is_a_usage_error_in_python(good: Path, rtol: object) -> None:
    from tokaudit import audit
    from tokaudit.errors import UsageError

    with pytest.raises(UsageError, match="--rtol must be above 0 and below 0.5"):
        audit(good, rtol=rtol)  # type: ignore[arg-type]


@pytest.mark.parametrize("bits", [1, 2])
def test_a_run_computed_in_two_bits_or_fewer_is_judged_without_an_error(tmp_path: Path, bits: int) -> None:
    """precision_bits of 1 or 2 (fp4's e2m1 holds 2) is judged at 2^(1−p) ≥ 0.5: every weight rounds to every other,
    so no verdict says more than the records can."""
    logs = write_by_rank(tmp_path / "run", records(UNEVEN, token_mean, precision_bits=bits))
    code, out, _ = check(str(logs), "--format", "json")
    assert code == 0 and json.loads(out)["runs"][0]["verdict"] in ("correct", "inconclusive")


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, 50_000, 2**63])
def test_a_thread_count_that_is_none_is_a_usage_error_not_a_damaged_file(good: Path, threads: object) -> None:
    from tokaudit import audit
    from tokaudit.errors import UsageError

    with pytest.raises(UsageError, match="threads must be a whole number from 1 to 1024") as raised:
        audit(good, threads=threads)  # type: ignore[arg-type]
    assert str(good) not in str(raised.value)


def test_a_tolerance_finer_than_float32_rounds_judges_a_run_that_does_not_say_its_precision_at_float32s(
    good: Path,
) -> None:
    """A log without precision_bits is float32's (the format's rule): --rtol 1e-300 no finer than 2⁻²³."""
    code, out, _ = check(str(good), "--rtol", "1e-300", "--format", "json")
    (run,) = json.loads(out)["runs"]
    assert code == 0 and run["verdict"] == "correct" and run["rtol"] == 2.0**-23


_NOTE = {"run": "bad", "group": "0", "rank": 0, "steps": [[1, 2, 5]]}


@pytest.mark.parametrize(
    "note",
    [
        json.dumps(_NOTE)[:-5],  # cut short
        json.dumps({**_NOTE, "rank": "0"}),
        json.dumps({**_NOTE, "run": 7}),
        json.dumps({**_NOTE, "steps": [[2, 1, 3]]}),  # reversed
        json.dumps({**_NOTE, "steps": [[0, 1, -5]]}),  # a negative count of records
        json.dumps({**_NOTE, "steps": [[-(2**63), 2**63 - 1, 1]]}),  # a span of every int64
        json.dumps({**_NOTE, "steps": [[0, 1e400, 1]]}),
        json.dumps({**_NOTE, "steps": []}),  # (an internal error: no span to say)
        "[" * 100_000 + "]" * 100_000,  # nested past Python's recursion limit
    ],
)
def test_a_dropped_steps_note_no_recorder_writes_names_its_file_and_leaves_no_run_correct(
    good: Path, note: str
) -> None:
    """The note says the recorder lost records of the run; one that cannot be read cannot say which, so its run is no
    more judged correct than one whose note says: its file is one line, exit 2, and the run beside it is audited."""
    bad = good.parent / "bad"
    write_by_rank(bad, records(UNEVEN, token_mean), metadata={b"tokaudit.dropped_steps": note.encode()})
    code, out, err = check(str(good.parent), "--format", "json")
    runs = {r["run"]: r["verdict"] for r in json.loads(out)["runs"]}
    lines = err.strip().splitlines()
    assert code == 2 and runs["good"] == "correct" and runs.get("bad") != "correct"
    assert lines and all("tokaudit.dropped_steps" in line and f"{bad}{os.sep}rank-" in line for line in lines), err


def test_sync_writes_a_spooled_shard_whose_names_are_not_utf8_and_says_their_bytes(tmp_path: Path) -> None:
    """A spool file and a destination folder named in bytes no UTF-8 (a recorder's log_dir may be): written there,
    and the line shows those bytes as \\xNN."""
    shard = write_by_rank(tmp_path / "make", records(UNEVEN, token_mean)) / "rank-00000-000000.parquet"
    destination = os.path.join(os.fsencode(tmp_path), b"dest\xff")
    table = pq.read_table(shard).replace_schema_metadata({b"tokaudit.destination": destination})
    pq.write_table(table, tmp_path / "spooled.parquet")
    (tmp_path / "spool").mkdir()
    os.rename(
        os.fsencode(tmp_path / "spooled.parquet"), os.path.join(os.fsencode(tmp_path / "spool"), b"r\xfe.parquet")
    )
    result = CliRunner().invoke(main, ["sync", str(tmp_path / "spool")])
    assert result.exit_code == 0, result.output
    assert os.listdir(destination) == [b"r\xfe.parquet"]
    assert "dest\\xff/r\\xfe.parquet" in result.output and "\\udc" not in result.output


def test_sync_names_a_spooled_shard_no_store_takes_and_writes_the_others(tmp_path: Path) -> None:
    """A destination of a scheme no store serves (http://), or with a NUL byte: one line naming the spooled file, and
    the rest of the spool is still written."""
    shard = write_by_rank(tmp_path / "make", records(UNEVEN, token_mean)) / "rank-00000-000000.parquet"
    (tmp_path / "spool").mkdir()
    for name, destination in (
        ("a", b"http://127.0.0.1:9/x"),
        ("b", b"/tmp/with\x00nul"),
        ("c", os.fsencode(tmp_path / "out")),
    ):
        table = pq.read_table(shard).replace_schema_metadata({b"tokaudit.destination": destination})
        pq.write_table(table, tmp_path / "spool" / f"{name}.parquet")
    result = CliRunner().invoke(main, ["sync", str(tmp_path / "spool")])
    lines = [line for line in result.stderr.splitlines() if line.startswith("tokaudit: error:")]
    assert result.exit_code == 2 and len(lines) == 2 and "internal error" not in result.stderr
    assert all("cannot be written to" in line for line in lines), lines
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["c.parquet"]


def test_sync_never_removes_a_file_it_did_not_write_or_find_there_the_same(tmp_path: Path) -> None:
    """Synced once, a shard in its log folder still says where it was going: sync given that folder as the spool finds
    the file itself at its destination and leaves it. A destination holding another file of that name, or a folder
    of it, leaves the spooled file in the spool."""
    shard = write_by_rank(tmp_path / "make", records(UNEVEN, token_mean)) / "rank-00000-000000.parquet"
    (tmp_path / "spool").mkdir()
    table = pq.read_table(shard).replace_schema_metadata({b"tokaudit.destination": os.fsencode(tmp_path / "log")})
    pq.write_table(table, tmp_path / "spool" / "a.parquet")
    assert CliRunner().invoke(main, ["sync", str(tmp_path / "spool")]).exit_code == 0
    again = CliRunner().invoke(main, ["sync", str(tmp_path / "log")])
    assert again.exit_code == 2 and "is the file at its destination already" in again.stderr
    assert (tmp_path / "log" / "a.parquet").is_file()
    for name, taken in (("b", b"other bytes"), ("c", None)):
        pq.write_table(table, tmp_path / "spool" / f"{name}.parquet")
        if taken is None:
            (tmp_path / "log" / f"{name}.parquet").mkdir()
        else:
            (tmp_path / "log" / f"{name}.parquet").write_bytes(taken)
    kept = CliRunner().invoke(main, ["sync", str(tmp_path / "spool")])
    assert kept.exit_code == 2 and kept.stderr.count("holds another file of its name") == 2
    assert sorted(p.name for p in (tmp_path / "spool").iterdir()) == ["b.parquet", "c.parquet"]


def _damaged(folder: Path, rows: list[dict[str, object]], step: int) -> Path:
    """A W=2 log whose rank 1 writes a shard a step, the shard of `step` cut to 200 bytes (a copy cut short)."""
    write_by_rank(folder, rows, steps_per_file=1)
    with open(folder / f"rank-00001-{step:06d}.parquet", "r+b") as shard:
        shard.truncate(200)
    return folder


@pytest.mark.parametrize("step", [1, 2], ids=["a middle shard", "the last shard"])
def test_a_damaged_shard_never_makes_a_correct_run_incorrect_nor_leaves_it_correct(tmp_path: Path, step: int) -> None:
    """The damaged file is named on its line; the gap it leaves is not a training bug (`missing_rank` says the logs
    cannot tell) and the run is not called correct either: inconclusive, with the file named in the report. A
    run in another folder, and a local mean whose complete steps show it, are judged as before."""
    counts = [[[3, 1], [1, 1 + s]] for s in range(4)]
    damaged = _damaged(tmp_path / "logs" / "good", records(counts, token_mean), step)
    write_by_rank(tmp_path / "logs" / "other", records(counts, token_mean))
    _damaged(tmp_path / "logs" / "bad", records(counts, local_mean), step)
    code, out, err = check(str(tmp_path / "logs"), "--format", "json")
    lines = sorted(err.splitlines())
    assert code == 2 and len(lines) == 2
    assert lines[1].startswith(f"tokaudit: error: {damaged}/rank-00001-{step:06d}.parquet: ")
    report = json.loads(out)
    verdicts = {r["run"]: r["verdict"] for r in report["runs"]}
    assert verdicts == {"good": "inconclusive", "other": "correct", "bad": "incorrect"}
    unread = [f for f in report["findings"] if f["run"] == "good" and f["code"] == "unreadable_files"]
    assert unread[0]["evidence"] == {"files": [f"{damaged}/rank-00001-{step:06d}.parquet"], "count": 1}
    assert all(f["severity"] != "error" for f in report["findings"] if f["run"] == "good")


def test_the_markdown_headline_of_input_that_fails_is_no_green_check(tmp_path: Path, good: Path) -> None:
    """A PR comment's first line says what the exit code says: unreadable input fails the command."""
    (tmp_path / "empty").mkdir()
    (good / "cut.parquet").write_bytes(b"PAR1")
    for path in (tmp_path / "empty", good):
        code, out, _ = check(str(path), "--format", "markdown")
        headline = out.splitlines()[1]
        assert code == 2 and headline.startswith("❌ **tokaudit**") and headline.endswith("and the input fails")


def test_a_damaged_file_beside_a_file_of_several_runs_is_every_one_of_their_s(tmp_path: Path) -> None:
    """A compaction's file holds two runs (its run_id column) and a damaged file lies beside it: the footers do not
    say which runs, so the file's run_id is read: neither run is called correct, and a rank the one run lacks at a
    step is no error."""
    counts = [[[3, 1], [1, 1 + s]] for s in range(3)]
    first = records(counts, token_mean, run_id="first")
    second = [row for row in records(counts, token_mean, run_id="second") if (row["step"], row["rank"]) != (1, 1)]
    folder = tmp_path / "logs" / "compacted"
    write(folder / "part-0.parquet", first + second)
    (folder / "part-1.parquet").write_bytes(b"PAR1 cut short")
    code, out, _ = check(str(folder), "--format", "json")
    report = json.loads(out)
    assert code == 2 and {r["run"]: r["verdict"] for r in report["runs"]} == {
        "first": "inconclusive",
        "second": "inconclusive",
    }
    codes = {(f["run"], f["code"], f["severity"]) for f in report["findings"]}
    assert codes == {
        ("first", "unreadable_files", "warning"),
        ("second", "unreadable_files", "warning"),
        ("second", "missing_rank", "warning"),
    }


def test_a_damaged_file_in_a_run_id_partition_is_that_run_s_alone(tmp_path: Path) -> None:
    """Spark's partitionBy("run_id"): the `run_id=a/` folder names the one run a file in it can hold."""
    counts = [[[3, 1], [1, 1 + s]] for s in range(3)]
    dataset = tmp_path / "logs" / "dataset"
    for run in ("a", "b"):
        write(dataset / f"run_id={run}" / "part-0.parquet", records(counts, token_mean))
    (dataset / "run_id=a" / "part-1.parquet").write_bytes(b"PAR1 cut short")
    code, out, _ = check(str(dataset), "--format", "json")
    report = json.loads(out)
    assert code == 2 and {r["run"]: r["verdict"] for r in report["runs"]} == {"a": "inconclusive", "b": "correct"}


@pytest.mark.parametrize("paths", [[], (), iter([])])
def test_no_path_at_all_is_a_usage_error_not_an_empty_report(paths: list[str]) -> None:
    """An empty glob's list audited no file and read no problem: a gate on the verdicts and the problems passed it."""
    from tokaudit import audit
    from tokaudit.errors import UsageError

    with pytest.raises(UsageError, match="no path to audit"):
        audit(paths)


def test_an_empty_path_is_a_problem_not_the_current_folder(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "$RUNS" of an unset variable: Path("") is the current folder, whose logs (here a correct run) would pass a CI
    gate that audited none of the run meant."""
    from tokaudit import audit

    monkeypatch.chdir(good.parent)
    code, out, err = check("", "--fail-on", "inconclusive")
    assert (
        code == 2
        and out == ""
        and err.strip().endswith('"": an empty path (an unset variable?), which would read as the current folder')
    )
    report = audit("")
    assert report.verdicts == {} and report.problems == [
        '"": an empty path (an unset variable?), which would read as the current folder'
    ]
    code, _, err = check(str(good), "-o", "")
    assert code == 2 and "--output: an empty path" in err
    result = CliRunner().invoke(main, ["sync", ""])
    assert result.exit_code == 2 and "FOLDER: an empty path" in result.stderr


@pytest.mark.parametrize("read_fails", [True, False])
def test_a_file_replaced_while_it_is_read_is_named_alone_and_the_other_runs_are_audited(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_fails: bool
) -> None:
    """A compaction or an rsync replaces a file while DuckDB reads it: the read fails, or reads what it finds, and the
    file reads whole again after. It is named as changed (by its change time: rsync -a sets the modification time
    back), left out, and the runs beside it are audited (the audit ended in one line that named the range's first
    three files, the untouched ones among them, and reported no run; where the read went through, it judged records
    that are no longer in the file)."""
    import duckdb

    from tokaudit import audit
    from tokaudit._engine import Engine

    replaced = write(tmp_path / "logs" / "compacted" / "all.parquet", records(UNEVEN, token_mean))
    aggregate = Engine.step_parts
    raced: list[bool] = []

    def racing(engine: Engine, *args: Any, **kwargs: Any) -> Any:
        if not raced:  # the first aggregation: the file replaced as DuckDB reads it, as rsync -a does (by a copy
            raced.append(True)  # whose modification time is the source's, in the past)
            copy = replaced.with_suffix(".tmp")
            copy.write_bytes(replaced.read_bytes())
            os.utime(copy, ns=(0, 0))
            os.replace(copy, replaced)
            if read_fails:
                raise duckdb.IOException("Prefetch registered for bytes outside file")
        return aggregate(engine, *args, **kwargs)

    monkeypatch.setattr(Engine, "step_parts", racing)
    report = audit(tmp_path / "logs")
    said = "changed while the audit read it (rewritten or replaced): audit it again once it is written"
    assert report.problems == [f"{replaced}: {said}"] and report.verdicts == {"good": "correct"}


@pytest.mark.parametrize("column", ["filename", "file_row_number"])
def test_an_extra_column_named_as_the_scan_s_own_is_an_extra_column_like_any_other(tmp_path: Path, column: str) -> None:
    """A writer that notes each record's source file in a `filename` (or its row in a `file_row_number`) column: an
    extra column, ignored, whichever shard holds it (it made DuckDB's scan fail, and the run beside it unaudited).
    A repeated key inside such a file is still said and left out."""
    correct, broken = records(UNEVEN, token_mean), records(UNEVEN, local_mean)
    for name, rows in (("correct", correct), ("broken", broken)):
        for rank in (0, 1):
            mine = [dict(r) for r in rows if r["rank"] == rank]
            path = write(tmp_path / name / f"rank-{rank:05d}-000000.parquet", mine)
            if rank == 0:  # (the first shard of its scan)
                table = pq.read_table(path)
                pq.write_table(table.append_column(column, [["elsewhere.pt"] * table.num_rows]), path)
    code, out, err = check(str(tmp_path / "correct"), str(tmp_path / "broken"), "--format", "json")
    runs = {run["run"]: run["verdict"] for run in json.loads(out)["runs"]}
    assert code == 1 and err == "" and runs == {"correct": "correct", "broken": "incorrect"}

    twice = tmp_path / "twice" / "rank-00000-000000.parquet"
    write(twice, [r for r in correct if r["rank"] == 0] * 2)
    write(tmp_path / "twice" / "rank-00001-000000.parquet", [r for r in correct if r["rank"] == 1])
    table = pq.read_table(twice)
    pq.write_table(table.append_column(column, [["elsewhere.pt"] * table.num_rows]), twice)
    code, out, _ = check(str(tmp_path / "twice"), "--format", "json")
    report = json.loads(out)
    assert [f["code"] for f in report["findings"]] == ["duplicate_records"] and report["runs"][0][
        "verdict"
    ] != "incorrect"


def test_a_file_whose_statistics_do_not_hold_its_values_is_named_with_the_value(good: Path, tmp_path: Path) -> None:
    """A damaged page (or a writer's bug) holds valid_tokens = -5 where the footer's statistics say 123456789: the
    statistics pass, the aggregation counts the record no audit can use, and every row of that file is read: one line
    naming it and the value, exit 2, the run beside it audited (it was judged, as findings, exit 1)."""
    rows = records(UNEVEN, token_mean)
    run = tmp_path / "run"
    write(run / "rank-00000-000000.parquet", [r for r in rows if r["rank"] == 0])
    damaged = run / "rank-00001-000000.parquet"
    table = pq.read_table(write(damaged, [dict(r, valid_tokens=123456789) for r in rows if r["rank"] == 1]))
    pq.write_table(table, damaged, compression="none", use_dictionary=False)
    data = damaged.read_bytes()
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    mark, value = (123456789).to_bytes(8, "little"), (-5).to_bytes(8, "little", signed=True)
    damaged.write_bytes(data[:footer].replace(mark, value) + data[footer:])
    assert pq.read_table(damaged).column("valid_tokens").to_pylist() == [-5, -5, -5]
    column = table.schema.get_field_index("valid_tokens")
    assert pq.ParquetFile(damaged).metadata.row_group(0).column(column).statistics.min == 123456789
    code, out, err = check(str(run), str(good), "--format", "json")
    assert code == 2 and err.splitlines() == [
        f"tokaudit: error: {damaged}: column 'valid_tokens' has a negative count (-5) at row 0"
    ]
    assert {r["run"]: r["verdict"] for r in json.loads(out)["runs"]} == {"run": "inconclusive", "good": "correct"}


def test_a_file_removed_between_the_listing_and_its_reading_is_said_gone_not_a_dangling_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder listed, then a file of it removed (a cleanup, an rsync --delete) before the audit looks at it: one
    line that says it is gone, not that a regular file was a link to nothing."""
    import tokaudit._discovery

    rows = records(UNEVEN, token_mean)
    run = tmp_path / "run"
    paths = [write(run / f"rank-{rank:05d}-000000.parquet", [r for r in rows if r["rank"] == rank]) for rank in (0, 1)]

    def removed_after_listing(here: str, names: set[str]) -> dict[str, Any]:
        paths[1].unlink()
        return {}  # (as the listing's inodes would have it, had the removal come between the two)

    monkeypatch.setattr(tokaudit._discovery, "_regular_inodes", removed_after_listing)
    code, _, err = check(str(run))
    assert code == 2 and err.splitlines() == [
        f"tokaudit: error: {paths[1]}: gone: removed or renamed since the audit listed it"
    ]
