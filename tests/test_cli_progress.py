"""What `tokaudit check` says on stderr while it reads a large log: in a pipe or a CI log, a few plain lines."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from tests.logs import UNEVEN_GA, local_mean, records, write
from tokaudit import _opening
from tokaudit.cli import main


def _log(folder: Path, shards: int) -> Path:
    """`shards` files of three steps each, each a step range of its own at 12 records a range."""
    rows = records(UNEVEN_GA * shards, local_mean)
    for first in range(0, 3 * shards, 3):
        write(folder / "run" / f"rank-all-{first:06d}.parquet", [r for r in rows if first <= r["step"] < first + 3])
    return folder


@pytest.mark.parametrize(("shards", "shown"), [(2, [1, 2]), (4, [1, 2, 3, 4]), (40, [1, 10, 20, 30, 40])])
def test_in_a_pipe_the_aggregation_is_a_line_at_the_first_range_each_quarter_and_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int, shown: list[int]
) -> None:
    """Of 40 ranges: the first, the first past each quarter, the last (each range is as many files as DuckDB has
    threads, so that each thread reads one)."""
    monkeypatch.setattr(_opening, "PROGRESS_ROWS", 0)  # as a log of millions of records
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", "12")
    threads = int(duckdb.connect().execute("SELECT current_setting('threads')").fetchall()[0][0])
    log = _log(tmp_path, shards * threads)
    result = CliRunner().invoke(main, ["check", str(log), "--format", "json"])
    lines = result.stderr.splitlines()
    assert result.exit_code == 1, result.output
    assert lines[0] == f"reading {shards * threads} file(s), {12 * shards * threads:,} rows"
    steps = 3 * threads  # a range's
    expected = [f"aggregating steps {steps * (i - 1):,}–{steps * i - 1:,} ({i}/{shards})" for i in shown]
    assert lines[1:] == expected


def test_quiet_says_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_opening, "PROGRESS_ROWS", 0)
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", "12")
    result = CliRunner().invoke(main, ["check", str(_log(tmp_path, 4)), "--format", "json", "-q"])
    assert result.exit_code == 1 and result.stderr == ""
