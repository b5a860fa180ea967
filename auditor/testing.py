"""pytest helpers: fail a test when a recorded run is not the token mean.

from tokaudit.testing import assert_token_mean

def test_two_rank_training_is_token_mean(tmp_path):
    run_my_trainer(log_dir=tmp_path, steps=3, world_size=2)   # records with tokaudit.hooks
    assert_token_mean(tmp_path)
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tokaudit._auditing import audit
from tokaudit.codes import DEFAULT_RTOL, Code
from tokaudit._render.text import steps_text
from tokaudit._report import AuditReport


def assert_token_mean(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    ignore: Sequence[str | Code] = (),
    min_ratio: float | None = None,
    rtol: float = DEFAULT_RTOL,
    allow_inconclusive: bool = False,
) -> AuditReport:
    """Audit the logs under `paths`; raise AssertionError, with every finding and its fix, unless every
    run passes the gate, `correct` (or `inconclusive` when allowed), and every file could be read. Returns the
    report. `ignore`: codes a gate accepts, as `tokaudit check --ignore`; `min_ratio`: weighting findings below it
    are information, as `--min-ratio` (the verdict still counts both; the gate not)."""
    report = audit(paths, rtol=rtol, ignore=ignore, min_ratio=min_ratio)
    accepted = {"correct", "inconclusive"} if allow_inconclusive else {"correct"}
    failures = [f"unreadable: {problem}" for problem in report.problems]
    if not report.runs:
        failures.append("no run was recorded under the given paths")
    for run in report.runs:
        if (run.gate_verdict or run.verdict) not in accepted:
            failures.append(f"run {run.run!r} is {run.verdict}")
    if failures:
        details = [
            f"  {f.severity.value} {f.code.value} ({f.run}, steps {steps_text(f.steps)}): {f.message}\n    fix: {f.fix}"
            for f in report.findings
            if f.severity.value != "info"
        ]
        raise AssertionError("tokaudit: " + "; ".join(failures) + ("\n" + "\n".join(details) if details else ""))
    return report
