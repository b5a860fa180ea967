"""What a user does to a real 2-process run's log never changes its verdict: a pandas-compacted copy left beside
the shards and the same script launched again under the same run id keep a right run `correct` (the float64
reference says it is), with a warning that names the files and the likely cause; an ignored code leaves a wrong
run `incorrect`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from scenarios.harness import run_ddp
from scenarios.strategies import SCENARIOS_BY_NAME, Scenario, reference_gradient, run_scenario
from tokaudit._auditing import audit

pytestmark = pytest.mark.distributed

SCENARIO = SCENARIOS_BY_NAME["correct_token_mean_ga"]


def _launch(folder: Path, scenario: Scenario = SCENARIO, right: bool = True) -> None:
    """The scenario trained on its W ranks, recorded into `folder`; every update the float64 reference's (`right`),
    or none of them."""
    for result in run_ddp(run_scenario, scenario.world_size, scenario, str(folder)):
        for step, record in enumerate(result["recorded"]):
            want = reference_gradient(record["before"], scenario, step, result["members"])
            assert all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want)) == right


def test_a_compacted_copy_and_a_second_launch_keep_a_right_run_correct(tmp_path: Path) -> None:
    _launch(tmp_path)
    run = tmp_path / SCENARIO.name
    shards = sorted(run.glob("*.parquet"))
    pd.concat([pd.read_parquet(s) for s in shards]).to_parquet(run / "compacted.parquet")  # pandas' defaults
    report = audit([run])
    (finding,) = report.findings
    assert report.runs[0].verdict == "correct" and finding.code.value == "duplicate_records"
    assert "compacted.parquet" in finding.message and "bit-identical copies" in finding.message
    (run / "compacted.parquet").unlink()

    _launch(tmp_path)  # the same script again, the same run id, the same folder
    report = audit([run])
    (finding,) = report.findings
    assert report.runs[0].verdict == "correct" and finding.code.value == "duplicate_records"
    assert "re-launch" in finding.message and len(finding.evidence["files"]) >= 2


def test_a_relaunch_with_fewer_microbatches_keeps_a_right_run_correct(tmp_path: Path) -> None:
    """The same run id launched again into the same folder with M = 1 where the first launch had M = 2, both the
    token mean by the float64 reference: each rank's step is the later launch's records alone (the earlier
    launch's second microbatches are no part of it), and the warning counts the records it superseded."""
    _launch(tmp_path)
    _launch(tmp_path, replace(SCENARIO, counts=tuple(tuple(mine[:1] for mine in step) for step in SCENARIO.counts)))
    report = audit([tmp_path / SCENARIO.name])
    (finding,) = report.findings
    assert report.runs[0].verdict == "correct" and finding.code.value == "duplicate_records", report.findings
    # of the first launch's 3 steps × 2 ranks × 2 microbatches: the 6 first microbatches are copies of a key the
    # second recorded again, the 6 second ones no key of the second's
    assert finding.evidence["dropped_records"] == 6 and finding.evidence["superseded_records"] == 6


def test_a_run_launched_again_on_fewer_ranks_is_the_later_launch_s_at_each_step_it_recorded(tmp_path: Path) -> None:
    """The run on 4 ranks, then the same run id launched again into the same folder on 3, then on 2 (a job resumed on
    fewer GPUs, its steps numbered again from 0 each time), every launch the token mean by the float64 reference:
    each step is the last launch's W = 2 records alone. The earlier launches' ranks that no later record replaces
    (rank 3 of the first, rank 2 of the second, whose latest records say W = 3) stayed beside them
    (world_size_inconsistent, unexplained_weighting: incorrect); the warning counts them."""
    wide = SCENARIOS_BY_NAME["correct_token_mean_w3"]
    four = ((5, 1), (3, 7), (2, 2), (4, 3)), ((0, 0), (6, 2), (8, 1), (2, 5)), ((8, 4), (2, 8), (1, 0), (3, 3))
    _launch(tmp_path, replace(wide, name=SCENARIO.name, world_size=4, counts=four))
    _launch(tmp_path, replace(wide, name=SCENARIO.name))
    _launch(tmp_path, SCENARIO)
    report = audit([tmp_path / SCENARIO.name])
    (finding,) = report.findings
    assert report.runs[0].verdict == "correct" and finding.code.value == "duplicate_records", report.findings
    # rank 3's records of the first launch and rank 2's of the second (the first's repeated by the second's)
    assert finding.evidence["superseded_records"] == 12 and finding.evidence["dropped_records"] == 30


def test_a_wrong_launch_replaced_by_one_on_fewer_ranks_is_judged_alone_whole(tmp_path: Path) -> None:
    """A rank-local mean on 3 ranks (wrong by the float64 reference), then the run launched again on 2, the token mean,
    its steps numbered from 0 again: the kept records are right, and the earlier launch judged alone must be all of
    it, its rank 2 included, whose records no later record repeats (without it the earlier launch's steps lacked a
    rank and said nothing of their weights: correct)."""
    wrong = replace(
        SCENARIOS_BY_NAME["correct_token_mean_w3"], name=SCENARIO.name, strategy="local_mean", correct=False
    )
    _launch(tmp_path, wrong, right=False)
    _launch(tmp_path)
    report = audit([tmp_path / SCENARIO.name])
    (finding,) = report.findings
    assert finding.code.value == "duplicate_records" and report.runs[0].verdict == "inconclusive", report.findings
    assert "Judged alone, the earlier launch's records weigh their tokens wrong (local_mean)" in finding.message


def test_ignoring_a_code_never_greens_a_wrong_run(tmp_path: Path) -> None:
    """A rank-local mean on 2 real processes (the float64 reference says it is not the token mean), audited with
    local_mean ignored, as a CI job quieted by one --ignore: the verdict stays incorrect; the gate passes and says so."""
    from tokaudit.testing import assert_token_mean

    scenario = SCENARIOS_BY_NAME["bug_local_mean"]
    _launch(tmp_path, scenario, right=False)
    report = audit([tmp_path / scenario.name], ignore=["local_mean", "reported_loss_mismatch"])
    (run,) = report.runs
    assert report.findings == [] and run.verdict == "incorrect" and run.gate_verdict == "correct"
    assert run.ignored == ["local_mean", "reported_loss_mismatch"] and run.decided_by == ["local_mean"]
    assert_token_mean(tmp_path / scenario.name, ignore=["local_mean", "reported_loss_mismatch"])  # the gate


def test_a_resume_that_numbers_its_steps_again_over_wrong_updates_is_inconclusive(tmp_path: Path) -> None:
    """A first launch trains 3 updates with a rank-local mean over the accumulation (wrong by the float64 reference);
    the run is resumed under the same run id and folder, the bug fixed, and its 3 token-mean updates numbered 0–2
    again (no begin_step). The later records are kept and are right; but judged alone the earlier ones are wrong,
    and whether the later launch started from a checkpoint after them (they trained the model) or replayed them
    from an earlier one, the logs cannot tell: inconclusive, where it read correct. Both launches right: correct
    (`test_a_compacted_copy_and_a_second_launch_keep_a_right_run_correct`)."""
    wrong = replace(SCENARIOS_BY_NAME["bug_local_mean_accumulation"], name=SCENARIO.name)
    _launch(tmp_path, wrong, right=False)
    _launch(tmp_path)
    report = audit([tmp_path / SCENARIO.name])
    (finding,) = report.findings
    assert (
        finding.code.value == "duplicate_records" and finding.undecidable and report.runs[0].verdict == "inconclusive"
    )
    assert "Judged alone, the earlier launch's records weigh their tokens wrong (local_mean)" in finding.message
