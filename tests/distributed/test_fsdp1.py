"""FSDP1 (the FullyShardedDataParallel wrapper) on 2 gloo processes: its no_sync() is recorded as DDP's is, the float64
reference says which loop is right, and the audit agrees."""

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

ACCUMULATED = (((5, 1), (2, 6)), ((1, 4), (7, 2)), ((6, 2), (3, 3)))


def fsdp1_job(rank: int, world_size: int, log_dir: str, variant: str) -> list[dict[str, Any]]:
    """The token mean W·S/N over 2 microbatches, the first under no_sync(); `inverted`: the last one under it, whose
    gradient then never leaves its rank (NO_SHARD: a sharded model refuses to gather such gradients); `inverted_after`:
    the same, each record made after its microbatch's context is left."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    from tokaudit.hooks import Recorder, global_valid_tokens

    inverted = variant.startswith("inverted")
    strategy = ShardingStrategy.NO_SHARD if inverted else ShardingStrategy.FULL_SHARD
    model = FullyShardedDataParallel(
        make_model(), sharding_strategy=strategy, use_orig_params=True, device_id=torch.device("cpu")
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    recorder = Recorder(log_dir, run_id=variant, model=model, optimizer=optimizer, grad_divisor=float(world_size))
    history = []
    for step, per_rank in enumerate(ACCUMULATED):
        batches = [microbatch(step, rank, micro, count) for micro, count in enumerate(per_rank[rank])]
        global_tokens = global_valid_tokens([labels for _, labels, _ in batches])
        with FullyShardedDataParallel.summon_full_params(model):
            before = [p.detach().clone() for p in model.parameters()]
        for micro, (tokens, labels, valid) in enumerate(batches):
            unsynced = micro == len(batches) - 1 if inverted else micro < len(batches) - 1
            with model.no_sync() if unsynced else contextlib.nullcontext():
                loss_sum = (per_token_loss(model, tokens, labels) * valid).sum()
                scalar = world_size * loss_sum / global_tokens
                scalar.backward()
                if variant != "inverted_after":
                    recorder.record(loss_sum=loss_sum, valid_tokens=int(valid.sum()), backward_scalar=scalar)
            if variant == "inverted_after":
                recorder.record(loss_sum=loss_sum, valid_tokens=int(valid.sum()), backward_scalar=scalar)
        with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
        history.append({"before": before, "grads": grads})
    recorder.close()
    del model, optimizer
    gc.collect()
    dist.barrier()
    return history


@pytest.mark.parametrize("variant, correct", [("synced_last", True), ("inverted", False), ("inverted_after", False)])
def test_fsdp1_s_no_sync_is_recorded_and_a_last_microbatch_never_synced_is_missing_sync(
    tmp_path: Path, variant: str, correct: bool
) -> None:
    """FSDP1 decides at each backward whether it reduces (its modules' flag, which no_sync() clears): the records say
    so. The first microbatch under no_sync() is the token mean (the float64 reference): correct; the last under it
    leaves each rank's own gradient of it: missing_sync (it read correct, every record's sync unknown), also where
    each record is made after the context (the flag is read at the forward)."""
    from tests.logs import read_rows
    from tokaudit._auditing import audit

    scenario = Scenario(
        name=variant, strategy="token_mean", world_size=2, counts=ACCUMULATED, correct=correct, description=""
    )
    for rank, history in enumerate(run_ddp(fsdp1_job, 2, str(tmp_path), variant, timeout=120)):
        for step, record in enumerate(history):
            want = reference_gradient(record["before"], scenario, step, [0, 1])
            same = all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want, strict=True))
            assert same == correct, (variant, rank, step)
    assert {(row["micro"], row["sync"]) for row in read_rows(tmp_path / variant)} == (
        {(0, False), (1, True)} if correct else {(0, True), (1, False)}
    )
    report = audit([tmp_path / variant])
    assert report.runs[0].verdict == ("correct" if correct else "incorrect")
    assert {f.code.value for f in report.findings} == (set() if correct else {"missing_sync"})
