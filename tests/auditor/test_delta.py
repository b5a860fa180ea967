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


def test_a_log_that_cannot_be_replayed_leaves_every_file_read_and_says_so(tmp_path: Path) -> None:
    table = tmp_path / "run"
    deltalake.write_deltalake(table, pa.Table.from_pylist(records(UNEVEN_GA, token_mean)), partition_by=["rank"])
    (table / "_delta_log" / "00000000000000000000.json").rename(table / "_delta_log" / "00000000000000000001.json")
    code, report, notes = check_json(tmp_path)
    assert code == 0 and report["files"] == 2
    assert notes == [
        f"tokaudit: note: {table}: a Delta table whose log cannot be replayed (a commit is missing): every Parquet "
        "file under it read"
    ]


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
