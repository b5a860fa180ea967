"""The README's torchrun example, run for real with torchrun, then audited by tokaudit itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios.harness import finished, torchrun

pytestmark = pytest.mark.distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_token_mean.py"


def check(log_dir: Path) -> tuple[int, dict]:  # type: ignore[type-arg]
    done = subprocess.run([sys.executable, "-m", "tokaudit.cli", "check", str(log_dir), "--format", "json"],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout)


def test_the_fixed_example_is_correct_and_the_mistake_is_caught(tmp_path: Path) -> None:
    # the README's command line, both at once
    readme = (str(EXAMPLE), "--steps", "10")
    finished(torchrun(*readme, "--log-dir", str(tmp_path / "fixed"), "--run-id", "fixed"),
             torchrun(*readme, "--log-dir", str(tmp_path / "broken"), "--run-id", "broken", "--mistake", "local-mean"))
    code, report = check(tmp_path / "fixed")
    assert code == 0 and report["runs"][0]["verdict"] == "correct" and report["findings"] == []
    assert report["runs"][0]["steps"] == 10 and report["runs"][0]["ranks"] == 2
    code, report = check(tmp_path / "broken")
    assert code == 1 and "local_mean" in {f["code"] for f in report["findings"]}


TORCHTITAN = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_style.py"


def test_the_torchtitan_style_example_is_correct(tmp_path: Path) -> None:
    """FSDP2 with a summing reduce-scatter, N all-reduced before the first backward, a compiled loss (traced by
    dynamo as under inductor; aot_eager spares the C++ compiler, seconds a rank, which the probe never sees)."""
    finished(torchrun(str(TORCHTITAN), "--log-dir", str(tmp_path), "--steps", "4", "--compile-backend", "aot_eager"),
             timeout=420)
    code, report = check(tmp_path / "torchtitan_style")
    (run,) = report["runs"]
    assert code == 0 and run["verdict"] == "correct" and report["findings"] == [], report["findings"]
    assert run["divisors"] == [1.0] and run["steps"] == 4 and run["microbatches"] == 2
