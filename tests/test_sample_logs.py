"""`tokaudit check sample_logs/` names each deliberate mistake and passes the correct runs."""

from __future__ import annotations

import json
from pathlib import Path

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
