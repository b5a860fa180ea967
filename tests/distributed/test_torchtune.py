"""torchtune's recipe (a summed loss, then `training.scale_grads(model, W/N)` after backward) in real DDP on 2
gloo processes: the float64 reference of the token mean decides, and tokaudit agrees once the rescale is told
(`rec.scale_grads`); the same recipe with the W left out is caught as a world-size factor."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
import torch

from scenarios.harness import run_ddp_each
from scenarios.strategies import reference_gradient
from scenarios.torchtune_recipe import COUNTS, EMPTY_MICRO, TuneSetup, job
from tokaudit._auditing import audit

pytestmark = pytest.mark.distributed

SETUPS = [
    TuneSetup("tune_recipe", "w_over_n", told=True),
    TuneSetup("tune_missing_w", "one_over_n", told=True),
    TuneSetup("tune_untold", "w_over_n", told=False),
    TuneSetup("tune_before_shift", "w_over_n", told=True, before_shift=True),
    TuneSetup("tune_empty_micro", "w_over_n", told=True, counts=EMPTY_MICRO),
]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[list[dict[str, Any]]]]]:
    root = tmp_path_factory.mktemp("torchtune")
    return root, {s.name: ranks for s, ranks in zip(SETUPS, run_ddp_each(job, 2, SETUPS, str(root)))}


def _agrees(
    setup: TuneSetup,
    by_rank: list[list[dict[str, Any]]],
    weights: Callable[[int], dict[tuple[int, int], float]] | None = None,
) -> list[bool]:
    out = []
    for step in range(len(COUNTS)):
        record = by_rank[0][step]
        want = reference_gradient(record["before"], setup.scenario, step, [0, 1], weights and weights(step))
        out.append(all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want)))
    return out


def test_the_recipe_told_its_rescale_is_correct(recorded: Any) -> None:
    root, histories = recorded
    assert all(_agrees(SETUPS[0], histories["tune_recipe"]))
    report = audit([root / "tune_recipe"])
    # torchtune syncs every microbatch (no no_sync): right, and said as information
    assert [f.code.value for f in report.findings] == ["sync_every_micro"]
    assert report.runs[0].verdict == "correct"


def test_the_missing_w_is_caught(recorded: Any) -> None:
    root, histories = recorded
    assert not any(_agrees(SETUPS[1], histories["tune_missing_w"]))
    report = audit([root / "tune_missing_w"])
    assert [f.code.value for f in report.findings] == ["world_size_mismatch", "sync_every_micro"]
    assert report.runs[0].verdict == "incorrect" and report.findings[0].evidence["distortion"] == pytest.approx(0.5)


def test_an_untold_rescale_is_named_in_the_message(recorded: Any) -> None:
    """Unseen, the rescale leaves b = S (a raw sum): the finding says how to tell the recorder."""
    root, histories = recorded
    assert all(_agrees(SETUPS[2], histories["tune_untold"]))
    report = audit([root / "tune_untold"])
    assert report.runs[0].verdict != "correct"
    assert any("rec.scale_grads" in f.message + f.fix for f in report.findings)


def test_a_count_taken_before_the_shift_is_named(recorded: Any) -> None:
    """torchtune's recipe counts batch["labels"] before the shift: each microbatch's mean times n + 1 (one row),
    over N + R. The float64 reference with those weights is what trained; the token mean is not."""
    root, histories = recorded

    def shifted(step: int) -> dict[tuple[int, int], float]:
        # e = (n + 1) / (n · ΣN_pre), N_pre = Σ (n + 1) over the step's microbatches of every rank
        total = sum(n + 1 for rank in COUNTS[step] for n in rank)
        return {(r, m): (n + 1) / (n * total) for r, rank in enumerate(COUNTS[step]) for m, n in enumerate(rank)}

    history = histories["tune_before_shift"]
    assert not any(_agrees(SETUPS[3], history)) and all(_agrees(SETUPS[3], history, shifted))
    report = audit([root / "tune_before_shift"])
    (finding, _) = report.findings
    assert finding.code.value == "unexplained_weighting" and report.runs[0].verdict == "incorrect"
    assert finding.evidence["extra_labels_per_record"] == 1
    assert "before the causal shift" in finding.message and "labels[..., 1:]" in finding.fix


def test_an_empty_microbatch_s_nan_that_never_reaches_the_weights_is_information(recorded: Any) -> None:
    """torchtune's chunked mean times the count on a microbatch of no valid label: 0/0·0 = NaN is its backward
    scalar, but cross-entropy's backward gives each ignored position an exact 0, so the gradient is the token mean's
    (the float64 reference) and the step after is finite: information, and the run correct."""
    root, histories = recorded
    assert all(_agrees(SETUPS[4], histories["tune_empty_micro"]))
    report = audit([root / "tune_empty_micro"])
    zero = [f for f in report.findings if f.code.value == "zero_token_nonfinite"]
    assert [f.severity.value for f in zero] == ["info"] and zero[0].steps.first == 0
    assert report.runs[0].verdict == "correct"
