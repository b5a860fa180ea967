"""Accelerate, run as `accelerate launch` runs it on CPU (torchrun's environment, 2 processes, gloo), with
gradient accumulation 2 and the one-line attach `Recorder(..., accelerator=accelerator)`: the float64
reference says which loop trains the token mean, and the audit agrees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scenarios.accelerate_job import COUNTS, MANUAL_COUNTS
from scenarios.harness import launch
from scenarios.strategies import Scenario, reference_gradient
from tests.logs import read_rows
from tests.needs import needs_integration
from tokaudit._auditing import audit

pytestmark = [needs_integration("accelerate"), pytest.mark.distributed]


VARIANTS = ("token_mean", "local_mean", "manual_no_sync", "all_no_sync")


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("accelerate")
    for variant in VARIANTS:  # as torchrun, which `accelerate launch` uses on CPU, runs it
        launch("-m", "scenarios.accelerate_job", "--log-dir", str(root), "--variant", variant)
    return root


@pytest.mark.parametrize(
    "variant, correct, codes",
    [
        ("token_mean", True, set()),
        ("local_mean", False, {"local_mean"}),
        # no accelerator.accumulate(): the recorder reads each backward's sync from the DDP wrapper Accelerate
        # made (it keeps the bare module), not from sync_gradients, True outside accumulate()
        ("manual_no_sync", True, set()),
        ("all_no_sync", False, {"missing_sync"}),
    ],
)
def test_the_verdict_follows_the_float64_reference(runs: Path, variant: str, correct: bool, codes: set[str]) -> None:
    history: list[dict[str, Any]] = torch.load(runs / f"{variant}.pt")
    counts = MANUAL_COUNTS if variant.endswith("no_sync") else COUNTS
    scenario = Scenario(
        name=variant, strategy="token_mean", world_size=2, counts=counts, correct=correct, description=""
    )
    agree = [
        all(
            torch.allclose(g, w, rtol=1e-9, atol=1e-12)
            for g, w in zip(record["grads"], reference_gradient(record["before"], scenario, step, [0, 1]), strict=True)
        )
        for step, record in enumerate(history)
    ]
    assert agree == [correct] * len(counts)
    report = audit([runs / f"accelerate_{variant}"])
    (run,) = report.runs
    assert {f.code.value for f in report.findings} == codes
    assert run.verdict == ("correct" if correct else "incorrect")
    # The wrapped optimizer's step() runs every microbatch; an update is counted once, at the sync.
    assert run.steps == len(counts) and run.microbatches == 2 and run.divisors == [2.0]


def test_the_log_holds_what_accelerator_backward_backpropagated(runs: Path) -> None:
    rows = read_rows(runs / "accelerate_token_mean")
    for row in rows:
        # b = GA·W·S/N before accelerator.backward, which divides by GA: the log holds W·S/N, so the
        # probe's Σ weights (of the same backward) equals b/S per token sum.
        assert row["backward_scalar"] == pytest.approx(row["token_weight_sum"] * row["loss_sum"] / row["valid_tokens"])
        assert row["sync"] is (row["micro"] == 1)


ACCELERATE_LOOP = """
import sys, warnings
import torch
from accelerate import Accelerator
from tokaudit.hooks import Recorder

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
model = torch.nn.Linear(4, 3)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
with warnings.catch_warnings():
    warnings.simplefilter("error")  # nothing to warn about: the wrapped optimizer is unwrapped
    rec = Recorder(sys.argv[1], run_id="wrapped", optimizer=optimizer)
for update in range(2):
    for micro in range(2):
        with accelerator.accumulate(model):
            loss_sum = torch.nn.functional.cross_entropy(model(torch.randn(5, 4)), torch.arange(5) % 3,
                                                         reduction="sum")
            loss = loss_sum / 10
            rec.record(loss_sum=loss_sum, valid_tokens=5, backward_scalar=loss)
            accelerator.backward(loss)
            optimizer.step()  # Accelerate's wrapper: reaches SGD on the update's last microbatch only
            optimizer.zero_grad()
rec.close()
"""


def test_accelerates_optimizer_wrapper_is_unwrapped_and_counts_updates_once(tmp_path: Path) -> None:
    """`Recorder(optimizer=...)` given Accelerate's wrapped optimizer, whose step() runs every microbatch, in one
    process of its own (Accelerator keeps process-wide state)."""
    script = tmp_path / "loop.py"
    script.write_text(ACCELERATE_LOOP)
    launch(str(script), str(tmp_path), world_size=1)
    rows = read_rows(tmp_path / "wrapped")
    assert [(r["step"], r["micro"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
