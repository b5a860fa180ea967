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

    # a rank returns from the harness's init_process_group before its peer has connected to it; leaving that
    # group at once closed the connection the peer was still making ("Connection closed by peer" in its init)
    dist.barrier()
    dist.destroy_process_group()
    rec = Recorder(folder, run_id="early")  # made before init_process_group, as trainers often do
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    dist.barrier()  # the same race again: no rank leaves this group before its peer has connected to it
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
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    messages = []
    for name, hook, divisor in (
        ("default", None, None),
        ("known", default_hooks.allreduce_hook, None),
        ("custom", _custom_hook, None),
        ("declared", _custom_hook, 1.0),
        ("agreed", None, 2.0),
        ("contradicted", None, 1.0),  # a Megatron-style sum told as such, into DDP's default average
        ("powersgd", powerSGD_hook.powerSGD_hook, 1.0),  # PowerSGD divides by W too
    ):
        model = DDP(torch.nn.Linear(2, 1))
        if hook is powerSGD_hook.powerSGD_hook:
            model.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, start_powerSGD_iter=2), hook)
        elif hook is not None:
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
    """D from the model's reduction, or said; a D said that contradicts the one the reduction shows is recorded as
    unknown, said once (it was taken as said: a sum told with grad_divisor=1 into DDP's average, W× too small, read
    correct), and the audit judges no scale of it."""
    from tokaudit._auditing import audit

    messages = run_ddp(_comm_hook_job, 2, str(tmp_path))[0]
    assert messages[0] == "" and messages[1] == "" and messages[3] == "" and messages[4] == ""
    assert "grad_divisor" in messages[2] and "_custom_hook" in messages[2]
    assert "grad_divisor=1 was given, but the model's reduction divides by 2" in messages[5]
    assert "grad_divisor=1 was given, but the model's reduction divides by 2" in messages[6]
    runs = ("default", "known", "custom", "declared", "agreed", "contradicted", "powersgd")
    divisors = {run: read_rows(tmp_path / run)[0]["grad_divisor"] for run in runs}
    assert divisors == {
        "default": 2.0,
        "known": 2.0,
        "custom": None,
        "declared": 1.0,
        "agreed": 2.0,
        "contradicted": None,
        "powersgd": None,
    }
    known = {run: read_rows(tmp_path / run)[0]["divisor_known"] for run in runs}
    assert known == {
        "default": True,
        "known": True,
        "custom": False,
        "declared": True,
        "agreed": True,
        "contradicted": False,
        "powersgd": False,
    }
    report = audit([tmp_path / "contradicted"])
    assert report.runs[0].verdict == "inconclusive" and "unknown_divisor" in {f.code.value for f in report.findings}
    assert "a grad_divisor= the model's reduction contradicts" in report.findings[0].message


def test_n_counted_over_the_launch_names_the_replicas(tmp_path: Path) -> None:
    """DP×TP on 4 processes (data-parallel groups of 2; tensor-parallel partners 0/1 and 2/3 hold as many tokens):
    W·S/N with N all-reduced over all 4 processes counts each token twice. The float64 reference says the
    gradient is half the token mean's; tokaudit says world_size_mismatch and names the count, not a missing W."""
    from scenarios.harness import run_ddp
    from scenarios.strategies import Scenario, reference_gradient, run_scenario
    from tokaudit._auditing import audit

    scenario = Scenario(
        name="tokens_over_launch",
        strategy="tokens_over_launch",
        world_size=4,
        counts=(((2,), (2,), (5,), (5,)), ((8,), (8,), (4,), (4,))),
        dp_size=2,
        correct=False,
        description="N counted over all processes under DP×TP",
    )
    results = run_ddp(run_scenario, 4, scenario, str(tmp_path))
    for result in results:
        for step, record in enumerate(result["recorded"]):
            want = reference_gradient(record["before"], scenario, step, result["members"])
            assert all(torch.allclose(2 * g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want))
    report = audit([tmp_path / "tokens_over_launch"])
    (finding,) = [f for f in report.findings if f.code.value == "world_size_mismatch"]
    assert "counted over all 4 processes of the launch" in finding.message
    assert "W factor is missing" not in finding.message and report.runs[0].verdict == "incorrect"
