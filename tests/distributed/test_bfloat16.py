"""A loss computed in bfloat16 (the model cast to bf16, cross-entropy on bf16 logits) on 2 gloo DDP processes,
2 microbatches a step: the recorder writes the precision its values and gradients had, and the audit judges
the run at it. The truth is the float64 token-mean gradient of the same tokens: the right loop's DDP gradient
is within bf16's rounding of it and is `correct`; a local mean over ranks about 4× apart in tokens is far off and
stays `local_mean`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scenarios.harness import run_ddp_each
from scenarios.strategies import Scenario, make_model, microbatch, per_token_loss, reference_gradient

pytestmark = pytest.mark.distributed

COUNTS = (((8, 8), (2, 2)), ((3, 1), (8, 7)), ((7, 6), (2, 1)))
"""Valid tokens per (rank, microbatch) of each step (of 8 positions): each step's ranks 3.75× apart or more."""


def bf16_job(rank: int, world_size: int, variant: str, log_dir: str) -> list[dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tokaudit.hooks import Recorder, global_valid_tokens

    model = DDP(make_model().to(torch.bfloat16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    recorder = Recorder(log_dir, run_id=variant, model=model, optimizer=optimizer)
    history = []
    for step, per_rank in enumerate(COUNTS):
        batches = [microbatch(step, rank, micro, count) for micro, count in enumerate(per_rank[rank])]
        global_tokens = global_valid_tokens([labels for _, labels, _ in batches])
        before = [p.detach().double().clone() for p in model.parameters()]
        for micro, (tokens, labels, valid) in enumerate(batches):
            context = model.no_sync() if micro < len(batches) - 1 else torch.enable_grad()
            with context:
                per_token = recorder.probe(per_token_loss(model, tokens, labels), valid)  # bf16 values
                loss_sum = (per_token * valid).sum()
                if variant == "token_mean":
                    scalar = world_size * loss_sum / global_tokens
                else:  # each rank's own mean over its step, the microbatches summed
                    scalar = loss_sum / sum(per_rank[rank])
                recorder.record(loss_sum=loss_sum, valid_tokens=int(valid.sum()), backward_scalar=scalar)
                scalar.backward()
        history.append({"before": before, "grads": [p.grad.detach().double().clone() for p in model.parameters()]})
        optimizer.step()
        optimizer.zero_grad()
    recorder.close()
    return history


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Any]]]:
    root = tmp_path_factory.mktemp("bf16")
    variants = ["token_mean", "local_mean"]
    results = run_ddp_each(bf16_job, 2, variants, str(root))
    return root, dict(zip(variants, results))


@pytest.mark.parametrize("variant, correct", [("token_mean", True), ("local_mean", False)])
def test_a_loss_computed_in_bfloat16_is_judged_at_bfloat16_precision(
    bf16_runs: Any, variant: str, correct: bool
) -> None:
    from tests.logs import read_rows
    from tokaudit._auditing import audit

    root, runs = bf16_runs
    scenario = Scenario(
        name=variant, strategy="token_mean", world_size=2, counts=COUNTS, correct=correct, description=""
    )
    for history in runs[variant]:
        for step, record in enumerate(history):
            want = reference_gradient(record["before"], scenario, step, [0, 1])  # float64 token mean
            # off by what a bf16 forward and backward round (a few 2⁻⁸ of its norm) when right, by far more when not
            error = torch.cat([(g - w).flatten() for g, w in zip(record["grads"], want, strict=True)]).norm()
            scale = torch.cat([w.flatten() for w in want]).norm()
            assert (error < 0.2 * scale) == correct, (variant, step, float(error / scale))
    assert {row["precision_bits"] for row in read_rows(root / variant)} == {8}
    report = audit([root / variant])
    (run,) = report.runs
    assert run.precision_bits == 8 and run.verdict == ("correct" if correct else "incorrect")
    assert {f.code.value for f in report.findings} == (set() if correct else {"local_mean"})
