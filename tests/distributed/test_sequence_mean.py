"""A per-sequence mean (GRPO's shape) in real DDP on 2 gloo processes: the float64 reference says every sequence
weighs alike and the token mean is not what trained. The audit leads with the per-sequence finding, and the
local mean the records' own weights show follows it as its consequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scenarios.harness import run_ddp
from scenarios.sequence_mean import COUNTS, job, reference_gradient
from scenarios.strategies import Scenario
from scenarios.strategies import reference_gradient as token_mean_gradient
from tokaudit._auditing import audit

pytestmark = pytest.mark.distributed


def test_a_per_sequence_mean_leads_with_its_own_finding(tmp_path: Path) -> None:
    history = run_ddp(job, 2, str(tmp_path))[0]
    # the same tokens, each sequence a "microbatch" of the token-mean reference
    tokens = Scenario(
        name="token_mean",
        strategy="token_mean",
        world_size=2,
        counts=COUNTS,
        correct=True,
        description="the token mean over the same sequences",
    )
    for step, record in enumerate(history):
        got = record["grads"]
        assert all(
            torch.allclose(g, w, rtol=1e-9, atol=1e-12)
            for g, w in zip(got, reference_gradient(record["before"], step, 2))
        )
        assert not all(
            torch.allclose(g, w, rtol=1e-6)
            for g, w in zip(got, token_mean_gradient(record["before"], tokens, step, [0, 1]))
        )
    report = audit([tmp_path / "sequence_mean"])
    assert [(f.code.value, f.severity.value) for f in report.findings] == [
        ("nonuniform_in_microbatch", "error"),
        ("local_mean", "warning"),
    ]
    assert report.runs[0].verdict == "incorrect"
    assert "nonuniform_in_microbatch" in report.findings[1].message
