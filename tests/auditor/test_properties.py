"""Property tests over random counts, zero counts, world sizes and microbatch numbers."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.logs import records, write_by_rank
from tokaudit.audit import audit
from tokaudit.report import AuditReport

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def step_counts(draw: Any) -> list[list[list[int]]]:
    """counts[step][rank][micro]: 1–5 ranks, 1–3 microbatches (the same on every rank), zeros included."""
    world = draw(st.integers(1, 5))
    micro = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 3))
    count = st.one_of(st.just(0), st.integers(0, 40))
    return [[[draw(count) for _ in range(micro)] for _ in range(world)] for _ in range(steps)]


def run(counts: list[list[list[int]]], scalar: Any, **columns: Any) -> AuditReport:
    rows = records(counts, scalar, **columns)
    for row in rows:
        if row.pop("_rescale", False):
            step_tokens = sum(sum(r) for r in counts[row["step"]])
            row["grad_scale"] = row["world_size"] / max(step_tokens, 1)
    with tempfile.TemporaryDirectory() as folder:
        return audit([write_by_rank(Path(folder) / "run", rows)])


def balanced(counts: list[list[list[int]]]) -> bool:
    return all(len({n for rank in step for n in rank}) == 1 for step in counts if sum(map(sum, step)))


def serious(report: AuditReport) -> list[str]:
    return [f.code.value for f in report.findings if f.severity.value != "info"]


@SETTINGS
@given(counts=step_counts(), construction=st.sampled_from(["average", "sum", "rescaled_raw_sum"]))
def test_correct_constructions_always_pass(counts: list[list[list[int]]], construction: str) -> None:
    if construction == "average":  # b = W·S/N into DDP's average (D = W)
        report = run(counts, lambda S, N, W, **_: W * S / max(N, 1))
    elif construction == "sum":  # b = S/N into a summing reduction (D = 1)
        report = run(counts, lambda S, N, **_: S / max(N, 1), grad_divisor=1.0)
    else:  # b = S, then g = W/N after backward (torchtune)
        report = run(counts, lambda S, **_: S, _rescale=True)
    (summary,) = report.runs
    assert serious(report) == []
    has_tokens = any(sum(map(sum, step)) for step in counts)
    if has_tokens and not balanced(counts):
        assert summary.verdict == "correct"
        assert summary.max_weight_ratio == 1.0 or abs(summary.max_weight_ratio - 1) < 1e-9
    else:
        assert summary.verdict == "inconclusive"


@SETTINGS
@given(counts=step_counts())
def test_local_means_are_flagged_whenever_counts_differ(counts: list[list[list[int]]]) -> None:
    # Per-microbatch local mean over accumulation (clamped like OLMo-core: an empty rank gives 0).
    report = run(counts, lambda S, n, M, **_: S / (M * max(n, 1)))
    codes = {f.code.value for f in report.findings}
    nonzero_differ = any(len({n for rank in step for n in rank if n}) > 1 for step in counts)
    # An empty microbatch or rank still counts in W·M: the others are diluted to (records - zeros)/records.
    zeros_dilute = any(0 in {n for rank in step for n in rank} and sum(map(sum, step)) for step in counts)
    if nonzero_differ:
        assert "local_mean" in codes, codes
    if nonzero_differ or zeros_dilute:
        assert report.runs[0].verdict == "incorrect"
    elif sum(sum(map(sum, step)) for step in counts):
        assert report.runs[0].verdict in ("inconclusive", "correct")
