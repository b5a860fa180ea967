"""The bench's synthetic logs (bench/synthetic.py) are logs the audit reads whole and judges as built: `make bench`
times real audits, so its writer must keep up with the log format."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.logs import bench_synthetic, check_json

synthetic = bench_synthetic()
write_log, write_small_shards = synthetic.write_log, synthetic.write_small_shards


@pytest.mark.parametrize("recorder_columns", [False, True], ids=["plain", "every-recorder-column"])
def test_a_bench_log_is_correct_and_its_planted_local_means_are_found(tmp_path: Path, recorder_columns: bool) -> None:
    write_log(
        tmp_path / "correct",
        ranks=4,
        steps=12,
        micro=2,
        steps_per_file=5,
        ranks_per_file=2,
        recorder_columns=recorder_columns,
    )
    write_log(
        tmp_path / "planted",
        ranks=4,
        steps=12,
        micro=2,
        steps_per_file=5,
        ranks_per_file=2,
        recorder_columns=recorder_columns,
        local_mean_every=2,
    )
    code, correct, _ = check_json(tmp_path / "correct")
    assert code == 0 and [run["verdict"] for run in correct["runs"]] == ["correct"], correct  # type: ignore[index]
    code, planted, _ = check_json(tmp_path / "planted")
    (run,) = planted["runs"]  # type: ignore[misc]
    assert code == 1 and run["verdict"] == "incorrect", run
    # planted at every odd step: 1, 3, …, 11
    found = {finding["code"]: finding["steps"] for finding in planted["findings"]}  # type: ignore[attr-defined]
    assert found.get("local_mean") == {"first": 1, "last": 11, "count": 6}, found


def test_the_bench_one_row_shards_are_read_whole(tmp_path: Path) -> None:
    write_small_shards(tmp_path / "small", 3, 4, recorder_columns=True)
    code, found, _ = check_json(tmp_path / "small")
    assert found["files"] == len(list((tmp_path / "small").rglob("*.parquet"))), found
    assert code == 0 and [run["verdict"] for run in found["runs"]] == ["correct"], found  # type: ignore[attr-defined]


@pytest.mark.parametrize("writer", synthetic.WRITERS)
def test_a_log_written_by_another_tool_gives_the_same_report(tmp_path: Path, writer: str) -> None:
    """The bench's logs as pandas, pyarrow, a compaction job or Spark leave them (no tokaudit metadata, other row
    groups and files, a `rank=R/` folder a rank): the same runs, verdicts and planted findings as the recorder's
    layout."""
    write_log(tmp_path / "recorder", ranks=4, steps=12, micro=2, steps_per_file=5, ranks_per_file=2, local_mean_every=2)
    synthetic.rewrite(tmp_path / "recorder", tmp_path / writer, writer)
    code, expected, _ = check_json(tmp_path / "recorder")
    again, found, _ = check_json(tmp_path / writer)
    assert (again, found["runs"], found["findings"]) == (code, expected["runs"], expected["findings"])
