"""Two optimizers on one DDP model, stepping in turn (a GAN-like or split loop), on 2 gloo processes: the recorder
watches one; the other's updates, cleared by the model's zero_grad(), are applied updates (they read as skipped, so a
broken loss there was never judged). The float64 reference says which loop is right; the audit agrees."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from scenarios.harness import run_ddp
from scenarios.strategies import Scenario, make_model, microbatch, per_token_loss, reference_gradient

pytestmark = pytest.mark.distributed

COUNTS = (((5, 1), (2, 6)), ((1, 4), (7, 2)), ((6, 2), (3, 3)), ((2, 7), (4, 1)))


def two_optimizers_job(rank: int, world_size: int, log_dir: str, variant: str) -> list[dict[str, Any]]:
    """Even steps train the first half of the parameters with the watched optimizer, odd steps the rest with another;
    the token mean W·S/N over 2 microbatches; `broken`: the other's loss each microbatch's own mean ÷ M."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tokaudit.hooks import Recorder, global_valid_tokens

    model = DDP(make_model())
    params = list(model.parameters())
    watched = torch.optim.SGD(params[: len(params) // 2], lr=0.5)
    other = torch.optim.SGD(params[len(params) // 2 :], lr=0.5)
    recorder = Recorder(log_dir, run_id=variant, model=model, optimizer=watched)
    history = []
    for step, per_rank in enumerate(COUNTS):
        batches = [microbatch(step, rank, micro, count) for micro, count in enumerate(per_rank[rank])]
        global_tokens = global_valid_tokens([labels for _, labels, _ in batches])
        before = [p.detach().clone() for p in model.parameters()]
        for micro, (tokens, labels, valid) in enumerate(batches):
            with model.no_sync() if micro < len(batches) - 1 else contextlib.nullcontext():
                loss_sum = (per_token_loss(model, tokens, labels) * valid).sum()
                n = int(valid.sum())
                if variant == "broken" and step % 2:
                    scalar = loss_sum / n / len(batches)
                else:
                    scalar = world_size * loss_sum / global_tokens
                scalar.backward()
                recorder.record(loss_sum=loss_sum, valid_tokens=n, backward_scalar=scalar)
        history.append({"before": before, "grads": [p.grad.detach().clone() for p in model.parameters()]})
        (other if step % 2 else watched).step()
        model.zero_grad()
    recorder.close()
    del model
    gc.collect()
    dist.barrier()
    return history


@pytest.mark.parametrize("variant, correct", [("token_mean", True), ("broken", False)])
def test_a_second_optimizer_s_updates_are_judged_not_read_as_skipped(
    tmp_path: Path, variant: str, correct: bool
) -> None:
    from tests.logs import read_rows
    from tokaudit._auditing import audit

    scenario = Scenario(name=variant, strategy="token_mean", world_size=2, counts=COUNTS, correct=True, description="")
    for rank, history in enumerate(run_ddp(two_optimizers_job, 2, str(tmp_path), variant, timeout=120)):
        for step, record in enumerate(history):
            want = reference_gradient(record["before"], scenario, step, [0, 1])
            same = all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want, strict=True))
            assert same == (correct or step % 2 == 0), (variant, rank, step)
    assert not any(row["skipped"] for row in read_rows(tmp_path / variant))
    report = audit([tmp_path / variant])
    assert report.runs[0].verdict == ("correct" if correct else "incorrect")
    assert {f.code.value for f in report.findings} == (set() if correct else {"local_mean"})
