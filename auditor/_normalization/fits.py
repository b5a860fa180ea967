"""Which denominators fit each step: the spread of α = e·Den·D over a step's records, a block of steps at a time."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._engine import one_value
from tokaudit._normalization.vocabulary import APPROXIMATE_MARGIN, APPROXIMATE_SPREAD, LOCAL_DENOMINATORS, Denominator
from tokaudit._normalization.vocabulary import Floats, PREFERENCE, RECORD_BOUNDS
from tokaudit._sorting import SortedColumn, at_positions, middle, middle_positions


def spread(low: Floats, high: Floats) -> Floats:
    """Relative width (high − low)/max(|low|, |high|); 0 when both are 0; NaN where either is."""
    scale = np.maximum(np.abs(low), np.abs(high))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(scale == 0, 0.0, (high - low) / scale)


def close(value: float, target: float, rtol: float) -> bool:
    return abs(value - target) <= rtol * max(abs(target), 1e-300)


def cluster(values: Floats, rtol: float) -> npt.NDArray[np.int64]:
    """Labels grouping values that agree within rtol: sorted, each cluster spans at most 2·rtol of
    its first member (noise of ±rtol around one true value). NaN gets −1. One binary search per
    cluster, not a Python step per value."""
    labels = np.full(len(values), -1, dtype=np.int64)
    order, ordered, bounds = _sorted_clusters(values, rtol)
    for label, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        labels[order[start:stop]] = label
    return labels


def _reach(anchor: float, rtol: float) -> float:
    """The largest value in the cluster that starts at anchor: value − anchor ≤ 2·rtol·max(|anchor|,
    |value|); for a positive anchor that is value ≤ anchor/(1 − 2·rtol), and every value where 2·rtol ≥ 1 (a run
    computed in 2 significant bits, fp4's: `judged_rtol`), else value ≤ anchor + 2·rtol·|anchor|."""
    if anchor > 0:
        return anchor / (1 - 2 * rtol) if rtol < 0.5 else math.inf
    return anchor + 2 * rtol * abs(anchor)


def _sorted_clusters(values: Floats, rtol: float) -> tuple[npt.NDArray[np.int64], Floats, list[int]]:
    """`cluster` as slices: the non-NaN values' indices in ascending order of value, those values, and
    the offsets where each cluster starts (and the last one ends) in them."""
    order = np.argsort(values, kind="stable")
    order = order[~np.isnan(values[order])]
    ordered = values[order]
    sizes = np.bincount(ClusterStarts(rtol).add(ordered))
    return order, ordered, [0, *np.cumsum(sizes).tolist()]


class ClusterStarts:
    """The clusters (`cluster`) of values read in ascending order, a chunk at a time: a cluster starts at
    the first value past the last one's reach, one step per cluster rather than per value. Every value then
    lies in the cluster whose start is the largest at or below it."""

    def __init__(self, rtol: float) -> None:
        self.rtol = rtol
        self.starts: list[float] = []
        self.reach = -math.inf

    def add(self, ordered: Floats) -> npt.NDArray[np.int64]:
        """Each value's cluster, for the next values in ascending order (clusters they start included)."""
        index = 0
        while index < len(ordered):
            if not self.starts or ordered[index] > self.reach:
                self.starts.append(float(ordered[index]))
                self.reach = _reach(self.starts[-1], self.rtol)
            index = max(index + 1, int(np.searchsorted(ordered, self.reach, side="right")))
        return self.of(ordered)

    def of(self, values: Floats) -> npt.NDArray[np.int64]:
        """Each value's cluster, among the clusters started so far."""
        labels: npt.NDArray[np.int64] = np.searchsorted(np.array(self.starts), values, side="right") - 1
        return labels


def float_column(steps: pd.DataFrame, name: str) -> Floats:
    """A column as float64 (what is not a number as NaN): a column held as one value (`engine.tables.constant_of`)
    stays one value (read-only, no memory), a float64 column is the column itself."""
    values = steps[name].to_numpy()
    if values.dtype.kind in "iuf" and one_value(values):
        return np.broadcast_to(values[:1].astype(np.float64), values.shape)
    if values.dtype.kind in "iufb":
        # what pd.to_numeric and float64 make of a number, without building a Series each time
        number: Floats = values if values.dtype == np.float64 else values.astype(np.float64)
        return number
    converted: Floats = np.asarray(pd.to_numeric(steps[name], errors="coerce"), dtype=np.float64)
    return converted


def candidate_bounds(steps: pd.DataFrame) -> dict[Denominator, tuple[Floats, Floats]]:
    """Per candidate denominator, the step's lowest and highest e·Den over its valid records."""
    return {denominator: _bounds(steps, denominator) for denominator in PREFERENCE}


def _bounds(steps: pd.DataFrame, denominator: Denominator) -> tuple[Floats, Floats]:
    """One candidate's (lowest, highest) e·Den at every row of these steps."""

    def column(name: str) -> Floats:
        return float_column(steps, name)

    if denominator in RECORD_BOUNDS:
        low, high = RECORD_BOUNDS[denominator]
        return column(low), column(high)
    weight_low, weight_high = column("weight_low"), column("weight_high")
    if denominator == Denominator.ONE:
        return weight_low, weight_high
    if denominator == Denominator.N:
        tokens = column("tokens")
        return weight_low * tokens, weight_high * tokens
    positions = column("positions")
    all_positions = (column("positions_known") == column("records")) & (positions > 0)
    step_positions = np.where(all_positions, positions, np.nan)
    return weight_low * step_positions, weight_high * step_positions


def _alpha(low: Floats, high: Floats, divisor: Floats) -> Floats:
    """α = e·Den·D: the middle of a candidate's bounds times the reduction's divisor."""
    alpha: Floats = (low + high) / 2 * divisor
    return alpha


BLOCK_STEPS = 65_536
"""Steps whose candidates are computed at a time (a few MB of temporaries)."""


@dataclass(frozen=True, slots=True)
class FitBlock:
    """One block of steps' candidates (`block_fits`): which fit, whether the step can be judged, q where
    the weights are uniform, the nearest approximate fit and its spread, and every candidate's α."""

    fits: npt.NDArray[np.bool_]
    usable: npt.NDArray[np.bool_]
    distortion: Floats
    nearest: npt.NDArray[np.int64]
    nearest_spread: Floats
    alphas: Floats
    world: Floats
    """W (world_high) and M (microbatches_high), which `Confusion` reads."""
    micro: Floats


def clusters_of(column: SortedColumn, rtol: float) -> tuple[Floats, list[float]]:
    """A column's clusters (`cluster`): each one's smallest value and its median (its middle value, or the
    middle two's mean). In memory as a sort of the column; on disk (`SortedColumn.spilled`) from its runs."""
    if not column.count:
        return np.zeros(0), []
    one = column.high <= _reach(column.low, rtol)  # every value within the first cluster's reach
    if not column.spilled:
        values, _ = column.in_order()
        if one:
            # The one cluster `_sorted_clusters` would make, its median found without sorting.
            return np.array([column.low]), [float(np.median(values, overwrite_input=True))]
        _, ordered, bounds = _sorted_clusters(values, rtol)
        medians = [
            middle([float(ordered[i]) for i in middle_positions(start, stop - start)])
            for start, stop in zip(bounds, bounds[1:])
        ]
        return ordered[bounds[:-1]], medians
    # On disk: the clusters' starts and sizes from one pass over the values in order, their medians
    # (a slice of the sorted values each: its middle) from a second.
    chain = ClusterStarts(rtol)
    sizes = np.zeros(0, dtype=np.int64)
    for values, _ in column.chunks():
        labels = chain.add(values)
        sizes = np.pad(sizes, (0, len(chain.starts) - len(sizes))) + np.bincount(labels, minlength=len(chain.starts))
    offsets = np.r_[0, np.cumsum(sizes)[:-1]].tolist()
    positions = [middle_positions(start, size) for start, size in zip(offsets, sizes.tolist())]
    found = iter(at_positions(column, [p for pair in positions for p in pair]))
    return np.array(chain.starts), [middle([next(found) for _ in pair]) for pair in positions]


def skipped_updates(steps: pd.DataFrame) -> npt.NDArray[np.bool_]:
    """The steps every record of which says the trainer skipped the update (a GradScaler's overflow, a batch dropped
    on an out-of-memory error): it changed no weight, so its records are no evidence of the normalization, whole or
    not (the dropped batch's record may be missing)."""
    if "skipped_true" not in steps or "skipped_false" not in steps:  # a table that holds no skip counts at all
        return np.zeros(len(steps), dtype=bool)
    skipped: npt.NDArray[np.bool_] = (float_column(steps, "skipped_true") > 0) & ~(
        float_column(steps, "skipped_false") > 0
    )
    return skipped


def judged_steps(steps: pd.DataFrame) -> npt.NDArray[np.bool_]:
    """The steps whose weights are judged: valid tokens with a weight, in an update the trainer applied."""
    judged: npt.NDArray[np.bool_] = (
        (float_column(steps, "tokens") > 0)
        & (float_column(steps, "weighted_records") > 0)
        & ~np.isnan(float_column(steps, "weight_low"))
        & ~skipped_updates(steps)
    )
    return judged


def block_fits(steps: pd.DataFrame, rtol: float) -> FitBlock:
    """Per step of this block: which candidates fit within rtol, whether the step can be judged (valid
    tokens with a weight), q = e·N where the weights are uniform (else NaN), the nearest approximate fit
    with the spread it leaves (see `nearest_fit`), and each candidate's α = e·Den·D."""
    bounds = candidate_bounds(steps)
    divisor = float_column(steps, "divisor_high")
    usable = judged_steps(steps)
    shape = (len(steps), len(PREFERENCE))
    spreads, alphas = np.empty(shape, order="F"), np.empty(shape, order="F")
    for column, denominator in enumerate(PREFERENCE):  # written in place: no stack of columns copied
        spreads[:, column] = spread(*bounds[denominator])
        alphas[:, column] = _alpha(*bounds[denominator], divisor)
    fits = usable[:, None] & (spreads <= rtol)
    low, high = bounds[Denominator.N]
    distortion = np.where(fits[:, 0], (low + high) / 2, np.nan)
    # The nearest approximate fit is read only where nothing fits exactly (`Decisions.diagnose`).
    nearest, nearest_spread = np.full(len(fits), -1, dtype=np.int64), np.full(len(fits), np.nan)
    unfit = np.flatnonzero(~fits.any(axis=1))
    if len(unfit):
        nearest[unfit], nearest_spread[unfit] = nearest_fit(spreads[unfit], alphas[unfit], usable[unfit])
    return FitBlock(
        fits,
        usable,
        distortion,
        nearest,
        nearest_spread,
        alphas,
        float_column(steps, "world_high"),
        float_column(steps, "microbatches_high"),
    )


class Confusion:
    """The local normalization that the logs cannot tell from the token mean, if any, a block at a time.

    Code that divides by a local count gives the same weights as the token mean when the counts it
    needs to differ never did: the rank-local mean b = S_r/n_r (α = α_N/W for n_r) when every rank
    holds the same n_r; the per-microbatch mean (n, n·M) when every microbatch holds the same n;
    the per-microbatch global count (α = α_N/M for N_m) when every microbatch index holds the same
    N_m. Checked over every usable step, where N fits every one; a count that is N itself (one rank,
    one microbatch) is no other normalization. Each condition is an "every step" or "some step".
    """

    def __init__(self, rtol: float) -> None:
        self.rtol = rtol
        self.any_usable = False
        self.token_mean_everywhere = True
        # per local denominator: whether some usable step makes it nontrivial, and whether every one fits
        # it with α at the natural multiple of α_N
        self.nontrivial = dict.fromkeys(LOCAL_DENOMINATORS, False)
        self.agrees = dict.fromkeys(LOCAL_DENOMINATORS, True)

    def add(self, found: FitBlock) -> None:
        usable = found.usable
        self.any_usable = self.any_usable or bool(usable.any())
        self.token_mean_everywhere = self.token_mean_everywhere and bool((found.fits[:, 0] | ~usable).all())
        # a step whose tokens all weigh 0 (g = 0) fits every denominator at α = 0, and tells none apart
        rows = np.flatnonzero(usable & (found.alphas[:, 0] != 0))
        if not len(rows) or not self.token_mean_everywhere:
            return
        alpha_n = found.alphas[rows, 0]
        w, m = found.world[rows], found.micro[rows]
        for denominator in LOCAL_DENOMINATORS:
            if denominator == Denominator.MICRO_GLOBAL:
                natural, here = alpha_n / m, bool((m > 1).any())
            else:
                natural = alpha_n / w
                here = bool((w > 1).any()) if denominator == Denominator.RANK else bool(((w > 1) | (m > 1)).any())
            self.nontrivial[denominator] |= here
            c = PREFERENCE.index(denominator)
            self.agrees[denominator] = (
                self.agrees[denominator]
                and bool(found.fits[rows, c].all())
                and bool((np.abs(found.alphas[rows, c] - natural) <= self.rtol * np.abs(natural)).all())
            )

    def result(self) -> Denominator | None:
        if not self.any_usable or not self.token_mean_everywhere:
            return None
        return next((d for d in LOCAL_DENOMINATORS if self.nontrivial[d] and self.agrees[d]), None)


def nearest_fit(spreads: Floats, alphas: Floats, usable: npt.NDArray[np.bool_]) -> tuple[npt.NDArray[np.int64], Floats]:
    """Per step, the candidate that leaves α least spread when none fits exactly, if it stands out:
    at most APPROXIMATE_SPREAD and APPROXIMATE_MARGIN× below every candidate that differs from it.
    Among equally spread candidates (n and n·M under a fixed M), the one whose α is nearest 1."""
    filled = np.where(np.isnan(spreads), np.inf, spreads)
    best_spread = filled.min(axis=1)
    tied = filled <= best_spread[:, None] * (1 + 1e-9) + 1e-15
    with np.errstate(divide="ignore", invalid="ignore"):
        plainness = np.where(tied, np.abs(np.log(np.abs(alphas))), np.inf)
    plainness = np.where(tied & np.isnan(plainness), np.inf, plainness)
    best = np.argmin(np.where(tied, plainness, np.inf), axis=1)  # first in PREFERENCE among ties
    best = np.where(np.isfinite(plainness[np.arange(len(best)), best]), best, np.argmin(filled, axis=1))
    others = np.where(~tied, filled, np.inf).min(axis=1)
    stands_out = usable & (best_spread <= APPROXIMATE_SPREAD) & (others >= APPROXIMATE_MARGIN * best_spread)
    return np.where(stands_out, best, -1), best_spread
