"""Property tests: random partitions of tokens over ranks × microbatches × loss terms.

Every correct construction is `correct`, or `inconclusive` exactly when a common mistake would have
produced the same weights on these counts; never `incorrect`. Every wrong construction is never
`correct`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.logs import THOROUGH, records, write_by_rank
from tokaudit._auditing import audit
from tokaudit._report import AuditReport

SETTINGS = settings(max_examples=200 if THOROUGH else 20, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Counts = list[list[list[int]]]


@st.composite
def step_counts(draw: Any) -> Counts:
    """counts[step][rank][micro]: 1–5 ranks, 1–3 microbatches (the same on every rank), zeros included."""
    world = draw(st.integers(1, 5))
    micro = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 3))
    count = st.one_of(st.just(0), st.integers(0, 40))
    return [[[draw(count) for _ in range(micro)] for _ in range(world)] for _ in range(steps)]


def run(counts: Counts, scalar: Any, terms: int = 1, **columns: Any) -> AuditReport:
    rows = []
    for term in range(terms):
        part = records(counts, scalar, term=str(term), **columns)
        for row in part:
            row["loss_sum"] *= 1 + term  # each term its own losses over the same tokens
            row["backward_scalar"] *= 1 + term
            if row.pop("_rescale", False):
                step_tokens = sum(sum(r) for r in counts[row["step"]])
                row["grad_scale"] = row["world_size"] / max(step_tokens, 1)
        rows.extend(part)
    with tempfile.TemporaryDirectory() as folder:
        return audit([write_by_rank(Path(folder) / "run", rows)])


def confusable(counts: Counts) -> bool:
    """A common local normalization gives every valid record the weight 1/N on these counts: the
    code divided by W·n_r (rank-local mean), W·n·M (microbatch mean ÷ M), W·n (microbatch mean) or
    M·N_m (per-microbatch global count) where the token mean divides by N, and the count was not
    N itself by construction (one rank; one microbatch)."""

    def local_counts(step: list[list[int]], rank: int, micro: int) -> dict[str, int]:
        world, m = len(step), len(step[rank])
        n = step[rank][micro]
        return {
            "rank": world * sum(step[rank]),
            "micro_m": world * n * m,
            "micro": world * n,
            "micro_global": m * sum(r[micro] for r in step),
        }

    structural = {
        "rank": any(len(step) > 1 for step in counts),
        "micro_m": any(len(step) > 1 or len(step[0]) > 1 for step in counts),
        "micro": any(len(step) > 1 or len(step[0]) > 1 for step in counts),
        "micro_global": any(len(step[0]) > 1 for step in counts),
    }
    for mistake, nontrivial in structural.items():
        same = True
        for step in counts:
            total = sum(map(sum, step))
            for rank, mine in enumerate(step):
                for micro, n in enumerate(mine):
                    if n and total and local_counts(step, rank, micro)[mistake] != total:
                        same = False
        if nontrivial and same:
            return True
    return False


def serious(report: AuditReport) -> list[str]:
    return [f.code.value for f in report.findings if f.severity.value != "info"]


@SETTINGS
@given(
    counts=step_counts(),
    terms=st.integers(1, 3),
    construction=st.sampled_from(["average", "sum", "rescaled_raw_sum", "loss_scale_recorded"]),
)
def test_correct_constructions_are_never_incorrect(counts: Counts, terms: int, construction: str) -> None:
    if construction == "average":  # b = W·S/N into DDP's average (D = W)
        report = run(counts, lambda S, N, W, **_: W * S / max(N, 1), terms)
    elif construction == "sum":  # b = S/N into a summing reduction (D = 1)
        report = run(counts, lambda S, N, **_: S / max(N, 1), terms, grad_divisor=1.0)
    elif construction == "rescaled_raw_sum":  # b = S, then g = W/N after backward (torchtune)
        report = run(counts, lambda S, **_: S, terms, _rescale=True)
    else:  # an AMP loss scale multiplies b; the recorder writes g = 1/scale
        report = run(counts, lambda S, N, W, **_: 2.0**16 * W * S / max(N, 1), terms, grad_scale=2.0**-16)
    (summary,) = report.runs
    assert serious(report) == []
    has_tokens = any(sum(map(sum, step)) for step in counts)
    if has_tokens and not confusable(counts):
        assert summary.verdict == "correct"
        assert abs(summary.max_weight_ratio - 1) < 1e-9
    else:
        assert summary.verdict == "inconclusive"
    assert len(summary.terms) == terms


WRONG = {
    "rank_local_mean": lambda S, n_r, **_: S / max(n_r, 1),
    "micro_mean_over_m": lambda S, n, M, **_: S / (M * max(n, 1)),
    "per_micro_global": lambda S, N_m, M, W, **_: W * S / (M * max(N_m, 1)),
    "missing_world_size": lambda S, N, **_: S / max(N, 1),
    "hard_coded_world_size": lambda S, N, **_: 8 * S / max(N, 1),
    "raw_sum": lambda S, **_: S,
}

LOCAL = {"rank_local_mean", "micro_mean_over_m", "per_micro_global"}


@SETTINGS
@given(
    counts=step_counts(), terms=st.integers(1, 2), mistake=st.sampled_from(sorted(WRONG)), wrong_term=st.integers(0, 1)
)
def test_wrong_constructions_are_never_correct(counts: Counts, terms: int, mistake: str, wrong_term: int) -> None:
    wrong_term = min(wrong_term, terms - 1)
    rows = []
    for term in range(terms):
        scalar = WRONG[mistake] if term == wrong_term else (lambda S, N, W, **_: W * S / max(N, 1))
        rows.extend(records(counts, scalar, term=str(term)))
    with tempfile.TemporaryDirectory() as folder:
        report = audit([write_by_rank(Path(folder) / "run", rows)])
    (summary,) = report.runs
    # A wrong construction that trains exactly the token mean on these counts is no wrong gradient; it
    # must still never be called correct when a common mistake fits: then it is inconclusive.
    trains_token_mean = all(
        abs(
            WRONG[mistake](
                S=1.0,
                n=n,
                n_r=sum(mine),
                N=sum(map(sum, step)),
                M=len(mine),
                W=len(step),
                N_m=sum(r[micro] for r in step),
            )
            / len(step)
            * sum(map(sum, step))
            - 1
        )
        < 1e-12
        for step in counts
        if sum(map(sum, step))
        for mine in step
        for micro, n in enumerate(mine)
        if n
    )
    if not trains_token_mean:
        assert summary.verdict != "correct", [f.code.value for f in report.findings]
    elif any(sum(map(sum, step)) for step in counts):
        assert summary.verdict in ("correct", "inconclusive")
        if mistake in LOCAL and confusable(counts):
            assert summary.verdict == "inconclusive"


@SETTINGS
@given(counts=step_counts())
def test_local_means_are_flagged_whenever_counts_differ(counts: Counts) -> None:
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
