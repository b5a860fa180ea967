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


def _full(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter whole (gathered from its shards): what the float64 reference starts from."""
    return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[operator]


def _stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer, before: list[torch.Tensor]) -> dict[str, Any]:
    """The update's parameters before it and its gradients whole, then the optimizer's step."""
    grads = [p.grad.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    optimizer.step()
    optimizer.zero_grad()
    return {"before": before, "grads": grads}


def _backward(recorder: Any, model: torch.nn.Module, batch: tuple[torch.Tensor, ...], w: int, n: Any) -> None:
    """One microbatch's loss sum S recorded and backpropagated as b = W·S/N, the token mean into an average."""
    tokens, labels, valid = batch
    loss_sum = (per_token_loss(model, tokens, labels) * valid).sum()
    scalar = w * loss_sum / n
    recorder.record(loss_sum=loss_sum, valid_tokens=int(valid.sum()), backward_scalar=scalar)
    scalar.backward()


def _parted() -> None:
    """The sharded model's memory given back on every rank before the processes part."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()


def fsdp_job(rank: int, world_size: int, log_dir: str, variant: str) -> list[dict[str, Any]]:
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
        before = _full(model)
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
        history.append(_stepped(model, optimizer, before))
    recorder.close()
    divisor = recorder.grad_divisor
    del model, optimizer
    _parted()
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


ACCUMULATED = (((5, 1), (2, 6)), ((1, 4), (7, 2)), ((6, 2), (3, 3)))


def fsdp_accumulation_job(rank: int, world_size: int, log_dir: str, variant: str) -> list[dict[str, Any]]:
    """The token mean over 2 microbatches, gradients synchronized on the last one (`set_requires_gradient_sync`),
    or, `inverted`, on the first one only: the last microbatch's gradient never leaves its rank."""
    from torch.distributed.fsdp import fully_shard

    from tokaudit.hooks import Recorder, global_valid_tokens

    model = make_model()
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    recorder = Recorder(log_dir, run_id=variant, model=model, optimizer=optimizer)
    history = []
    for step, per_rank in enumerate(ACCUMULATED):
        batches = [microbatch(step, rank, micro, count) for micro, count in enumerate(per_rank[rank])]
        global_tokens = global_valid_tokens([labels for _, labels, _ in batches])
        before = _full(model)
        for micro, (tokens, labels, valid) in enumerate(batches):
            last = micro == len(batches) - 1
            model.set_requires_gradient_sync(last != (variant == "inverted"))  # type: ignore[operator]
            _backward(recorder, model, (tokens, labels, valid), world_size, global_tokens)
        history.append(_stepped(model, optimizer, before))
    recorder.close()
    del model, optimizer
    _parted()
    return history


@pytest.mark.parametrize("variant, correct", [("synced_last", True), ("inverted", False)])
def test_fsdp2_s_gradient_sync_is_recorded_and_a_last_microbatch_never_synced_is_missing_sync(
    tmp_path: Path, variant: str, correct: bool
) -> None:
    """FSDP2 decides at each backward whether it reduce-scatters (set_requires_gradient_sync, its no_sync): the
    records say so, as DDP's do. Synced on the last microbatch, the token mean (the float64 reference) is correct;
    synced on the first only, each rank steps on its own last microbatch: missing_sync (it read correct, every
    record's sync unknown)."""
    from tests.logs import read_rows
    from tokaudit._auditing import audit

    scenario = Scenario(
        name=variant, strategy="token_mean", world_size=2, counts=ACCUMULATED, correct=correct, description=""
    )
    for history in run_ddp(fsdp_accumulation_job, 2, str(tmp_path), variant, timeout=120):
        for step, record in enumerate(history):
            want = reference_gradient(record["before"], scenario, step, [0, 1])
            same = all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want, strict=True))
            assert same == correct, (variant, step)
    assert {(row["micro"], row["sync"]) for row in read_rows(tmp_path / variant)} == (
        {(0, False), (1, True)} if correct else {(0, True), (1, False)}
    )
    report = audit([tmp_path / variant])
    assert report.runs[0].verdict == ("correct" if correct else "incorrect")
    assert {f.code.value for f in report.findings} == (set() if correct else {"missing_sync"})


def fsdp_dp_tp_job(rank: int, world_size: int, log_dir: str) -> list[dict[str, Any]]:
    """4 processes as a (dp=2, tp=2) mesh, fully_shard over the dp dimension, both tp ranks of a dp rank on the same
    tokens (what tensor parallelism's replicas see): the token mean over the dp group is W_dp·S/N, W_dp = 2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tokaudit.hooks import Recorder

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    model = make_model()
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    recorder = Recorder(log_dir, run_id="dp_tp", model=model, optimizer=optimizer)
    history = []
    for step, per_rank in enumerate(COUNTS):
        tokens, labels, valid = microbatch(step, dp, 0, per_rank[dp][0])
        tokens_of_update = sum(counts[0] for counts in per_rank)  # N over the dp group's tokens
        before = _full(model)
        _backward(recorder, model, (tokens, labels, valid), 2, tokens_of_update)
        history.append(_stepped(model, optimizer, before))
    recorder.close()
    del model, optimizer
    _parted()
    return history


def test_fsdp2_over_the_dp_dimension_of_a_dp_tp_mesh_records_the_dp_group(tmp_path: Path) -> None:
    """Given the FSDP2 model alone, the recorder takes W and the group from the mesh dimension it shards over (it
    took the world's W = 4 beside the mesh's D = 2: world_size_mismatch, where the float64 reference says the
    token mean over the dp group's tokens was trained)."""
    from tests.logs import read_rows
    from tokaudit._auditing import audit

    scenario = Scenario(name="dp_tp", strategy="token_mean", world_size=2, counts=COUNTS, correct=True, description="")
    for history in run_ddp(fsdp_dp_tp_job, 4, str(tmp_path), timeout=180):
        for step, record in enumerate(history):
            want = reference_gradient(record["before"], scenario, step, [0, 1])
            assert all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want, strict=True))
    assert {(row["world_size"], row["grad_divisor"]) for row in read_rows(tmp_path / "dp_tp")} == {(2, 2.0)}
    report = audit([tmp_path / "dp_tp"])
    assert report.runs[0].verdict == "correct", report.findings
