"""The probe inside an activation-checkpointed function, `rec.record` before `backward()`, in real DDP on 2
gloo processes: reentrant (the probe measures during the recomputation in backward) and non-reentrant (the
recomputation must save what the forward saved). The float64 reference says the gradient is the token mean;
each record carries its own microbatch's weights, and the run is `correct` with no warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scenarios.harness import run_ddp_each
from scenarios.recompute import COUNTS, job
from scenarios.strategies import Scenario, reference_gradient
from tests.logs import read_rows
from tokaudit._auditing import audit

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("variant", ["reentrant", "non_reentrant", "captured"])
def test_a_checkpointed_probe_measures_its_own_record(tmp_path: Path, variant: str) -> None:
    """(captured: the cross-entropy recorded by capture_cross_entropy inside a non-reentrant checkpoint, whose
    recomputation stops by raising from the capture's tensors: it warned that a call was not recorded.)"""
    (ranks,) = run_ddp_each(job, 2, [variant], str(tmp_path))
    scenario = Scenario(
        name="ckpt", strategy="token_mean", world_size=2, counts=COUNTS, correct=True, description="checkpointed"
    )
    for step in range(len(COUNTS)):
        record = ranks[0]["history"][step]
        want = reference_gradient(record["before"], scenario, step, [0, 1])
        assert all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want))
    assert ranks[0]["warnings"] == [] and ranks[1]["warnings"] == []
    name = f"checkpoint_{variant}"
    for row in read_rows(tmp_path / name):
        tokens = sum(sum(counts) for counts in COUNTS[row["step"]])
        # every valid token of the record weighs ∂b/∂ℓ = W/N: its own count's worth, not a neighbour's
        assert row["token_weight_sum"] == pytest.approx(2 * row["valid_tokens"] / tokens, rel=1e-12)
    report = audit([tmp_path / name])
    assert [f.code.value for f in report.findings] == ["sync_every_micro"]  # every microbatch synced: information
    assert report.runs[0].verdict == "correct"
