"""A pipeline schedule's division of the gradients after backward (`scale_grads`), named where it explains them."""

from __future__ import annotations

import math
from typing import Any

from tokaudit._checks.base import RunContext, StepsSeen, make_finding
from tokaudit.codes import CODE_DOCS, Code
from tokaudit._report import Finding


def divisions(q: float, divisor: int, rtol: float, least: int = 1) -> int | None:
    """j ≥ `least` where q = divisor^−j within `rtol` (each of j divisions by `divisor` after backward), else None."""
    if not (q > 0 and math.isfinite(q)) or divisor < 2:
        return None
    j = round(-math.log(q) / math.log(divisor))
    return j if j >= least and abs(q * divisor**j - 1) <= rtol else None


def schedule_finding(
    context: RunContext,
    steps: StepsSeen,
    lightest: float,
    heaviest: float,
    step: int,
    tokens: int,
    evidence: dict[str, Any],
) -> Finding | None:
    """`schedule_rescaled` where a pipeline schedule divided every gradient by its M microbatches after backward
    (`context.provenance.schedule_divisor`) and that alone explains the weights: the lightest and heaviest q = e·N of the
    steps are both M^−j, j ≥ 1. q = 1/M: a loss divided by N, then by M; 1/M^k down to 1/M: k step() calls of one
    update, each dividing every gradient accumulated so far; 1/M^(k−1) down to 1: the same on M·S/N, a loss right for
    one call. Else None (the weighting's own finding stands)."""
    m = context.provenance.schedule_divisor
    if m is None:
        return None
    low, high = divisions(heaviest, m, context.rtol, least=0), divisions(lightest, m, context.rtol)
    if low is None or high is None:
        return None
    evidence = {**evidence, "schedule_divisor": m, "divisions": sorted({low, high})}
    weights = f"{heaviest:.4g}/N" if low == high else f"{lightest:.4g}/N to {heaviest:.4g}/N"
    accumulated = (
        ""
        if low == high
        else (
            f"; with gradient accumulation over several step() calls each call divided every gradient accumulated so "
            f"far, so the earliest microbatches were divided {high} times"
        )
    )
    loss = "a loss already divided by the update's N" if low else f"a loss of {m}·S/N, right for one step() call"
    message = (
        f"The pipeline schedule divided every gradient by its M={m} microbatches after backward "
        f"(scale_grads=True) on {loss}: tokens received {weights} instead of 1/N (step {step}, N={tokens})"
        f"{accumulated}."
    )
    return make_finding(
        context, Code.SCHEDULE_RESCALED, steps, message, CODE_DOCS[Code.SCHEDULE_RESCALED].fix, evidence
    )
