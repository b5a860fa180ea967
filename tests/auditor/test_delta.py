"""Delta Lake tables (written by deltalake, as Spark on Databricks writes logs by default): the files the table's log
says it holds now are audited, not the files a rewrite, an OPTIMIZE or a failed write left beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from tests.logs import UNEVEN_GA, check_json, local_mean, records, token_mean, write_by_rank
from tokaudit.cli import main
from tokaudit._delta import live_files
from tokaudit.errors import LogFormatError

deltalake = pytest.importorskip("deltalake")


def _history(table: Path) -> None:
    """A table that held a rank-local mean, appended to, compacted and checkpointed, then overwritten by the token
    mean: every earlier file is still on disk."""
    wrong = pa.Table.from_pylist(records(UNEVEN_GA, local_mean))
    deltalake.write_deltalake(table, wrong, partition_by=["rank"])
    deltalake.write_deltalake(table, wrong, mode="append", partition_by=["rank"])
    deltalake.DeltaTable(table).optimize.compact()
    deltalake.DeltaTable(table).create_checkpoint()
    right = pa.Table.from_pylist(records(UNEVEN_GA, token_mean))
    deltalake.write_deltalake(table, right, mode="overwrite", partition_by=["rank"])


def test_a_delta_table_is_audited_at_its_current_version(tmp_path: Path) -> None:
    _history(tmp_path / "delta" / "run")
    write_by_rank(tmp_path / "plain" / "run", records(UNEVEN_GA, token_mean))
    code, report, notes = check_json(tmp_path / "delta")
    expected_code, expected, _ = check_json(tmp_path / "plain")
    files = len(list((tmp_path / "delta").rglob("*.parquet")))
    assert (code, report) == (expected_code, dict(expected, files=2)) and code == 0
    assert notes == [
        f"tokaudit: note: {tmp_path / 'delta' / 'run'}: a Delta table at version 3: {files - 3} Parquet file(s) it no "
        "longer holds (replaced by a later commit, or never committed) skipped"
    ]  # (the checkpoint, in the log, is not among them)
    assert check_json(tmp_path / "delta" / "run" / "rank=1")[1]["files"] == 1  # a folder given inside the table


def test_a_log_that_cannot_be_replayed_is_one_line_and_none_of_its_files_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit missing after the last checkpoint: which files the table holds now is unknown (a file an overwrite
    removed may be among them), so none is read, as for any log tokaudit cannot follow; the other runs are audited."""
    table = tmp_path / "run"
    deltalake.write_deltalake(table, pa.Table.from_pylist(records(UNEVEN_GA, token_mean)), partition_by=["rank"])
    (table / "_delta_log" / "00000000000000000000.json").rename(table / "_delta_log" / "00000000000000000001.json")
    write_by_rank(tmp_path / "good", records(UNEVEN_GA, token_mean))
    code, report, lines = check_json(tmp_path)
    assert code == 2 and [run["run"] for run in report["runs"]] == ["good"]
    assert f"tokaudit: error: {table}: a Delta table whose log cannot be replayed (a commit after its last " in lines[0]
    monkeypatch.chdir(tmp_path)  # given by a relative path: that one line, not also "no Parquet files" for the folder
    code, _, lines = check_json(Path("run"))
    assert code == 2 and len(lines) == 1 and "cannot be replayed" in lines[0], lines


def test_a_v2_checkpoint_named_by_a_uuid_is_where_the_replay_starts(tmp_path: Path) -> None:
    """A table overwritten with a rank-local mean, checkpointed, the checkpoint named as V2 checkpoints are
    (`v.checkpoint.<uuid>.parquet`) and the commits before it gone, as log retention leaves them: the table's current
    files alone are read (the removed token-mean file, still on disk, among none), every time."""
    table = tmp_path / "run"
    deltalake.write_deltalake(table, pa.Table.from_pylist(records(UNEVEN_GA, token_mean)))
    deltalake.write_deltalake(table, pa.Table.from_pylist(records(UNEVEN_GA, local_mean)), mode="overwrite")
    deltalake.DeltaTable(table).create_checkpoint()
    log = table / "_delta_log"
    (log / f"{1:020d}.checkpoint.parquet").rename(
        log / f"{1:020d}.checkpoint.80a083e8-7026-4e79-81be-64bd76c43a11.parquet"
    )
    (log / f"{0:020d}.json").unlink()
    code, report, notes = check_json(table)
    assert code == 1 and report["files"] == 1 and report["runs"][0]["verdict"] == "incorrect"
    assert notes == [
        f"tokaudit: note: {table}: a Delta table at version 1: 1 Parquet file(s) it no longer holds "
        "(replaced by a later commit, or never committed) skipped"
    ]


def test_a_v2_checkpoint_s_sidecars_hold_its_files() -> None:
    """A V2 checkpoint written as JSON whose add actions lie in a sidecar file (`_delta_log/_sidecars/`)."""
    uuid = "3a0d65cd-4056-49b8-937b-95f9e3ee90e5"
    names = [f"{4:020d}.checkpoint.{uuid}.json", f"{5:020d}.json"]
    lines = {
        names[0]: json.dumps({"sidecar": {"path": "016ae953-37a9-438e-8683-9a9a4a79a395.parquet"}}).encode(),
        names[1]: json.dumps({"remove": {"path": "a.parquet"}}).encode(),
    }
    sidecar = pa.table({"add": [{"path": "a.parquet"}, {"path": "b.parquet"}]})
    read = {"_sidecars/016ae953-37a9-438e-8683-9a9a4a79a395.parquet": sidecar}
    assert live_files("run", names, lines.__getitem__, read.__getitem__) == (5, {"b.parquet"})


def test_a_file_the_table_holds_that_is_not_there_is_one_line_and_the_rest_is_audited(tmp_path: Path) -> None:
    """A partial copy of a table that lost one of its files (each rank's step a commit of its own): the lost file
    is named (a missing rank would otherwise be blamed on the training), and the other files are audited."""
    table = tmp_path / "run"
    rows = records(UNEVEN_GA, token_mean)
    for step in range(3):
        for rank in range(2):
            mine = [r for r in rows if r["step"] == step and r["rank"] == rank]
            deltalake.write_deltalake(table, pa.Table.from_pylist(mine), mode="append")
    commit = (table / "_delta_log" / f"{3:020d}.json").read_text().splitlines()
    lost = next(json.loads(line)["add"]["path"] for line in commit if '"add"' in line)  # rank 1's step 1
    (table / lost).unlink()
    code, report, lines = check_json(tmp_path)
    assert code == 2 and report["files"] == 5
    assert lines[0] == (
        f"tokaudit: error: {table}/{lost}: a file the Delta table holds at version 5 (its log says so), not there: a "
        "partial copy of the table?"
    )


def test_partition_values_the_paths_do_not_hold_are_one_line(tmp_path: Path) -> None:
    """A table partitioned by run_id whose files lie outside run_id=… folders (randomized prefixes: the values are in
    the log alone): tokaudit, which takes them from folders, refuses the table rather than merge its runs."""
    table = tmp_path / "runs"
    rows = records(UNEVEN_GA, token_mean, run_id="good") + records(UNEVEN_GA, local_mean, run_id="bad")
    deltalake.write_deltalake(table, pa.Table.from_pylist(rows), partition_by=["run_id"])
    commit = table / "_delta_log" / f"{0:020d}.json"
    actions = [json.loads(line) for line in commit.read_text().splitlines()]
    for index, action in enumerate(a for a in actions if "add" in a):
        (table / "data").mkdir(exist_ok=True)
        (table / action["add"]["path"].replace("%3D", "=")).rename(table / "data" / f"part-{index}.parquet")
        action["add"]["path"] = f"data/part-{index}.parquet"
    commit.write_text("".join(json.dumps(action) + "\n" for action in actions))
    code, report, lines = check_json(tmp_path)
    assert code == 2 and report["runs"] == []
    assert lines[0].startswith(f"tokaudit: error: {table}: a Delta table whose files' paths do not hold the partition ")
    assert "(column 'run_id', files outside run_id=… folders)" in lines[0]


def test_deletion_vectors_column_mapping_and_a_damaged_log_are_one_line_each_and_the_other_runs_are_audited(
    tmp_path: Path,
) -> None:
    for name in ("vectors", "damaged", "mapped"):
        deltalake.write_deltalake(
            tmp_path / name, pa.Table.from_pylist(records(UNEVEN_GA, token_mean)), partition_by=["rank"]
        )
    commit = tmp_path / "vectors" / "_delta_log" / "00000000000000000001.json"
    vector = {"storageType": "u", "pathOrInlineDv": "ab^-aqEH.-t@S}K{vb[*k^", "offset": 4, "sizeInBytes": 40}
    added = {"path": "rank=0/x.parquet", "partitionValues": {"rank": "0"}, "deletionVector": vector}
    commit.write_text(json.dumps({"add": added}) + "\n")
    (tmp_path / "damaged" / "_delta_log" / "00000000000000000001.json").write_text('{"add": {"path": \n')
    mapping = {"metaData": {"id": "1", "configuration": {"delta.columnMapping.mode": "name"}}}
    (tmp_path / "mapped" / "_delta_log" / "00000000000000000001.json").write_text(json.dumps(mapping) + "\n")
    write_by_rank(tmp_path / "good", records(UNEVEN_GA, token_mean))
    result = CliRunner().invoke(main, ["check", str(tmp_path), "--format", "json"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("tokaudit: error:")]
    assert len(errors) == 3
    assert errors[0].startswith(f"tokaudit: error: {tmp_path / 'damaged'}: cannot read its Delta log (")
    assert errors[1] == (
        f"tokaudit: error: {tmp_path / 'mapped'}: a Delta table with column mapping (its files name their columns by "
        "id, not as the log format does), which tokaudit does not read: export it as Parquet "
        "(spark.read.format('delta').load(...).write.parquet(...))"
    )
    assert errors[2] == (
        f"tokaudit: error: {tmp_path / 'vectors'}: a Delta table with deletion vectors (rows deleted inside its files), "
        "which tokaudit does not read: rewrite it without them (delta.enableDeletionVectors = false, then OPTIMIZE) or "
        "export it as Parquet"
    )
    assert [run["run"] for run in json.loads(result.stdout)["runs"]] == ["good"]


@pytest.mark.parametrize(
    "line, said",
    [
        ('["add"]', "its Delta log holds a line that is no JSON object (each line is one action)"),
        ('{"add": ["x.parquet"]}', 'its Delta log holds an add action that names no file (no "path" string)'),
        ('{"add": {"path": 7}}', 'its Delta log holds an add action that names no file (no "path" string)'),
        ('{"remove": {"size": 1}}', 'its Delta log holds a remove action that names no file (no "path" string)'),
    ],
)
def test_a_commit_whose_actions_are_not_as_the_protocol_writes_them_says_what_is_wrong(line: str, said: str) -> None:
    """A commit written by hand or by a broken writer: the problem, in words, naming the table (it said Python's own
    exception, "'list' object has no attribute 'get'")."""
    lines = {"00000000000000000000.json": line.encode()}
    with pytest.raises(LogFormatError) as raised:
        live_files("logs/run", list(lines), lines.__getitem__, lambda name: None)
    assert raised.value.path == "logs/run" and raised.value.problem == said


def test_the_log_s_paths_are_unescaped_and_taken_relative_to_the_table() -> None:
    """Paths as a log writes them: URL-escaped, relative, or an absolute URI inside the table (a shallow clone's
    point outside it, and are not the table's files here)."""
    commits = [
        {"add": {"path": "term=aux%20head/part-0.parquet"}},
        {"add": {"path": "s3://bucket/logs/run/rank=1/part-1.parquet"}},
        {"add": {"path": "s3://other/clone/part-2.parquet"}},
        {"remove": {"path": "term=aux%20head/part-0.parquet"}},
        {"add": {"path": "part-3.parquet"}},
    ]
    lines = {f"{i:020d}.json": json.dumps(action).encode() for i, action in enumerate(commits)}
    version, live = live_files("bucket/logs/run", list(lines), lines.__getitem__, lambda name: None) or (0, set())
    assert version == 4
    assert live == {"rank=1/part-1.parquet", "s3://other/clone/part-2.parquet", "part-3.parquet"}


def test_a_checkpoint_is_replayed_with_the_commits_after_it_only() -> None:
    """Commits up to a checkpoint are in it (kept in the log or not); a checkpoint of several parts counts only
    whole, and then the latest whole one."""
    checkpoint = pa.table({"add": [{"path": "a.parquet"}, {"path": "b.parquet"}, None]})
    names = [f"{v:020d}.json" for v in range(4)] + [f"{2:020d}.checkpoint.parquet"]
    names += [f"{3:020d}.checkpoint.{1:010d}.{2:010d}.parquet"]  # one of two parts: not whole
    later = {f"{3:020d}.json": json.dumps({"remove": {"path": "a.parquet"}}).encode()}
    found = live_files("run", names, later.__getitem__, lambda name: checkpoint)
    assert found == (3, {"b.parquet"})
    assert live_files("run", names[:2] + names[3:4], later.__getitem__, lambda name: checkpoint) is None  # 2 missing
