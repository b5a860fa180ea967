"""A local log_dir the recorder cannot write at close(): its records kept in the spool, and `tokaudit sync` writes
them where they were going, wherever it is run from."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.logs import read_rows
from tokaudit.cli import main
from tokaudit.hooks import Recorder


def test_a_relative_log_dir_is_synced_to_where_the_training_ran_from_any_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Recorder("blocked/logs")` where `blocked` is a file: close() spools the records; the spool names the folder as
    an absolute path, so a sync run from another folder writes them there (once, into that other folder)."""
    monkeypatch.setenv("TOKAUDIT_SPOOL", str(tmp_path / "spool"))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "blocked").write_text("a file where the folder should be")
    monkeypatch.chdir(tmp_path / "job")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recorder says it could not write, and where it kept the records
        rec = Recorder("blocked/logs", run_id="run", flush_every=2)
        for step in range(4):
            rec.record(loss_sum=torch.tensor(2.0), valid_tokens=2, backward_scalar=torch.tensor(1.0), step=step)
        rec.close()
    assert list((tmp_path / "spool").rglob("*.parquet"))
    (tmp_path / "job" / "blocked").unlink()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = CliRunner().invoke(main, ["sync"])
    assert result.exit_code == 0, result.output
    assert [row["step"] for row in read_rows(tmp_path / "job" / "blocked" / "logs" / "run")] == [0, 1, 2, 3]
    assert not (tmp_path / "elsewhere" / "blocked").exists()
