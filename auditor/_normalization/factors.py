"""What a uniform factor q means: a world size, a loss scale, or another constant."""

from __future__ import annotations

import math
from collections.abc import Iterable

from tokaudit._normalization.fits import close
from tokaudit._normalization.vocabulary import FactorExplanation, FactorKind, LOSS_SCALE_MIN_EXPONENT, MAX_WORLD_SIZE
from tokaudit._normalization.vocabulary import RESOLVABLE


def resolvable_integer(value: float, rtol: float) -> int | None:
    """k when value ≈ k for an integer 2 ≤ k that rtol can still tell from k ± 1."""
    if not math.isfinite(value):
        return None
    k = round(value)
    if 2 <= k <= MAX_WORLD_SIZE and rtol * k <= RESOLVABLE and abs(value - k) <= rtol * k:
        return int(k)
    return None


def power_of_two(value: float, rtol: float) -> int | None:
    """j when value ≈ 2^j."""
    if not (math.isfinite(value) and value > 0):
        return None
    j = round(math.log2(value))
    return j if close(value, 2.0**j, rtol) else None


def explain_factor(q: float, world_size: int, run_world_sizes: Iterable[int], rtol: float) -> FactorExplanation:
    """Name a uniform factor q = e·N ≠ 1. Only plausible world-size factors count as W mistakes:
    what W explains first (1/W, W, a stale W'/W), then a large power of two (a loss scale), then a
    small resolvable integer, its reciprocal, or a hard-coded integer W' (q = W'/W)."""
    w = world_size
    if w >= 2 and close(q, 1 / w, rtol):
        return FactorExplanation(FactorKind.WORLD_SIZE, "1/W", w)
    if w >= 2 and close(q, w, rtol):
        return FactorExplanation(FactorKind.WORLD_SIZE, "W", w)
    for other in sorted(set(run_world_sizes) - {w}):
        if close(q, other / w, rtol):
            return FactorExplanation(FactorKind.WORLD_SIZE, "W'/W", other)
    for base in (1.0, float(w), 1.0 / w):
        j = power_of_two(q / base, rtol)
        if j is not None and j >= LOSS_SCALE_MIN_EXPONENT:
            return FactorExplanation(FactorKind.LOSS_SCALE, "2^j", j)
    if (k := resolvable_integer(q, rtol)) is not None:
        return FactorExplanation(FactorKind.WORLD_SIZE, "k", k)
    if q > 0 and (k := resolvable_integer(1 / q, rtol)) is not None:
        return FactorExplanation(FactorKind.WORLD_SIZE, "1/k", k)
    if (k := resolvable_integer(q * w, rtol)) is not None:
        return FactorExplanation(FactorKind.WORLD_SIZE, "k/W", k)
    return FactorExplanation(FactorKind.OTHER, "c")


def one_scaler(table: list[FactorExplanation], centers: list[float], rtol: float) -> list[FactorExplanation]:
    """A term's factors where one of them is a loss scale: its other powers of two from 2 up that the scaler reaches
    by halving, one power at a time from its least (a dynamic scaler halves at each overflow, and each overflow is
    a step of the log), are the same scaler's, not a W mistake beside it; a power past a gap is what it looks like."""
    exponents = [power_of_two(q, rtol) for q in centers]
    held = {j for e, j in zip(table, exponents) if e.kind == FactorKind.LOSS_SCALE and j is not None}
    if not held:
        return table
    lowered = set()
    below = min(held) - 1
    while below >= 1 and any(e.kind == FactorKind.WORLD_SIZE and j == below for e, j in zip(table, exponents)):
        lowered.add(below)
        below -= 1
    return [
        FactorExplanation(FactorKind.LOSS_SCALE, "2^j", j) if e.kind == FactorKind.WORLD_SIZE and j in lowered else e
        for e, j in zip(table, exponents)
    ]
