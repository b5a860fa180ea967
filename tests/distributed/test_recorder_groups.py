"""The recorder inside real gloo process groups: who it is when made before init_process_group, and what a DDP
comm hook divides by (or the warning that it cannot be seen)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from scenarios.harness import run_ddp
from tests.logs import read_rows
from tokaudit.hooks import Recorder

pytestmark = pytest.mark.distributed


def _before_init_job(rank: int, world_size: int, folder: str, rendezvous: str) -> tuple[int, int]:
    import torch.distributed as dist

    dist.destroy_process_group()
    rec = Recorder(folder, run_id="early")  # made before init_process_group, as trainers often do
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0, step=0)
    rec.close()
    return rec.rank, rec.world_size


def test_a_recorder_made_before_the_process_group_records_the_right_rank(tmp_path: Path) -> None:
    identities = run_ddp(_before_init_job, 2, str(tmp_path), str(tmp_path / "rendezvous"))
    assert identities == [(0, 2), (1, 2)]
    names = sorted(p.name for p in (tmp_path / "early").glob("*.parquet"))
    assert names == ["rank-00000-000000.parquet", "rank-00001-000000.parquet"]
    assert sorted((r["rank"], r["world_size"]) for r in read_rows(tmp_path / "early")) == [(0, 2), (1, 2)]


def _comm_hook_job(rank: int, world_size: int, log_dir: str) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    messages = []
    for name, hook, divisor in (("default", None, None), ("known", default_hooks.allreduce_hook, None),
                                ("custom", _custom_hook, None), ("declared", _custom_hook, 1.0)):
        model = DDP(torch.nn.Linear(2, 1))
        if hook is not None:
            model.register_comm_hook(None, hook)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Recorder(log_dir, run_id=name, model=model, grad_divisor=divisor) as rec:
                rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=model(torch.ones(1, 2)).sum())
        messages.append(" | ".join(str(w.message) for w in caught))
        del model
    dist.barrier()
    return messages


def _custom_hook(state, bucket):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def test_divisor_comes_from_the_comm_hook_or_a_warning(tmp_path: Path) -> None:
    messages = run_ddp(_comm_hook_job, 2, str(tmp_path))[0]
    assert messages[0] == "" and messages[1] == "" and messages[3] == ""
    assert "grad_divisor" in messages[2] and "_custom_hook" in messages[2]
    divisors = {run: read_rows(tmp_path / run)[0]["grad_divisor"] for run in ("default", "known", "custom", "declared")}
    assert divisors == {"default": 2.0, "known": 2.0, "custom": None, "declared": 1.0}
    known = {run: read_rows(tmp_path / run)[0]["divisor_known"] for run in ("default", "known", "custom", "declared")}
    assert known == {"default": True, "known": True, "custom": False, "declared": True}
