"""Ranks running different numbers of microbatches in real DDP on 2 gloo processes (3 and 2, then 2 and 3), the
token mean over the step's N: each rank synchronizing its last microbatch alone, or its last two. Both give the
float64 reference's gradient (the all-reduces pair off one for one, and a sum of all-reduced sums is the all-reduced
sum), and neither may read `incorrect` (the second read as ranks synchronizing unequally once, one record of a
synced backward a rank being all it took)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scenarios.harness import run_ddp_each
from scenarios.uneven_sync import COUNTS, SYNCED, job, reference_gradient
from tokaudit._auditing import audit

pytestmark = pytest.mark.distributed


def test_ranks_of_different_microbatch_counts_that_synchronize_alike_are_correct(tmp_path: Path) -> None:
    variants = list(SYNCED)
    for variant, ranks in zip(variants, run_ddp_each(job, 2, variants, str(tmp_path))):
        for step in range(len(COUNTS)):
            record = ranks[0]["history"][step]
            want = reference_gradient(record["before"], step)
            assert all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want)), variant
        report = audit([tmp_path / f"uneven_{variant}"])
        assert report.runs[0].verdict == "correct", (variant, [f.message for f in report.findings])
