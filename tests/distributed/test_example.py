"""The README's torchrun example, run for real with torchrun, then audited by tokaudit itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_token_mean.py"


def torchrun(log_dir: Path, *extra: str) -> subprocess.Popen[str]:
    """The README's command line, started (two at once share the cores: each is mostly start-up)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--log-dir",
                             str(log_dir), "--steps", "10", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={"PATH": "/usr/bin:/bin", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})


def finished(*runs: subprocess.Popen[str]) -> None:
    for run in runs:
        try:
            _, errors = run.communicate(timeout=180)
        finally:
            run.kill()
        assert run.returncode == 0, errors[-3000:]


def check(log_dir: Path) -> tuple[int, dict]:  # type: ignore[type-arg]
    done = subprocess.run([sys.executable, "-m", "tokaudit.cli", "check", str(log_dir), "--format", "json"],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads(done.stdout)


def test_the_fixed_example_is_correct_and_the_mistake_is_caught(tmp_path: Path) -> None:
    finished(torchrun(tmp_path / "fixed", "--run-id", "fixed"),
             torchrun(tmp_path / "broken", "--run-id", "broken", "--mistake", "local-mean"))
    code, report = check(tmp_path / "fixed")
    assert code == 0 and report["runs"][0]["verdict"] == "correct" and report["findings"] == []
    assert report["runs"][0]["steps"] == 10 and report["runs"][0]["ranks"] == 2
    code, report = check(tmp_path / "broken")
    assert code == 1 and "local_mean" in {f["code"] for f in report["findings"]}


TORCHTITAN = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_style.py"


def test_the_torchtitan_style_example_is_correct(tmp_path: Path) -> None:
    """FSDP2 with a summing reduce-scatter, N all-reduced before the first backward, a compiled loss."""
    torchrun_path = Path(sys.executable).with_name("torchrun")
    subprocess.run([str(torchrun_path), "--standalone", "--nproc-per-node", "2", str(TORCHTITAN), "--log-dir",
                    str(tmp_path), "--steps", "4"], check=True, capture_output=True, timeout=420,
                   env={"PATH": "/usr/bin:/bin", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    code, report = check(tmp_path / "torchtitan_style")
    (run,) = report["runs"]
    assert code == 0 and run["verdict"] == "correct" and report["findings"] == [], report["findings"]
    assert run["divisors"] == [1.0] and run["steps"] == 4 and run["microbatches"] == 2
