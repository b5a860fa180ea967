"""`tokaudit check sample_logs/` names each deliberate mistake and passes the correct runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.expected import EXPECTED_CODES, EXPECTED_NORMALIZATION, EXPECTED_VERDICT
from tokaudit.cli import main

SAMPLE_LOGS = Path(__file__).resolve().parents[1] / "sample_logs"


def test_sample_logs_are_diagnosed() -> None:
    result = CliRunner().invoke(main, ["check", str(SAMPLE_LOGS), "--format", "json"])
    assert result.exit_code == 1, result.stderr
    report = json.loads(result.stdout)
    runs = {r["run"]: r for r in report["runs"]}
    assert set(runs) == set(EXPECTED_CODES)
    for run, codes in EXPECTED_CODES.items():
        found = {f["code"] for f in report["findings"] if f["run"] == run}
        assert found == codes, (run, found)
        assert runs[run]["verdict"] == EXPECTED_VERDICT[run], run
        if run in EXPECTED_NORMALIZATION:
            denominator, factor = EXPECTED_NORMALIZATION[run]
            assert runs[run]["normalization"] == {"denominator": denominator, "factor": factor}, run


def test_sample_logs_have_a_readme_per_scenario() -> None:
    readme = (SAMPLE_LOGS / "README.md").read_text()
    for run in EXPECTED_CODES:
        assert f"`{run}/`" in readme


@pytest.mark.slow
def test_evidence_from_the_one_query_is_the_evidence_of_each_step_aggregated_alone(monkeypatch: Any) -> None:
    """A small log aggregates every step's evidence (where its heaviest and lightest token were) in the
    one query; a large one aggregates a finding's step again alone (`engine.extremes_at`). Both give the
    same report on the recorded DDP runs, and the small log's audit aggregates no step again."""
    import tokaudit._auditing as auditing
    import tokaudit._opening as opening
    from tokaudit._render.json_report import render_json

    calls: list[int] = []
    original = auditing.extremes_at

    def counted(shards: Any, step: int, *rest: Any) -> Any:
        calls.append(step)
        return original(shards, step, *rest)

    monkeypatch.setattr(auditing, "extremes_at", counted)
    one_query = auditing.audit(SAMPLE_LOGS, keep_steps=True)
    assert not calls
    monkeypatch.setattr(opening, "EVIDENCE_ROWS", 0)
    alone = auditing.audit(SAMPLE_LOGS, keep_steps=True)
    assert calls  # the weighting findings' steps, read again
    assert any("heaviest" in f.evidence for f in one_query.findings)
    assert render_json(one_query) == render_json(alone)
    assert one_query.steps is not None and alone.steps is not None
    assert list(one_query.steps.columns) == list(alone.steps.columns)  # the same table whatever the size


def test_one_rank_s_file_given_alone_is_said_and_inconclusive() -> None:
    """`tokaudit check` on one rank's shard of a real 2-rank DDP run: the files hold 1 of W=2 ranks' records, so
    no N is whole: inconclusive (exit 0), and no advice to change a loss that may well be right."""
    result = CliRunner().invoke(
        main, ["check", str(SAMPLE_LOGS / "bug_local_mean" / "rank-00000-000000.parquet"), "--format", "json"]
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert [f["code"] for f in report["findings"]] == ["ranks_not_recorded"]
    assert report["runs"][0]["verdict"] == "inconclusive"


def test_a_right_gradient_with_a_wrong_logged_loss_is_correct_and_says_the_loss_differs() -> None:
    """A real DDP loop that backpropagates W·S/N (the float64 reference agrees) but logs the mean of per-rank
    means: the verdict is about the gradient, `correct`, exit 0; the logged loss is `reporting: differs`
    beside it, with its finding, and fails a CI gate that asks for no warning."""
    run = str(SAMPLE_LOGS / "correct_token_mean_reported_local_means")
    result = CliRunner().invoke(main, ["check", run, "--format", "json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["runs"][0]["verdict"], report["runs"][0]["reporting"]) == ("correct", "differs")
    assert [f["code"] for f in report["findings"]] == ["reported_loss_mismatch"]
    assert CliRunner().invoke(main, ["check", run, "--fail-on", "warning"]).exit_code == 1
    table = CliRunner().invoke(main, ["check", run], env={"COLUMNS": "200"})
    assert "correct (reported loss differs)" in table.stdout
    matches = json.loads(
        CliRunner().invoke(main, ["check", str(SAMPLE_LOGS / "correct_token_mean_ga"), "--format", "json"]).stdout
    )
    assert matches["runs"][0]["reporting"] == "matches"


def test_the_curve_of_terms_that_are_one_token_mean_is_their_pooled_mean() -> None:
    """chunked_cross_entropy_named: three chunks of one loss, each recorded as a term. The curve's true loss is
    ΣS/ΣN over every chunk's records (summed here from the log), which the optimized objective equals."""
    from tests.logs import read_rows

    result = CliRunner().invoke(
        main, ["curve", str(SAMPLE_LOGS), "--run", "chunked_cross_entropy_named", "--format", "json"]
    )
    assert result.exit_code == 0, result.stderr
    curve = json.loads(result.stdout)
    assert curve["series"]["token_mean"] == "ΣS/N (true, all terms)"
    rows = read_rows(SAMPLE_LOGS / "chunked_cross_entropy_named")
    assert len({r["term"] for r in rows}) == 3
    for step in curve["steps"]:
        mine = [r for r in rows if r["step"] == step["step"]]
        pooled = sum(r["loss_sum"] for r in mine) / sum(r["valid_tokens"] for r in mine)
        assert step["tokens"] == sum(r["valid_tokens"] for r in mine)
        assert step["token_mean"] == pytest.approx(pooled, rel=1e-12)
        assert step["optimized"] == pytest.approx(pooled, rel=1e-6)
