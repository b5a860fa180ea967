"""The examples, run as their docs run them and audited by tokaudit: the README's torchrun command line for real
with torchrun and `tokaudit check`; its mistake and the torchtitan-style loop as torchrun runs a script (two
processes with its environment, `launch`), audited by `tokaudit.audit`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios.harness import finished, launch, torchrun
from tokaudit import audit

pytestmark = pytest.mark.distributed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "torchrun_token_mean.py"
TORCHTITAN = EXAMPLES / "torchtitan_style.py"


def test_the_fixed_example_is_correct_and_the_mistake_is_caught(tmp_path: Path) -> None:
    readme = (str(EXAMPLE), "--steps", "10")
    fixed = torchrun(*readme, "--log-dir", str(tmp_path / "fixed"), "--run-id", "fixed")
    try:  # the mistake meanwhile, in the suite's own processes
        launch(*readme, "--log-dir", str(tmp_path / "broken"), "--run-id", "broken", "--mistake", "local-mean")
    finally:
        finished(fixed)
    done = subprocess.run(
        [sys.executable, "-m", "tokaudit.cli", "check", str(tmp_path / "fixed"), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["runs"][0]["verdict"] == "correct" and report["findings"] == []
    assert report["runs"][0]["steps"] == 10 and report["runs"][0]["ranks"] == 2
    broken = audit([tmp_path / "broken"])
    assert broken.runs[0].verdict == "incorrect" and "local_mean" in {f.code.value for f in broken.findings}


def test_the_torchtitan_style_example_is_correct(tmp_path: Path) -> None:
    """FSDP2 with a summing reduce-scatter, N all-reduced before the first backward, a compiled loss (traced by
    dynamo as under inductor; aot_eager spares the C++ compiler, seconds a rank, which the probe never sees)."""
    launch(str(TORCHTITAN), "--log-dir", str(tmp_path), "--steps", "4", "--compile-backend", "aot_eager", timeout=420)
    report = audit([tmp_path / "torchtitan_style"])
    (run,) = report.runs
    assert run.verdict == "correct" and report.findings == [], report.findings
    assert run.divisors == [1.0] and run.steps == 4 and run.microbatches == 2
