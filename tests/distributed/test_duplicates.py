"""What a user does to a real 2-process run's log never changes its verdict: a pandas-compacted copy left beside
the shards and the same script launched again under the same run id keep a right run `correct` (the float64
reference says it is), with a warning that names the files and the likely cause; an ignored code leaves a wrong
run `incorrect`."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from scenarios.harness import run_ddp
from scenarios.strategies import SCENARIOS_BY_NAME, reference_gradient, run_scenario
from tokaudit._auditing import audit

pytestmark = pytest.mark.distributed

SCENARIO = SCENARIOS_BY_NAME["correct_token_mean_ga"]


def _launch(folder: Path) -> None:
    for result in run_ddp(run_scenario, 2, SCENARIO, str(folder)):
        for step, record in enumerate(result["recorded"]):
            want = reference_gradient(record["before"], SCENARIO, step, result["members"])
            assert all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want))


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


def test_ignoring_a_code_never_greens_a_wrong_run(tmp_path: Path) -> None:
    """A rank-local mean on 2 real processes (the float64 reference says it is not the token mean), audited with
    local_mean ignored, as a CI job quieted by one --ignore: the verdict stays incorrect; the gate passes and says so."""
    from tokaudit.testing import assert_token_mean

    scenario = SCENARIOS_BY_NAME["bug_local_mean"]
    for result in run_ddp(run_scenario, 2, scenario, str(tmp_path)):
        for step, record in enumerate(result["recorded"]):
            want = reference_gradient(record["before"], scenario, step, result["members"])
            assert not all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want))
    report = audit([tmp_path / scenario.name], ignore=["local_mean", "reported_loss_mismatch"])
    (run,) = report.runs
    assert report.findings == [] and run.verdict == "incorrect" and run.gate_verdict == "correct"
    assert run.ignored == ["local_mean", "reported_loss_mismatch"] and run.decided_by == ["local_mean"]
    assert_token_mean(tmp_path / scenario.name, ignore=["local_mean", "reported_loss_mismatch"])  # the gate
