"""The fix helpers in real DDP: unequal, zero and all-zero counts match the single-process token mean."""

from __future__ import annotations

import gc
from contextlib import nullcontext
from typing import Any

import pytest
import torch

from scenarios.harness import run_ddp
from scenarios.strategies import Scenario, make_model, microbatch, per_token_loss, reference_gradient

pytestmark = pytest.mark.distributed

# counts[step][rank][micro]: uneven, a rank with no valid token, then no valid token anywhere.
COUNTS = (((5, 1), (3, 7), (0, 2)), ((0, 0), (6, 2), (8, 1)), ((0, 0), (0, 0), (0, 0)), ((2, 8), (1, 0), (4, 4)))


def fix_job(rank: int, world_size: int, reduction: str) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scenarios.strategies import _summing_hook
    from tokaudit.hooks import global_valid_tokens, is_empty_update, reported_token_mean, token_mean_loss

    model = make_model()
    ddp = DDP(model)
    if reduction == "sum":
        ddp.register_comm_hook(None, _summing_hook)
    out = []
    for step, step_counts in enumerate(COUNTS):
        data = [microbatch(step, rank, m, n) for m, n in enumerate(step_counts[rank])]
        tokens_n = global_valid_tokens([labels for _, labels, _ in data])  # one all-reduce, before backward
        local_sum = torch.zeros((), dtype=torch.float64)
        for m, (tokens, labels, valid) in enumerate(data):
            with nullcontext() if m == len(data) - 1 else ddp.no_sync():
                loss_sum = (per_token_loss(ddp, tokens, labels) * valid).sum()
                token_mean_loss(loss_sum, tokens_n, reduction=reduction).backward()
            local_sum += loss_sum.detach()
        out.append(
            {
                "tokens": int(tokens_n),
                "empty": is_empty_update(tokens_n),
                "reported": float(reported_token_mean(local_sum, tokens_n)),
                "grads": [p.grad.detach().clone() for p in model.parameters()],
            }
        )  # type: ignore[union-attr]
        ddp.zero_grad(set_to_none=True)
    dist.barrier()
    del ddp, model
    gc.collect()
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fix_matches_the_token_mean_reference(reduction: str) -> None:
    results = run_ddp(fix_job, 3, reduction)
    scenario = Scenario(name="fix", strategy="token_mean", world_size=3, counts=COUNTS, correct=True, description="")
    params = [p.detach().clone() for p in make_model().parameters()]
    for step, step_counts in enumerate(COUNTS):
        expected_tokens = sum(map(sum, step_counts))
        expected = reference_gradient(params, scenario, step, [0, 1, 2])
        model = make_model()
        with torch.no_grad():
            sums = [
                float((per_token_loss(model, *microbatch(step, r, m, n)[:2]) * microbatch(step, r, m, n)[2]).sum())
                for r in range(3)
                for m, n in enumerate(step_counts[r])
            ]
        for rank_result in results:
            record = rank_result[step]
            assert record["tokens"] == expected_tokens
            assert record["empty"] is (expected_tokens == 0)
            assert record["reported"] == pytest.approx(sum(sums) / max(expected_tokens, 1), rel=1e-12)
            for got, want in zip(record["grads"], expected, strict=True):
                assert torch.isfinite(got).all()
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
