"""An auxiliary loss of data only one rank has, in real DDP on 2 gloo processes (`scenarios.partial_term`): rank 1
records the main loss alone and never runs the auxiliary head. The gradient is the float64 reference's (the main
token mean plus the auxiliary one over rank 0's tokens), and the audit says the run correct, the term's missing rank
an info (it read `incorrect`: a rank that skipped backward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scenarios.harness import run_ddp
from scenarios.partial_term import COUNTS, job, reference_gradient
from tokaudit._auditing import audit
from tokaudit.codes import Code, Severity

pytestmark = pytest.mark.distributed


def test_an_auxiliary_loss_of_one_rank_s_data_is_correct_and_its_missing_rank_an_info(tmp_path: Path) -> None:
    ranks = run_ddp(job, 2, str(tmp_path))
    for step in range(len(COUNTS)):
        record = ranks[0]["history"][step]
        want = reference_gradient(record["before"], step)
        assert all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want)), step
    report = audit([tmp_path / "partial_term"])
    (run,) = report.runs
    assert run.verdict == "correct" and run.terms == ["0", "aux"], [f.message for f in report.findings]
    (finding,) = report.findings
    assert finding.code == Code.MISSING_RANK and finding.severity == Severity.INFO and finding.term == "aux"
    assert finding.evidence["missing_ranks"] == [1] and finding.steps.count == len(COUNTS)
