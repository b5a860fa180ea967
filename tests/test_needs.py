"""`make test` fails where a test was skipped for a package the set-up should have installed (tests/needs.py), and
only there: a skip for a missing device or a root user still skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # fresh pytest processes

ROOT = Path(__file__).resolve().parents[1]

SKIPPING = """
import pytest
from tests.needs import needs

@needs("tokaudit_no_such_package")
def test_marked():
    pass

def test_imported():
    pytest.importorskip("tokaudit_no_such_module")

def test_no_device():
    pytest.skip("needs a CUDA device")

def test_passes():
    assert True
"""


def run_pytest(folder: Path, require: bool, *options: str) -> subprocess.CompletedProcess[str]:
    (folder / "test_skipping.py").write_text(SKIPPING)
    (folder / "pytest.ini").write_text("[pytest]\n")
    env = {key: value for key, value in os.environ.items() if key != "TOKAUDIT_REQUIRE_EXTRAS"}
    env["PYTHONPATH"] = str(ROOT)
    if require:
        env["TOKAUDIT_REQUIRE_EXTRAS"] = "1"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.needs",
            "-c",
            str(folder / "pytest.ini"),
            "--rootdir",
            str(folder),
            *options,
            str(folder / "test_skipping.py"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_skip_for_a_missing_package_fails_the_run_where_every_extra_is_required(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, True, "-n", "2")  # as `make test` runs: the workers' skips reach the controller
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 test(s) skipped for a missing package" in done.stdout
    assert "test_marked: not installed: tokaudit_no_such_package" in done.stdout
    assert "test_imported: could not import 'tokaudit_no_such_module'" in done.stdout
    assert "test_no_device" not in done.stdout.split("skipped for a missing package")[1]


def test_the_same_skips_pass_where_extras_are_not_required(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 3 skipped" in done.stdout
