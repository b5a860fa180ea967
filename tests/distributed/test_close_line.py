"""The recorder's last line (global rank 0, at close()) is about the complete log: where another rank's last records
are not on disk within the wait, it says so and gives no verdict, rather than a verdict on part of the run."""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from pathlib import Path

import pytest

from scenarios.harness import run_ddp
from tokaudit._auditing import audit

pytestmark = pytest.mark.distributed


def _late_rank_job(rank: int, world_size: int, log_dir: str) -> tuple[str, list[str]]:
    """W·S/N on 2 ranks, 3 steps; rank 1 writes steps 0–1 at once and its last step 3 s after rank 0 closes."""
    import os

    import tokaudit.hooks.trackers as trackers
    from tokaudit.hooks import Recorder

    os.environ.pop("TOKAUDIT_QUIET", None)  # the suite keeps recorders quiet; this one's line is the subject
    trackers.WAIT_FOR_RANKS_S = 1.0
    said = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(said):
        warnings.simplefilter("always")
        rec = Recorder(log_dir, run_id="late", flush_every=2, grad_divisor=2.0, announce=True)
        for step in range(3):
            n = (2, 3)[rank]
            rec.record(loss_sum=float(n), valid_tokens=n, backward_scalar=2 * n / 5, step=step)
        if rank == 1:
            time.sleep(3.0)  # its last step reaches the disk after rank 0's final audit gave up waiting
        rec.close()
    return said.getvalue(), [str(w.message) for w in caught]


def test_a_rank_whose_last_records_come_late_gets_no_partial_verdict(tmp_path: Path) -> None:
    (said, warned), _ = run_ddp(_late_rank_job, 2, str(tmp_path))
    assert "tokaudit: run 'late' is" not in said, said
    assert any("not every rank's records of run 'late'" in w and "no verdict" in w for w in warned), warned
    report = audit([tmp_path / "late"])  # the finished log: right, and said so by the audit
    assert report.runs[0].verdict == "correct" and report.runs[0].steps == 3
