"""Normalization recovery (SPEC §1): which denominator and which factor explain each step's weights.

Pure functions of the per-step table (one row per run, group, term and step, see `engine.STEP_SQL`);
no Parquet, no DuckDB. Per record, e = c·g/D is the effective weight of one valid token and
N = Σn over the step (of one group and one term); the step is correct iff q = e·N = 1 for every
record with n > 0. For a candidate denominator Den, α = e·Den·D is the factor in b·g = α·S/Den
(W for W·S/N into an average, 1 for S/N into a sum); Den explains a step when α is the same for
every valid record of it, within rtol.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit.engine import one_value

Floats = npt.NDArray[np.float64]


class Denominator(str, Enum):
    """A recovered denominator: the count each loss sum was divided by."""

    N = "N"                        # the step's global valid-token count: the token mean
    MICRO_GLOBAL = "N_m"           # the microbatch's count over all ranks
    RANK = "n_rank"                # the rank's own count over the step: a rank-local mean
    MICRO_TIMES_M = "n_micro*M"    # the microbatch's own count times the microbatches M: loss.mean() / M
    MICRO = "n_micro"              # the microbatch's own count
    POSITIONS = "T"                # the microbatch's positions, padding included
    STEP_POSITIONS = "T_step"      # the step's positions, padding included
    ONE = "1"                      # nothing: a raw loss sum
    UNDETERMINED = "undetermined"  # equal counts everywhere: local and global means coincide
    UNEXPLAINED = "unexplained"    # weights differ and nothing explains them


class StepKind(str, Enum):
    """What one step's weights say."""

    CORRECT = "correct"          # every token weighs 1/N
    UNIFORM_OFF = "uniform_off"  # every token weighs the same, q = e·N ≠ 1
    NONUNIFORM = "nonuniform"    # tokens of one step weigh differently
    UNJUDGED = "unjudged"        # uniform, but D could not be seen: the absolute scale is not judged
    UNWEIGHTED = "unweighted"    # valid tokens without a usable weight
    EMPTY = "empty"              # N = 0


class FactorKind(str, Enum):
    """What a uniform factor q ≠ 1 most plausibly is."""

    WORLD_SIZE = "world_size"  # W, 1/W, W'/W, or a small integer: a world-size mistake
    LOSS_SCALE = "loss_scale"  # a large power of two: an AMP loss scale that was not recorded
    OTHER = "other"            # any other constant


FORMULA: dict[Denominator, str] = {
    Denominator.N: "S/N", Denominator.MICRO_GLOBAL: "S/N_m", Denominator.RANK: "S/n_r",
    Denominator.MICRO_TIMES_M: "S/(n·M)", Denominator.MICRO: "S/n", Denominator.POSITIONS: "S/T",
    Denominator.STEP_POSITIONS: "S/T_step", Denominator.ONE: "S",
}
"""How each denominator reads in b·g = α·S/Den."""

# Tie-break when several denominators explain as many steps: the correct one first, then the
# mistakes from the most to the least common in the wild.
PREFERENCE: tuple[Denominator, ...] = (
    Denominator.N, Denominator.RANK, Denominator.MICRO_TIMES_M, Denominator.MICRO, Denominator.MICRO_GLOBAL,
    Denominator.POSITIONS, Denominator.STEP_POSITIONS, Denominator.ONE,
)

# Record-level candidates: the (low, high) columns of e·Den over the step's records.
_RECORD_BOUNDS = {
    Denominator.RANK: ("er_low", "er_high"),
    Denominator.MICRO_TIMES_M: ("enm_low", "enm_high"),
    Denominator.MICRO: ("en_low", "en_high"),
    Denominator.MICRO_GLOBAL: ("em_low", "em_high"),
    Denominator.POSITIONS: ("et_low", "et_high"),
}

APPROXIMATE_SPREAD = 0.1
"""A denominator that leaves α spread by at most 10% (and 3× less than any other) is named as approximate."""
APPROXIMATE_MARGIN = 3.0
RESOLVABLE = 0.05
"""An integer k is told from its neighbours only while the tolerance rtol·k stays below this."""
MAX_WORLD_SIZE = 1 << 20
LOSS_SCALE_MIN_EXPONENT = 8
"""Powers of two from 2^8 up are read as a loss scale (GradScaler starts at 2^16), not as a W."""


@dataclass(frozen=True, slots=True)
class StepDiagnosis:
    """The recovered normalization of one step."""

    kind: StepKind
    """What the weights say."""
    denominator: Denominator
    """The denominator that explains them (or undetermined/unexplained)."""
    factor: float | None
    """α in b·g = α·S/denominator; the cluster's representative when the run voted for it."""
    distortion: float | None
    """q = e·N when the step's weights are uniform, else None."""
    balanced: bool
    """Every record had the same count and every rank as many microbatches."""
    approximate: float | None = None
    """For a denominator that fits only nearly: the relative spread of α it leaves (0.03 = 3%)."""


@dataclass(frozen=True, slots=True)
class FactorExplanation:
    """Why a uniform q ≠ 1 is what it is."""

    kind: FactorKind
    label: str
    """1/W, W, W'/W, 2^j, k, 1/k, k/W or c (any constant)."""
    integer: int | None = None
    """k, W' or the exponent j, where the label has one."""


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
    |value|); for a positive anchor that is value ≤ anchor/(1 − 2·rtol), else value ≤ anchor + 2·rtol·|anchor|."""
    return anchor / (1 - 2 * rtol) if anchor > 0 else anchor + 2 * rtol * abs(anchor)


def _one_cluster(values: Floats, rtol: float) -> bool:
    """The (non-NaN) values make a single cluster: the largest is within the smallest's reach."""
    return bool(values.max() <= _reach(float(values.min()), rtol))


def _sorted_clusters(values: Floats, rtol: float) -> tuple[npt.NDArray[np.int64], Floats, list[int]]:
    """`cluster` as slices: the non-NaN values' indices in ascending order of value, those values, and
    the offsets where each cluster starts (and the last one ends) in them."""
    order = np.argsort(values, kind="stable")
    order = order[~np.isnan(values[order])]
    ordered = values[order]
    bounds = [0]
    while bounds[-1] < len(ordered):
        start = bounds[-1]
        limit = _reach(float(ordered[start]), rtol)
        bounds.append(max(start + 1, int(np.searchsorted(ordered, limit, side="right"))))
    return order, ordered, bounds


def _column(steps: pd.DataFrame, name: str) -> Floats:
    """A column as float64 (what is not a number as NaN): a column held as one value (`engine._constant`)
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


def _column_at(steps: pd.DataFrame, name: str, rows: npt.NDArray[Any]) -> Floats:
    """`_column(steps, name)[rows]`, converting only those rows (not the whole column at every call)."""
    values = steps[name].to_numpy()
    if values.dtype.kind in "iufb":
        taken: Floats = values[rows].astype(np.float64)
        return taken
    picked: Floats = _column(steps, name)[rows]
    return picked


def candidate_bounds(steps: pd.DataFrame) -> dict[Denominator, tuple[Floats, Floats]]:
    """Per candidate denominator, the step's lowest and highest e·Den over its valid records."""
    return {denominator: _bounds(steps, denominator) for denominator in PREFERENCE}


def _bounds(steps: pd.DataFrame, denominator: Denominator, rows: npt.NDArray[Any] | None = None
            ) -> tuple[Floats, Floats]:
    """One candidate's (lowest, highest) e·Den, at these rows of the table (all when None). Element by
    element, so the rows' values are bit for bit those of the whole table's."""
    def column(name: str) -> Floats:
        return _column(steps, name) if rows is None else _column_at(steps, name, rows)

    if denominator in _RECORD_BOUNDS:
        low, high = _RECORD_BOUNDS[denominator]
        return column(low), column(high)
    e_low, e_high = column("e_low"), column("e_high")
    if denominator == Denominator.ONE:
        return e_low, e_high
    if denominator == Denominator.N:
        tokens = column("tokens")
        return e_low * tokens, e_high * tokens
    positions = column("positions")
    all_positions = (column("positions_known") == column("records")) & (positions > 0)
    step_positions = np.where(all_positions, positions, np.nan)
    return e_low * step_positions, e_high * step_positions


def alpha_at(steps: pd.DataFrame) -> Callable[[int, npt.NDArray[Any]], Floats]:
    """α = e·Den·D of candidate PREFERENCE[c] at given rows, computed when asked: the vote reads it
    for the steps each candidate fits, and a table of it for every candidate would be 64 bytes a step
    (a sixth of the audit's peak at millions of steps). The same α as `_candidates` computes."""
    def alpha(c: int, rows: npt.NDArray[Any]) -> Floats:
        # A block of rows at a time: the bounds' temporaries stay a few MB however many steps fit.
        out = np.empty(len(rows))
        for start in range(0, len(rows), BLOCK_STEPS):
            part = rows[start:start + BLOCK_STEPS]
            out[start:start + len(part)] = _alpha(*_bounds(steps, PREFERENCE[c], part),
                                                  _column_at(steps, "d_high", part))
        return out

    return alpha


def _alpha(low: Floats, high: Floats, divisor: Floats) -> Floats:
    """α = e·Den·D: the middle of a candidate's bounds times the reduction's divisor."""
    alpha: Floats = (low + high) / 2 * divisor
    return alpha


KINDS: tuple[StepKind, ...] = tuple(StepKind)
DENOMINATORS: tuple[Denominator, ...] = tuple(Denominator)


@dataclass(frozen=True, slots=True)
class Diagnoses:
    """Every step's diagnosis as columns (one entry per row of the step table): no Python object per
    step, so a run of millions of steps costs a few arrays. Indexing or iterating gives StepDiagnosis."""

    kind: npt.NDArray[np.int8]
    """Index into KINDS."""
    denominator: npt.NDArray[np.int8]
    """Index into DENOMINATORS."""
    factor: Floats
    """α (NaN: none)."""
    distortion: Floats
    """q = e·N where the weights are uniform (NaN elsewhere)."""
    balanced: npt.NDArray[np.bool_]
    approximate: Floats
    """The spread α leaves under a denominator that fits only nearly (NaN: an exact fit or none)."""
    confused: Denominator | None = None
    """The local denominator that explains these steps as well as the token mean (balanced_counts)."""

    def __len__(self) -> int:
        return len(self.kind)

    def __getitem__(self, i: int) -> StepDiagnosis:
        def number(values: Floats) -> float | None:
            return None if np.isnan(values[i]) else float(values[i])

        return StepDiagnosis(KINDS[self.kind[i]], DENOMINATORS[self.denominator[i]], number(self.factor),
                             number(self.distortion), bool(self.balanced[i]), number(self.approximate))

    def __iter__(self) -> Iterator[StepDiagnosis]:
        return (self[i] for i in range(len(self)))

    def kind_is(self, *kinds: StepKind) -> npt.NDArray[np.bool_]:
        return np.isin(self.kind, [KINDS.index(k) for k in kinds])


def diagnose_steps(steps: pd.DataFrame, rtol: float) -> Diagnoses:
    """Recover every step's normalization, letting the whole table vote.

    Small steps fit several denominators by coincidence (two equal counts, N = ΣT/2, ...). The
    hypothesis (denominator, α within rtol) that explains the most steps wins them, then the next
    one takes what is left; a run that changed normalization at a resume shows both. Call it on
    one (group, term) or on a whole run: hypotheses are shared, the weights are per row.
    """
    count = len(steps)
    if count == 0:
        empty = np.zeros(0)
        return Diagnoses(np.zeros(0, np.int8), np.zeros(0, np.int8), empty, empty, np.zeros(0, bool), empty)
    candidates = len(PREFERENCE)
    fits = np.empty((count, candidates), dtype=bool)
    usable, distortion = np.empty(count, dtype=bool), np.empty(count)
    nearest, nearest_spread = np.empty(count, dtype=np.int8), np.empty(count)
    # Row by row the candidates are independent: computed a block of steps at a time, so the
    # temporaries (bounds, spreads, α) stay a few MB whatever the number of steps; only the fits are
    # kept whole, and α is computed again where the vote needs it (`alpha_at`).
    for start in range(0, count, BLOCK_STEPS):
        block = slice(start, min(start + BLOCK_STEPS, count))
        fits[block], usable[block], distortion[block], nearest[block], nearest_spread[block] = \
            _candidates(steps.iloc[block], rtol)
    alpha = alpha_at(steps)
    chosen, representative = _vote(fits, alpha, rtol)

    # Per-step arrays are made narrow (int8 indices) and written in place, each condition applied in
    # turn (a later one overrides): at millions of steps no whole float column is copied to be compared.
    balanced, unknown_divisor, empty = np.empty(count, bool), np.zeros(count, bool), np.empty(count, bool)
    for start in range(0, count, BLOCK_STEPS):
        # a block at a time: a count column read as float64 whole is 8 bytes a step for a 1-byte answer
        block = slice(start, min(start + BLOCK_STEPS, count))
        part = steps.iloc[block]
        balanced[block] = (_column(part, "n_low") == _column(part, "n_high")) & (
            _column(part, "m_low") == _column(part, "m_high"))
        if "unknown_divisor" in steps:
            unknown_divisor[block] = _column(part, "unknown_divisor") > 0
        empty[block] = _column(part, "tokens") == 0
    confused = _confusable(fits, alpha, usable, steps, rtol)
    uniform = fits[:, 0]  # e·N constant ⇔ e constant

    # The denominator: the vote's winner, else the nearest approximate fit, else unexplained.
    preference = np.array([DENOMINATORS.index(d) for d in PREFERENCE], dtype=np.int8)
    approximate_fit = (chosen < 0) & (nearest >= 0)
    denominator = np.full(count, DENOMINATORS.index(Denominator.UNEXPLAINED), dtype=np.int8)
    won = chosen >= 0
    denominator[won] = preference[chosen[won]]
    del won
    denominator[approximate_fit] = preference[nearest[approximate_fit]]
    factor = representative  # NaN where the vote chose nothing
    for c in np.unique(nearest[approximate_fit]):
        near = np.flatnonzero(approximate_fit & (nearest == c))
        factor[near] = alpha(int(c), near)
    approximate = nearest_spread
    approximate[~approximate_fit] = np.nan
    del approximate_fit, chosen, nearest

    def index(kind: StepKind) -> np.int8:
        return np.int8(KINDS.index(kind))

    correct = np.empty(count, dtype=bool)
    for start in range(0, count, BLOCK_STEPS):  # |q − 1| a block at a time: two float temporaries a step
        block = slice(start, start + BLOCK_STEPS)
        with np.errstate(invalid="ignore"):
            correct[block] = np.abs(distortion[block] - 1.0) <= rtol
    kind = np.where(correct, index(StepKind.CORRECT), index(StepKind.UNIFORM_OFF))
    del correct
    kind[uniform & unknown_divisor] = index(StepKind.UNJUDGED)
    kind[~uniform] = index(StepKind.NONUNIFORM)
    kind[~usable] = index(StepKind.UNWEIGHTED)
    kind[empty] = index(StepKind.EMPTY)
    unjudged_here = ~usable | empty
    undetermined = DENOMINATORS.index(Denominator.UNDETERMINED)
    denominator[unjudged_here] = undetermined
    if confused is not None:
        denominator[np.isin(kind, [index(StepKind.CORRECT), index(StepKind.UNJUDGED)])] = undetermined
    factor[unjudged_here] = np.nan
    distortion[unjudged_here] = np.nan
    approximate[unjudged_here] = np.nan
    return Diagnoses(kind, denominator, factor, distortion, balanced, approximate, confused)


BLOCK_STEPS = 65_536
"""Steps whose candidates are computed at a time (a few MB of temporaries)."""


def _candidates(steps: pd.DataFrame, rtol: float) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_], Floats,
                                                            npt.NDArray[np.int64], Floats]:
    """Per step of this block: which candidates fit within rtol, whether the step can be judged (valid
    tokens with a weight), q = e·N where the weights are uniform (else NaN), and the nearest approximate
    fit with the spread it leaves (see `_nearest`), from each candidate's α = e·Den·D."""
    bounds = candidate_bounds(steps)
    divisor = _column(steps, "d_high")
    usable = (_column(steps, "tokens") > 0) & (_column(steps, "weighted_records") > 0) & ~np.isnan(_column(steps, "e_low"))
    spreads = np.column_stack([spread(*bounds[d]) for d in PREFERENCE])
    alphas = np.column_stack([_alpha(*bounds[d], divisor) for d in PREFERENCE])
    fits = usable[:, None] & (spreads <= rtol)
    low, high = bounds[Denominator.N]
    distortion = np.where(fits[:, 0], (low + high) / 2, np.nan)
    # The nearest approximate fit is read only where nothing fits exactly (`diagnose_steps`).
    nearest, nearest_spread = np.full(len(fits), -1, dtype=np.int64), np.full(len(fits), np.nan)
    unfit = np.flatnonzero(~fits.any(axis=1))
    if len(unfit):
        nearest[unfit], nearest_spread[unfit] = _nearest(spreads[unfit], alphas[unfit], usable[unfit])
    return fits, usable, distortion, nearest, nearest_spread


_LOCAL = (Denominator.RANK, Denominator.MICRO_TIMES_M, Denominator.MICRO, Denominator.MICRO_GLOBAL)


def _confusable(fits: npt.NDArray[np.bool_], alpha: Callable[[int, npt.NDArray[Any]], Floats],
                usable: npt.NDArray[np.bool_], steps: pd.DataFrame, rtol: float) -> Denominator | None:
    """The local normalization that the logs cannot tell from the token mean, if any.

    Code that divides by a local count gives the same weights as the token mean when the counts it
    needs to differ never did: the rank-local mean b = S_r/n_r (α = α_N/W for n_r) when every rank
    holds the same n_r; the per-microbatch mean (n, n·M) when every microbatch holds the same n;
    the per-microbatch global count (α = α_N/M for N_m) when every microbatch index holds the same
    N_m. Checked over every usable step; a count that is N itself (one rank, one microbatch) is no
    other normalization. Each condition is an "every step" or "some step": read a block of steps at a
    time (a correct run reaches this with every step usable, and whole columns of α, W and M were
    49 bytes a step).
    """
    if not usable.any() or not (fits[:, 0] | ~usable).all():
        return None
    # per local denominator: whether some usable step makes it nontrivial, and whether every one fits it
    # with α at the natural multiple of α_N
    nontrivial = dict.fromkeys(_LOCAL, False)
    agrees = dict.fromkeys(_LOCAL, True)
    for start in range(0, len(usable), BLOCK_STEPS):
        rows = start + np.flatnonzero(usable[start:start + BLOCK_STEPS])
        if not len(rows):
            continue
        alpha_n = alpha(0, rows)
        w, m = _column_at(steps, "w_high", rows), _column_at(steps, "m_high", rows)
        for denominator in _LOCAL:
            if denominator == Denominator.MICRO_GLOBAL:
                natural, here = alpha_n / m, bool((m > 1).any())
            else:
                natural = alpha_n / w
                here = bool((w > 1).any()) if denominator == Denominator.RANK else bool(((w > 1) | (m > 1)).any())
            nontrivial[denominator] |= here
            c = PREFERENCE.index(denominator)
            agrees[denominator] = agrees[denominator] and bool(fits[rows, c].all()) and bool(
                (np.abs(alpha(c, rows) - natural) <= rtol * np.abs(natural)).all())
    return next((d for d in _LOCAL if nontrivial[d] and agrees[d]), None)


def _vote(fits: npt.NDArray[np.bool_], alpha_of: Callable[[int, npt.NDArray[Any]], Floats], rtol: float
          ) -> tuple[npt.NDArray[np.int8], Floats]:
    """Greedy set cover of the steps by hypotheses (candidate, α-cluster), most steps first.
    `alpha_of(c, rows)`: candidate c's α at those steps (`alpha_at`).

    Returns per step the index in PREFERENCE of its winning candidate (−1: none) and the winning
    cluster's representative α (its median). A lazy max-heap keeps this near-linear: a popped
    hypothesis whose count has shrunk is pushed back with its true count.
    """
    steps, candidates = fits.shape
    # Step indices are int32 below 2³¹ steps (`row_indices`): the hypotheses' members cover each step once
    # per fitting candidate, the largest thing the vote holds.
    # A hypothesis made of every row its candidate fits (one cluster, no NaN α: the usual run) is kept as
    # the candidate's number and its rows found again when read: each step fits several candidates at
    # once (N, 1, T and N_m all fit a correct step of one microbatch and constant T), 4 bytes each.
    members: list[npt.NDArray[Any] | int] = []
    sizes: list[int] = []
    owner: list[int] = []
    values: list[float] = []
    token_mean_whole = False
    for c in range(candidates):
        if token_mean_whole and not (fits[:, c] & ~fits[:, 0]).any():
            # Every step this candidate fits is a member of N's one hypothesis (all N fits, one cluster, no
            # NaN α): none of its hypotheses can win a step. Each is a subset K of those rows, so at any
            # pick free(K) ≤ free(N's), and N wins every tie (plainest, first in PREFERENCE); once N's is
            # picked, K has nothing left. Leaving them out changes no pick (nor when the picks stop), and
            # saves their α and its sort: in a correct run 1, T and ΣT fit exactly the steps N fits.
            continue
        rows = row_indices(fits[:, c])
        if not len(rows):
            continue
        # its α lives only in the call, and its rows are let go: the picks below hold neither
        whole = _add_hypotheses(c, rows, alpha_of(c, rows), rtol, members, sizes, owner, values)
        token_mean_whole = token_mean_whole or (c == 0 and whole)
        del rows
    chosen = np.full(steps, -1, dtype=np.int8)
    representative = np.full(steps, np.nan)
    taken = np.zeros(steps, dtype=bool)
    # Among hypotheses that explain as many steps: N (the token mean) first, then α = 1, the simplest
    # reading (S/n rather than 2·S/(n·M)), then PREFERENCE.
    plain = [0 if owner[h] == 0 else 1 if close(values[h], 1.0, rtol) else 2 for h in range(len(values))]
    heap = [(-size, plain[h], owner[h], h) for h, size in enumerate(sizes)]
    heapq.heapify(heap)
    while heap:
        stored, simple, preference, h = heapq.heappop(heap)
        member = members[h]
        # the steps still free, as a mask for a whole candidate (no index of every step it fits)
        free = fits[:, member] & ~taken if isinstance(member, int) else member[~taken[member]]
        count = int(np.count_nonzero(free)) if isinstance(member, int) else len(free)
        if count < -stored:
            if count:
                heapq.heappush(heap, (-count, simple, preference, h))
            continue
        if count < 2:
            break  # nothing shared any more: every step left keeps its own most preferred fit
        chosen[free], representative[free], taken[free] = owner[h], values[h], True
    # Every step left keeps its own most preferred fit.
    left = np.flatnonzero(~taken & fits.any(axis=1))
    first_fit = np.argmax(fits[left], axis=1)
    for c in np.unique(first_fit):
        rows = left[first_fit == c]
        chosen[rows], representative[rows] = c, alpha_of(int(c), rows)
    return chosen, representative


def _add_hypotheses(c: int, rows: npt.NDArray[Any], alpha: Floats, rtol: float, members: list[npt.NDArray[Any] | int],
                    sizes: list[int], owner: list[int], values: list[float]) -> bool:
    """Candidate c's hypotheses (`_vote`) from the rows it fits and its α there: one of the NaN α, then one
    per cluster. True when one hypothesis holds every row it fits (one cluster, no NaN α)."""
    unordered = np.isnan(alpha)
    if unordered.any():  # α NaN: one hypothesis of its own, first (as label −1 sorts)
        members.append(rows[unordered])
        sizes.append(int(unordered.sum()))
        owner.append(c)
        values.append(math.nan)
    finite = alpha[~unordered] if unordered.any() else alpha
    if len(finite) and _one_cluster(finite, rtol):
        # Every α within the first cluster's reach (a run that kept one normalization): the one
        # cluster `_sorted_clusters` would make, its median found without sorting.
        members.append(rows[~unordered] if unordered.any() else c)
        sizes.append(len(finite))
        owner.append(c)
        values.append(float(np.median(finite, overwrite_input=True)))  # α is read no more: sorted in place
        return not unordered.any()
    del finite
    order, ordered, bounds = _sorted_clusters(alpha, rtol)
    for start, stop in zip(bounds, bounds[1:]):
        # A cluster is a slice of the sorted α: its median is its middle value (or the middle two's mean).
        middle = (start + stop) // 2
        median = ordered[middle] if (stop - start) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
        members.append(rows[order[start:stop]])
        sizes.append(stop - start)
        owner.append(c)
        values.append(float(median))
    return False


def row_indices(mask: npt.NDArray[np.bool_]) -> npt.NDArray[Any]:
    """np.flatnonzero(mask) as int32 below 2³¹ rows (int64 beyond), found a block at a time (no int64 index
    of every row first)."""
    out: npt.NDArray[Any] = np.empty(int(np.count_nonzero(mask)), dtype=np.int32 if len(mask) < 2**31 else np.int64)
    filled = 0
    for start in range(0, len(mask), BLOCK_STEPS):
        part = np.flatnonzero(mask[start:start + BLOCK_STEPS])
        out[filled:filled + len(part)] = part + start
        filled += len(part)
    return out


def _nearest(spreads: Floats, alphas: Floats, usable: npt.NDArray[np.bool_]
             ) -> tuple[npt.NDArray[np.int64], Floats]:
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
    return j if close(value, 2.0 ** j, rtol) else None


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


@dataclass(frozen=True, slots=True)
class Span:
    """Consecutive steps of one (group, term) that used the same normalization."""

    group: str
    term: str
    first: int
    last: int
    steps: int
    denominator: Denominator
    factor: float | None


MAX_SPANS = 100
"""Spans listed per (group, term): a normalization that alternates from step to step (a bug that
fires every other update) would otherwise make one span per step; the longest are kept."""


SPAN_BLOCK = 1 << 16
"""Rows `segments` reads at a time: its temporaries stay about 10 MB whatever the number of steps."""


def segments(steps: pd.DataFrame, diagnoses: Diagnoses) -> tuple[list[Span], int]:
    """Consecutive steps with the same recovered normalization, merged per (group, term): two
    data-parallel groups never interleave. Columnar: a span starts wherever (denominator, α) changes.
    At most MAX_SPANS per (group, term), the longest (the earliest among equals), in step order;
    the second value counts the spans left out.

    The step table comes in (group, term, step) order: it is read SPAN_BLOCK rows at a time, each
    block's spans added to the longest kept so far (a normalization that changes at every step makes
    a span per step: held whole, they were 90 bytes a step). A table in another order is sorted first."""
    keep = ~diagnoses.kind_is(StepKind.EMPTY)
    if not keep.any():
        return [], 0
    grp, grp_names = _name_ranks(steps.grp)
    term, term_names = _name_ranks(steps.term)
    step = steps.step.to_numpy()

    def kept(rows: npt.NDArray[Any]) -> dict[str, npt.NDArray[Any]]:
        return {"grp": grp.values(rows), "term": term.values(rows), "step": step[rows],
                "denominator": diagnoses.denominator[rows], "factor": diagnoses.factor[rows]}

    spans = _Spans()
    for start in range(0, len(step), SPAN_BLOCK):
        if not spans.add(kept(start + np.flatnonzero(keep[start:start + SPAN_BLOCK]))):
            # Out of order: every kept row at once, sorted by group, term, then step (lexsort is stable).
            rows = kept(np.flatnonzero(keep))
            order = np.lexsort((rows["step"], rows["term"], rows["grp"]))
            spans = _Spans()
            spans.add({name: values[order] for name, values in rows.items()})
            break
    return spans.listed(grp_names, term_names)


class _Spans:
    """`segments` a block of kept rows at a time, each row (group, term, step, denominator, α) as arrays:
    the last row added and the span still open, and the longest closed spans of each (group, term),
    at most MAX_SPANS. A span is numbered by its first row among the rows added (the earliest wins ties)."""

    def __init__(self) -> None:
        self.rows = 0
        """Rows added so far."""
        self.last: dict[str, npt.NDArray[Any]] = {name: np.zeros(0, dtype) for name, dtype in _ROW_FIELDS}
        """The last row added (none yet: empty arrays)."""
        self.open: dict[str, npt.NDArray[Any]] = {name: np.zeros(0, dtype) for name, dtype in _OPEN_FIELDS}
        """The span still open: its first row's number, group, term, step, denominator and α."""
        self.kept = {name: np.zeros(0, dtype) for name, dtype in _SPAN_FIELDS}
        self.closed = 0

    def add(self, block: dict[str, npt.NDArray[Any]]) -> bool:
        """Take the next rows; False when they are not in (group, term, step) order after the last."""
        if not len(block["step"]):
            return True
        carried = len(self.last["step"])  # the last row, at position 0 when there is one
        rows = {name: np.concatenate([self.last[name], block[name]]) for name, _ in _ROW_FIELDS}
        grp, term, step, denominator, factor = (rows[name] for name, _ in _ROW_FIELDS)
        later = (grp[1:] > grp[:-1]) | ((grp[1:] == grp[:-1]) & (
            (term[1:] > term[:-1]) | ((term[1:] == term[:-1]) & (step[1:] > step[:-1]))))
        if not later.all():
            return False
        del later
        same_factor = (factor[1:] == factor[:-1]) | (np.isnan(factor[1:]) & np.isnan(factor[:-1]))
        changed = (grp[1:] != grp[:-1]) | (term[1:] != term[:-1]) | (denominator[1:] != denominator[:-1]) | ~same_factor
        # Positions where a span starts: after each change, and at the very first row.
        starts = np.flatnonzero(changed) + 1 if carried else np.r_[0, np.flatnonzero(changed) + 1]
        number = self.rows - carried  # the row number of position 0
        spans = {name: np.concatenate([self.open[name], number + starts if name == "first" else rows[name][starts]])
                 for name, _ in _OPEN_FIELDS}
        # Every span but the last is closed by the next start, its last row just before that start.
        closing = len(spans["first"]) - 1
        self._keep({"first": spans["first"][:-1], "length": np.diff(spans["first"]), "grp": spans["grp"][:-1],
                    "term": spans["term"][:-1], "first_step": spans["step"][:-1],
                    "last_step": step[starts - 1][len(starts) - closing:],
                    "denominator": spans["denominator"][:-1], "factor": spans["factor"][:-1]})
        # copies: a view of the last element would keep the whole block's arrays alive
        self.open = {name: values[-1:].copy() for name, values in spans.items()}
        self.rows = number + len(step)
        self.last = {name: values[-1:].copy() for name, values in rows.items()}
        return True

    def _keep(self, closed: dict[str, npt.NDArray[Any]]) -> None:
        """Add closed spans and keep, per (group, term), the MAX_SPANS longest (the earliest among equals)."""
        self.closed += len(closed["first"])
        pool = {name: np.concatenate([self.kept[name], closed[name].astype(dtype)]) for name, dtype in _SPAN_FIELDS}
        order = np.lexsort((pool["first"], -pool["length"], pool["term"], pool["grp"]))
        pair = np.stack([pool["grp"][order], pool["term"][order]], axis=1)
        new_pair = np.r_[True, (pair[1:] != pair[:-1]).any(axis=1)]
        pair_start = np.maximum.accumulate(np.where(new_pair, np.arange(len(order)), 0))
        chosen = order[np.arange(len(order)) - pair_start < MAX_SPANS]
        self.kept = {name: values[chosen] for name, values in pool.items()}

    def listed(self, grp_names: list[str], term_names: list[str]) -> tuple[list[Span], int]:
        """The spans kept, the open one closed at the last row, in order; and how many were left out."""
        if len(self.open["first"]):
            self._keep({"first": self.open["first"], "length": self.rows - self.open["first"],
                        "grp": self.open["grp"], "term": self.open["term"], "first_step": self.open["step"],
                        "last_step": self.last["step"], "denominator": self.open["denominator"],
                        "factor": self.open["factor"]})
            self.open = {name: values[:0] for name, values in self.open.items()}
        order = np.argsort(self.kept["first"], kind="stable")
        kept = {name: values[order].tolist() for name, values in self.kept.items()}
        spans = [Span(grp_names[g], term_names[t], a, b, n, DENOMINATORS[d], None if f != f else f)  # NaN: none
                 for g, t, a, b, n, d, f in zip(kept["grp"], kept["term"], kept["first_step"], kept["last_step"],
                                                kept["length"], kept["denominator"], kept["factor"])]
        return spans, self.closed - len(spans)


_ROW_FIELDS = (("grp", np.int32), ("term", np.int32), ("step", np.int64), ("denominator", np.int8),
               ("factor", np.float64))
_OPEN_FIELDS = (("first", np.int64), *_ROW_FIELDS)
_SPAN_FIELDS = (("first", np.int64), ("length", np.int64), ("grp", np.int32), ("term", np.int32),
                ("first_step", np.int64), ("last_step", np.int64), ("denominator", np.int8), ("factor", np.float64))


@dataclass(frozen=True, slots=True)
class _NameRanks:
    """Per row, the rank of its name among the column's names, read for the rows asked (4 bytes a row
    of those only): the codes of the column's categories and, per code, its rank."""

    codes: npt.NDArray[Any]
    rank: npt.NDArray[np.int32]

    def values(self, rows: npt.NDArray[Any]) -> npt.NDArray[np.int32]:
        ranks: npt.NDArray[np.int32] = self.rank[self.codes[rows]]
        return ranks


def _name_ranks(column: pd.Series) -> tuple[_NameRanks, list[str]]:
    """Per row, the rank of its name (as text) among the column's names, and the names in that order:
    a column of a few names repeated on millions of steps is compared and sorted as integers, and no
    row is turned into a string."""
    categorical = column if isinstance(column.dtype, pd.CategoricalDtype) and not column.isna().any() \
        else column.astype(str).astype("category")
    names = [str(name) for name in categorical.cat.categories]
    order = sorted(range(len(names)), key=names.__getitem__)
    rank = np.empty(len(names), dtype=np.int32)  # 4 bytes a step: fewer than 2³¹ names
    rank[order] = np.arange(len(names))
    return _NameRanks(categorical.cat.codes.to_numpy(), rank), [names[i] for i in order]
