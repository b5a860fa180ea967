"""FSDP2 (`fully_shard`) on 2 gloo processes: the recorder reads D from the module (the data-parallel
size, or set_gradient_divide_factor), the float64 reference says which loop is right, the audit agrees."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from scenarios.harness import run_ddp
from scenarios.strategies import Scenario, make_model, microbatch, per_token_loss, reference_gradient

pytestmark = pytest.mark.distributed

COUNTS = (((5,), (2,)), ((1,), (7,)), ((6,), (3,)))


def fsdp_job(rank: int, world_size: int, log_dir: str, variant: str) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tokaudit.hooks import Recorder, global_valid_tokens

    model = make_model()  # the same float64 start on every rank
    fully_shard(model)
    if variant.startswith("sum_factor"):
        model.set_gradient_divide_factor(1.0)  # a summing reduce-scatter (torchtitan's choice)
        model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (float32 needs it; harmless here)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    recorder = Recorder(log_dir, run_id=variant, model=model, optimizer=optimizer)
    history = []
    for step, per_rank in enumerate(COUNTS):
        count = per_rank[rank][0]
        tokens, labels, valid = microbatch(step, rank, 0, count)
        global_tokens = global_valid_tokens([labels])
        before = [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[operator]
        per_token = recorder.probe(per_token_loss(model, tokens, labels), valid)
        loss_sum = (per_token * valid).sum()
        if variant in ("token_mean", "sum_factor_wrong"):
            scalar = world_size * loss_sum / global_tokens  # W·S/N into the averaging reduce-scatter
        elif variant == "sum_factor":  # S/N into the sum
            scalar = loss_sum / global_tokens
        else:
            scalar = loss_sum / count  # a rank-local mean
        recorder.record(loss_sum=loss_sum, valid_tokens=count, backward_scalar=scalar)
        scalar.backward()
        grads = [p.grad.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
        history.append({"before": before, "grads": grads})
    recorder.close()
    divisor = recorder.grad_divisor
    del model, optimizer
    gc.collect()
    dist.barrier()
    return [{"divisor": divisor}, *history]


@pytest.fixture(scope="session")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Any]]]:
    root = tmp_path_factory.mktemp("fsdp2")
    return root, {
        variant: run_ddp(fsdp_job, 2, str(root), variant, timeout=120)
        for variant in ("token_mean", "sum_factor", "sum_factor_wrong", "local_mean")
    }


@pytest.mark.parametrize(
    "variant, divisor, correct, codes",
    [
        ("token_mean", 2.0, True, set()),
        ("sum_factor", 1.0, True, set()),
        ("sum_factor_wrong", 1.0, False, {"world_size_mismatch"}),  # W·S/N into a sum: W× too large
        ("local_mean", 2.0, False, {"local_mean"}),
    ],
)
def test_fsdp2_divisor_is_read_and_the_verdict_follows_the_reference(
    fsdp_runs: Any, variant: str, divisor: float, correct: bool, codes: set[str]
) -> None:
    from tokaudit._auditing import audit

    root, runs = fsdp_runs
    scenario = Scenario(
        name=variant, strategy="token_mean", world_size=2, counts=COUNTS, correct=correct, description=""
    )
    for result in runs[variant]:
        assert result[0]["divisor"] == divisor, "D read from the FSDP2 module"
        for step, record in enumerate(result[1:]):
            want = reference_gradient(record["before"], scenario, step, [0, 1])  # the token mean, float64
            same = all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want, strict=True))
            assert same == correct, (variant, step)
    report = audit([root / variant])
    (run,) = report.runs
    assert {f.code.value for f in report.findings} == codes
    assert run.verdict == ("correct" if correct else "incorrect")


class _UnreadableFSDP(torch.nn.Module):
    """A module that looks like FSDP2 but whose state cannot be read (another torch version)."""

    def _get_fsdp_state(self) -> None:
        raise RuntimeError("no state")


def test_an_fsdp2_module_whose_divisor_cannot_be_read_logs_it_unknown(tmp_path: Path) -> None:
    """Never the DDP default: the log says D is unknown, and the audit does not judge the scale."""
    from tests.logs import read_rows
    from tokaudit.hooks import Recorder

    with pytest.warns(RuntimeWarning, match="FSDP2 module's reduce-scatter divisor is not one number that can be read"):
        with Recorder(tmp_path, run_id="fsdp", model=_UnreadableFSDP()) as recorder:
            recorder.record(loss_sum=torch.tensor(2.0), valid_tokens=2, backward_scalar=torch.tensor(1.0))
    (row,) = read_rows(tmp_path / "fsdp")
    assert row["divisor_known"] is False and row["grad_divisor"] is None
