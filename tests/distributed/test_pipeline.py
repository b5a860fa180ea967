"""Two-stage pipeline schedules (GPipe, 1F1B) in real gloo processes, with and without the schedule's own
division (`scale_grads`), with gradient accumulation over several `step()` calls: the float64 reference of
the token mean decides which set-ups are correct, then tokaudit must agree.

The schedule's first `step()` calls `loss_fn` once more to infer shapes: that call is never a microbatch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scenarios.harness import run_ddp_each
from scenarios.pipeline import UPDATES, PipelineSetup, job, reference_gradient, update_tokens
from tests.logs import read_rows
from tokaudit._auditing import audit

pytestmark = pytest.mark.distributed

# name: (set-up, the codes tokaudit must find); correct set-ups have none
SETUPS: dict[str, tuple[PipelineSetup, set[str]]] = {
    s.name: (s, codes)
    for s, codes in [
        (PipelineSetup("gpipe_sum", "gpipe", scale_grads=False, calls=1, loss="sum_over_n"), set()),
        (PipelineSetup("gpipe_scaled", "gpipe", scale_grads=True, calls=1, loss="scaled"), set()),
        (
            PipelineSetup("gpipe_divided_twice", "gpipe", scale_grads=True, calls=1, loss="sum_over_n"),
            {"schedule_rescaled"},
        ),
        (PipelineSetup("1f1b_accumulated", "1f1b", scale_grads=False, calls=2, loss="sum_over_n"), set()),
        (
            PipelineSetup("1f1b_accumulated_divided", "1f1b", scale_grads=True, calls=2, loss="sum_over_n"),
            {"schedule_rescaled"},
        ),
        (  # M·S/N is right for one call; the first call's gradients are divided again by the second
            PipelineSetup("1f1b_accumulated_scaled", "1f1b", scale_grads=True, calls=2, loss="scaled"),
            {"schedule_rescaled"},
        ),
        (
            PipelineSetup("gpipe_captured_mean", "gpipe", scale_grads=True, calls=1, loss="captured_mean"),
            {"local_mean"},
        ),
        (  # the Recorder given no group: W the world's 2, of which only the last stage records
            PipelineSetup("gpipe_no_group", "gpipe", scale_grads=False, calls=1, loss="sum_over_n", grouped=False),
            {"ranks_not_recorded"},
        ),
    ]
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[list[dict[str, Any]]]]]:
    root = tmp_path_factory.mktemp("pipeline")
    setups = [setup for setup, _ in SETUPS.values()]
    histories = {setup.name: by_rank for setup, by_rank in zip(setups, run_ddp_each(job, 2, setups, str(root)))}
    return root, histories


def _trains_the_token_mean(setup: PipelineSetup, by_rank: list[list[dict[str, Any]]]) -> list[bool]:
    """Per update: the two stages' gradients together equal the float64 reference of the token mean."""
    agree = []
    for update in range(UPDATES):
        before = [p for rank in (0, 1) for p in by_rank[rank][update]["before"]]
        grads = [g for rank in (0, 1) for g in by_rank[rank][update]["grads"]]
        want = reference_gradient(before, update, setup.calls)
        agree.append(all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(grads, want, strict=True)))
    return agree


@pytest.mark.parametrize("name", list(SETUPS))
def test_the_verdict_agrees_with_the_float64_reference(recorded: Any, name: str) -> None:
    root, histories = recorded
    setup, codes = SETUPS[name]
    agree = _trains_the_token_mean(setup, histories[name])
    report = audit([root / name])
    (run,) = report.runs
    assert {f.code.value for f in report.findings} == codes
    if all(agree):  # right, and judged so where the records are all there
        assert run.verdict == ("inconclusive" if codes == {"ranks_not_recorded"} else "correct")
        assert codes <= {"ranks_not_recorded"}
    else:
        assert not any(agree) and run.verdict == "incorrect"


@pytest.mark.parametrize("name", list(SETUPS))
def test_the_shape_inference_call_is_no_microbatch(recorded: Any, name: str) -> None:
    """One record per microbatch of every step() call, and each update's N is its own tokens' count."""
    root, _ = recorded
    setup, _ = SETUPS[name]
    rows = read_rows(root / name)
    for update in range(UPDATES):
        mine = [row for row in rows if row["step"] == update]
        assert sorted(row["micro"] for row in mine) == list(range(setup.microbatches * setup.calls))
        assert sum(row["valid_tokens"] for row in mine) == update_tokens(update, setup.calls)


def test_the_schedule_s_division_names_the_schedule(recorded: Any) -> None:
    root, _ = recorded
    once = audit([root / "gpipe_divided_twice"]).findings[0]
    assert once.evidence["schedule_divisor"] == 2 and once.evidence["divisions"] == [1]
    accumulated = audit([root / "1f1b_accumulated_divided"]).findings[0]
    assert accumulated.evidence["divisions"] == [1, 2]
    assert "scale_grads=False" in accumulated.fix
    scaled = audit([root / "1f1b_accumulated_scaled"]).findings[0]
    assert scaled.evidence["divisions"] == [0, 1] and "a loss of 2·S/N, right for one step() call" in scaled.message


def test_a_pipeline_s_recorder_without_its_group_is_told_to_take_the_last_stage_s(recorded: Any) -> None:
    root, _ = recorded
    (finding,) = audit([root / "gpipe_no_group"]).findings
    assert finding.code.value == "ranks_not_recorded" and "last stage with group= their data-parallel" in finding.fix
