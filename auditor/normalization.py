"""Normalization recovery (SPEC §1): which denominator and which factor explain each step's weights.

Pure functions of the per-step table (one row per run, group, term and step, see `engine.STEP_SQL`);
no Parquet, no DuckDB. Per record, e = c·g/D is the effective weight of one valid token and
N = Σn over the step (of one group and one term); the step is correct iff q = e·N = 1 for every
record with n > 0. For a candidate denominator Den, α = e·Den·D is the factor in b·g = α·S/Den
(W for W·S/N into an average, 1 for S/N into a sum); Den explains a step when α is the same for
every valid record of it, within rtol.
"""

from __future__ import annotations

import functools
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
from tokaudit.sorting import SortedColumn, at_positions, middle, middle_positions

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


def candidate_bounds(steps: pd.DataFrame) -> dict[Denominator, tuple[Floats, Floats]]:
    """Per candidate denominator, the step's lowest and highest e·Den over its valid records."""
    return {denominator: _bounds(steps, denominator) for denominator in PREFERENCE}


def _bounds(steps: pd.DataFrame, denominator: Denominator) -> tuple[Floats, Floats]:
    """One candidate's (lowest, highest) e·Den at every row of these steps."""
    def column(name: str) -> Floats:
        return _column(steps, name)

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

    The table is read BLOCK_STEPS rows at a time, three times: the run's decisions (`Decisions.of`) come
    from two passes, and each block is then diagnosed alone (`Decisions.diagnose`), so what is held
    whole is the diagnoses and what the decisions keep (their α sorted, a count per signature).
    """
    def blocks() -> Iterator[pd.DataFrame]:
        return (steps.iloc[start:start + BLOCK_STEPS] for start in range(0, len(steps), BLOCK_STEPS))

    decisions = Decisions.of((_candidates(block, rtol) for block in blocks()),
                             lambda: (_candidates(block, rtol) for block in blocks()), rtol)
    # Each block's diagnoses written into the whole table's arrays: never the parts and the whole at once.
    count = len(steps)
    whole = Diagnoses(np.empty(count, np.int8), np.empty(count, np.int8), np.empty(count), np.empty(count),
                      np.empty(count, bool), np.empty(count), decisions.confused)
    for start, block in zip(range(0, count, BLOCK_STEPS), blocks()):
        part = decisions.diagnose(block)
        for name in _DIAGNOSIS_ARRAYS:
            getattr(whole, name)[start:start + len(block)] = getattr(part, name)
    return whole


_DIAGNOSIS_ARRAYS = ("kind", "denominator", "factor", "distortion", "balanced", "approximate")

BLOCK_STEPS = 65_536
"""Steps whose candidates are computed at a time (a few MB of temporaries)."""


@dataclass(frozen=True, slots=True)
class _Block:
    """One block of steps' candidates (`_candidates`): which fit, whether the step can be judged, q where
    the weights are uniform, the nearest approximate fit and its spread, and every candidate's α."""

    fits: npt.NDArray[np.bool_]
    usable: npt.NDArray[np.bool_]
    distortion: Floats
    nearest: npt.NDArray[np.int64]
    nearest_spread: Floats
    alphas: Floats
    world: Floats
    """W (w_high) and M (m_high), which `_Confusion` reads."""
    micro: Floats


@dataclass
class Decisions:
    """What a run decides as a whole and every step then reads: the vote's hypotheses, the ones it picked
    for each signature of hypotheses a step can belong to, and the local normalization the logs cannot tell
    from the token mean (`_Confusion`). Made from two passes over blocks of the step table, then applied
    to any block alone: the same diagnoses as the table diagnosed whole.

    The vote is a greedy set cover of the steps by hypotheses (candidate, α-cluster), most steps first.
    A step's signature is the hypothesis it belongs to under each candidate that fits it: steps of one
    signature are taken together or not at all, so the cover is run over the signatures' counts, whatever
    the number of steps."""

    rtol: float
    voters: list[int]
    """The candidates (indices into PREFERENCE) whose hypotheses vote."""
    anchors: dict[int, Floats]
    """Per voter, the smallest α of each of its clusters, ascending."""
    first_hypothesis: dict[int, int]
    """Per voter, the number of its first hypothesis (the NaN one when it has one, else its first cluster)."""
    has_nan: dict[int, bool]
    owner: list[int]
    values: list[float]
    """Per hypothesis, its candidate and representative α (the median of its cluster; NaN for the NaN one)."""
    signatures: dict[int | bytes, int]
    """Per signature seen (its key, `_keys`), its number."""
    signature_codes: list[npt.NDArray[np.int32]]
    """Per signature, its codes (`_codes`)."""
    picked: npt.NDArray[np.int64]
    """Per signature, the hypothesis that took its steps (−1: none; they keep their own most preferred fit)."""
    confused: Denominator | None
    may_be_off: bool
    """Some step's weights are uniform with q = e·N not within rtol of 1: a step may be uniform_off."""

    @classmethod
    def of(cls, first: Iterable[_Block], again: Callable[[], Iterable[_Block]], rtol: float) -> Decisions:
        """Read the blocks' candidates (`_candidates`) twice, in the same order: `first`, for the α of every
        fitting candidate (its clusters and medians) and what `_Confusion` asks, then `again()`, for the
        count of each signature; the cover runs over those counts."""
        candidates = len(PREFERENCE)
        # a candidate's α over the steps it fits, in memory up to `sorting.RUN_VALUES`, past that on disk
        alphas = [SortedColumn() for _ in range(candidates)]
        beyond_token_mean = np.zeros(candidates, dtype=bool)
        confusion = _Confusion(rtol)
        may_be_off = False
        for found in first:
            for c in range(candidates):
                alphas[c].add(found.alphas[found.fits[:, c], c])
            beyond_token_mean |= (found.fits & ~found.fits[:, :1]).any(axis=0)
            confusion.add(found)
            with np.errstate(invalid="ignore"):
                may_be_off = may_be_off or bool((found.fits[:, 0] & ~(np.abs(found.distortion - 1.0) <= rtol)).any())
        voters: list[int] = []
        anchors: dict[int, Floats] = {}
        first_hypothesis: dict[int, int] = {}
        has_nan: dict[int, bool] = {}
        owner: list[int] = []
        values: list[float] = []
        token_mean_whole = False
        for c in range(candidates):
            fitting = alphas[c]
            if token_mean_whole and not beyond_token_mean[c]:
                # Every step this candidate fits is a member of N's one hypothesis (all N fits, one cluster,
                # no NaN α): none of its hypotheses can win a step. Each is a subset K of those rows, so at
                # any pick free(K) ≤ free(N's), and N wins every tie (plainest, first in PREFERENCE); once
                # N's is picked, K has nothing left. Leaving them out changes no pick (nor when the picks
                # stop), and saves their signatures: in a correct run 1, T and ΣT fit exactly the steps N fits.
                fitting.close()
                continue
            if not fitting.count and not fitting.nan:
                continue
            voters.append(c)
            first_hypothesis[c] = len(owner)
            has_nan[c] = fitting.nan > 0
            if has_nan[c]:  # α NaN: one hypothesis of its own, first (as label −1 sorts)
                owner.append(c)
                values.append(math.nan)
            starts, medians = _clusters(fitting, rtol)
            fitting.close()  # let go of what is read no more
            anchors[c] = starts
            owner.extend([c] * len(medians))
            values.extend(medians)
            token_mean_whole = token_mean_whole or (c == 0 and len(medians) == 1 and not has_nan[c])
        decisions = cls(rtol, voters, anchors, first_hypothesis, has_nan, owner, values, {}, [],
                        np.zeros(0, np.int64), confusion.result(), may_be_off)
        counts: list[int] = []
        for found in again():
            codes = decisions._codes(found)
            if not codes.shape[1]:
                continue
            keys, first_row, seen = decisions._distinct(codes)
            for key, row, count in zip(keys, first_row.tolist(), seen.tolist()):
                number = decisions.signatures.setdefault(key, len(counts))
                if number == len(counts):
                    counts.append(0)
                    decisions.signature_codes.append(codes[row].copy())
                counts[number] += count
        decisions.picked = decisions._cover(np.array(counts, dtype=np.int64))
        return decisions

    def _distinct(self, codes: npt.NDArray[np.int32]
                  ) -> tuple[list[int | bytes], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The distinct signatures of these steps: their keys, a step of each, and how many steps have it."""
        keys, first_row, counts = np.unique(self._keys(codes), return_index=True, return_counts=True)
        return keys.tolist(), first_row, counts

    def _keys(self, codes: npt.NDArray[np.int32]) -> npt.NDArray[Any]:
        """Per step, its signature as one number: the codes in mixed radix (a voter's digit runs to its
        number of hypotheses), or as the codes' bytes when that number could pass 2⁶²."""
        if self._digits is not None:
            keys: npt.NDArray[Any] = codes.astype(np.int64) @ self._digits
            return keys
        return np.array([row.tobytes() for row in codes], dtype=object)

    @functools.cached_property
    def _digits(self) -> npt.NDArray[np.int64] | None:
        """The weight of each voter's code in a signature's number (`_keys`); None past 2⁶²."""
        bases = [1 + self.owner.count(c) for c in self.voters]
        return np.cumprod([1, *bases[:-1]], dtype=np.int64) if math.prod(bases) < 2**62 else None

    def _codes(self, found: _Block) -> npt.NDArray[np.int32]:
        """Per step, per voter: 0 when the voter does not fit it, else 1 + the number of its hypothesis
        among the voter's (the NaN one first)."""
        codes = np.zeros((len(found.fits), len(self.voters)), dtype=np.int32)
        for column, c in enumerate(self.voters):
            rows = np.flatnonzero(found.fits[:, c])
            alpha = found.alphas[rows, c]
            nan = np.isnan(alpha)
            # the cluster whose anchor is the largest at or below α (every α lies in a cluster)
            cluster_of = np.searchsorted(self.anchors[c], np.where(nan, 0.0, alpha), side="right") - 1
            codes[rows, column] = np.where(nan, 1, 1 + int(self.has_nan[c]) + cluster_of)
        return codes

    def _hypotheses(self, codes: npt.NDArray[np.int32]) -> npt.NDArray[np.int64]:
        """The hypotheses of each code column's voter, as global numbers (−1 where it does not fit)."""
        offsets = np.array([self.first_hypothesis[c] for c in self.voters], dtype=np.int64)
        return np.where(codes > 0, offsets[None, :] + codes - 1, -1)

    def _cover(self, counts: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The greedy cover over the signatures' counts. A lazy max-heap keeps it near-linear: a popped
        hypothesis whose count has shrunk is pushed back with its true count."""
        picked = np.full(len(counts), -1, dtype=np.int64)
        if not len(counts):
            return picked
        member_of = self._hypotheses(np.array(self.signature_codes, dtype=np.int32))  # per signature, per voter: its hypothesis
        signatures_of: list[list[int]] = [[] for _ in self.owner]
        for signature, hypotheses in enumerate(member_of.tolist()):
            for h in hypotheses:
                if h >= 0:
                    signatures_of[h].append(signature)
        members = [np.array(s, dtype=np.int64) for s in signatures_of]
        sizes = [int(counts[m].sum()) for m in members]
        # Among hypotheses that explain as many steps: N (the token mean) first, then α = 1, the simplest
        # reading (S/n rather than 2·S/(n·M)), then PREFERENCE.
        plain = [0 if self.owner[h] == 0 else 1 if close(self.values[h], 1.0, self.rtol) else 2
                 for h in range(len(self.owner))]
        heap = [(-size, plain[h], self.owner[h], h) for h, size in enumerate(sizes) if size]
        heapq.heapify(heap)
        while heap:
            stored, simple, preference, h = heapq.heappop(heap)
            free = members[h][picked[members[h]] < 0]
            count = int(counts[free].sum())
            if count < -stored:
                if count:
                    heapq.heappush(heap, (-count, simple, preference, h))
                continue
            if count < 2:
                break  # nothing shared any more: every step left keeps its own most preferred fit
            picked[free] = h
        return picked

    def diagnose(self, block: pd.DataFrame) -> Diagnoses:
        """The diagnoses of these steps under the run's decisions."""
        count = len(block)
        found = _candidates(block, self.rtol)
        fits, usable, distortion, nearest = found.fits, found.usable, found.distortion, found.nearest
        chosen, factor = self.vote(found)

        balanced = (_column(block, "n_low") == _column(block, "n_high")) & (
            _column(block, "m_low") == _column(block, "m_high"))
        unknown_divisor = _column(block, "unknown_divisor") > 0 if "unknown_divisor" in block \
            else np.zeros(count, dtype=bool)
        empty = _column(block, "tokens") == 0
        uniform = fits[:, 0]  # e·N constant ⇔ e constant

        # The denominator: the vote's winner, else the nearest approximate fit, else unexplained.
        preference = np.array([DENOMINATORS.index(d) for d in PREFERENCE], dtype=np.int8)
        approximate_fit = (chosen < 0) & (nearest >= 0)
        denominator = np.full(count, DENOMINATORS.index(Denominator.UNEXPLAINED), dtype=np.int8)
        won = chosen >= 0
        denominator[won] = preference[chosen[won]]
        denominator[approximate_fit] = preference[nearest[approximate_fit]]
        near = np.flatnonzero(approximate_fit)
        factor[near] = found.alphas[near, nearest[near]]
        approximate = found.nearest_spread
        approximate[~approximate_fit] = np.nan

        def index(kind: StepKind) -> np.int8:
            return np.int8(KINDS.index(kind))

        with np.errstate(invalid="ignore"):
            correct = np.abs(distortion - 1.0) <= self.rtol
        kind = np.where(correct, index(StepKind.CORRECT), index(StepKind.UNIFORM_OFF))
        kind[uniform & unknown_divisor] = index(StepKind.UNJUDGED)
        kind[~uniform] = index(StepKind.NONUNIFORM)
        kind[~usable] = index(StepKind.UNWEIGHTED)
        kind[empty] = index(StepKind.EMPTY)
        unjudged_here = ~usable | empty
        undetermined = DENOMINATORS.index(Denominator.UNDETERMINED)
        denominator[unjudged_here] = undetermined
        if self.confused is not None:
            denominator[np.isin(kind, [index(StepKind.CORRECT), index(StepKind.UNJUDGED)])] = undetermined
        factor[unjudged_here] = np.nan
        distortion[unjudged_here] = np.nan
        approximate[unjudged_here] = np.nan
        return Diagnoses(kind, denominator, factor, distortion, balanced, approximate, self.confused)

    def vote(self, found: _Block) -> tuple[npt.NDArray[np.int8], Floats]:
        """Per step, the index in PREFERENCE of its winning candidate (−1: none) and the α it is read with:
        the picked hypothesis's representative, else its own most preferred fit's own α (NaN: none)."""
        count = len(found.fits)
        chosen = np.full(count, -1, dtype=np.int8)
        factor = np.full(count, np.nan)
        codes = self._codes(found)
        if codes.shape[1]:
            number = self._numbers(codes)
            h = np.where(number >= 0, self.picked[np.maximum(number, 0)], -1)
            won = h >= 0
            owner, values = np.array(self.owner, dtype=np.int8), np.array(self.values)
            chosen[won], factor[won] = owner[h[won]], values[h[won]]
        # Every step left keeps its own most preferred fit, with its own α.
        left = np.flatnonzero((chosen < 0) & found.fits.any(axis=1))
        first_fit = np.argmax(found.fits[left], axis=1)
        chosen[left], factor[left] = first_fit, found.alphas[left, first_fit]
        return chosen, factor

    def _numbers(self, codes: npt.NDArray[np.int32]) -> npt.NDArray[np.int64]:
        """Each step's signature number (−1: a signature the decisions never saw), by its distinct keys."""
        keys, inverse = np.unique(self._keys(codes), return_inverse=True)
        numbers = np.array([self.signatures.get(key, -1) for key in keys.tolist()], dtype=np.int64)
        return numbers[inverse.reshape(-1)]


def _clusters(column: SortedColumn, rtol: float) -> tuple[Floats, list[float]]:
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
        medians = [middle([float(ordered[i]) for i in middle_positions(start, stop - start)])
                   for start, stop in zip(bounds, bounds[1:])]
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


def _candidates(steps: pd.DataFrame, rtol: float) -> _Block:
    """Per step of this block: which candidates fit within rtol, whether the step can be judged (valid
    tokens with a weight), q = e·N where the weights are uniform (else NaN), the nearest approximate fit
    with the spread it leaves (see `_nearest`), and each candidate's α = e·Den·D."""
    bounds = candidate_bounds(steps)
    divisor = _column(steps, "d_high")
    usable = (_column(steps, "tokens") > 0) & (_column(steps, "weighted_records") > 0) & ~np.isnan(_column(steps, "e_low"))
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
        nearest[unfit], nearest_spread[unfit] = _nearest(spreads[unfit], alphas[unfit], usable[unfit])
    return _Block(fits, usable, distortion, nearest, nearest_spread, alphas, _column(steps, "w_high"),
                  _column(steps, "m_high"))


_LOCAL = (Denominator.RANK, Denominator.MICRO_TIMES_M, Denominator.MICRO, Denominator.MICRO_GLOBAL)


class _Confusion:
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
        self.nontrivial = dict.fromkeys(_LOCAL, False)
        self.agrees = dict.fromkeys(_LOCAL, True)

    def add(self, found: _Block) -> None:
        usable = found.usable
        self.any_usable = self.any_usable or bool(usable.any())
        self.token_mean_everywhere = self.token_mean_everywhere and bool((found.fits[:, 0] | ~usable).all())
        rows = np.flatnonzero(usable)
        if not len(rows) or not self.token_mean_everywhere:
            return
        alpha_n = found.alphas[rows, 0]
        w, m = found.world[rows], found.micro[rows]
        for denominator in _LOCAL:
            if denominator == Denominator.MICRO_GLOBAL:
                natural, here = alpha_n / m, bool((m > 1).any())
            else:
                natural = alpha_n / w
                here = bool((w > 1).any()) if denominator == Denominator.RANK else bool(((w > 1) | (m > 1)).any())
            self.nontrivial[denominator] |= here
            c = PREFERENCE.index(denominator)
            self.agrees[denominator] = self.agrees[denominator] and bool(found.fits[rows, c].all()) and bool(
                (np.abs(found.alphas[rows, c] - natural) <= self.rtol * np.abs(natural)).all())

    def result(self) -> Denominator | None:
        if not self.any_usable or not self.token_mean_everywhere:
            return None
        return next((d for d in _LOCAL if self.nontrivial[d] and self.agrees[d]), None)


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

    spans = Spans()
    for start in range(0, len(step), SPAN_BLOCK):
        if not spans.add(kept(start + np.flatnonzero(keep[start:start + SPAN_BLOCK]))):
            # Out of order: every kept row at once, sorted by group, term, then step (lexsort is stable).
            rows = kept(np.flatnonzero(keep))
            order = np.lexsort((rows["step"], rows["term"], rows["grp"]))
            spans = Spans()
            spans.add({name: values[order] for name, values in rows.items()})
            break
    return spans.listed(grp_names, term_names)


def span_rows(steps: pd.DataFrame, diagnoses: Diagnoses, groups: list[str], term_rank: int
              ) -> dict[str, npt.NDArray[Any]]:
    """What `Spans.add` reads of these steps of one term (every one but the empty ones): the rank of its
    group's name among the run's (`groups`), the term's rank, the step, the denominator and α."""
    rows = np.flatnonzero(~diagnoses.kind_is(StepKind.EMPTY))
    return {"grp": name_ranks(steps.grp, groups)[rows].astype(np.int32),
            "term": np.full(len(rows), term_rank, dtype=np.int32),
            "step": steps.step.to_numpy()[rows], "denominator": diagnoses.denominator[rows],
            "factor": diagnoses.factor[rows]}


def name_ranks(column: pd.Series, names: list[str]) -> npt.NDArray[np.int64]:
    """Per row, the index of its name (as text) in `names` (−1: another name, or none): each distinct
    value converted once, not every row."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes, found = column.cat.codes.to_numpy(), column.cat.categories
    else:
        codes, found = pd.factorize(column)
    index = {name: rank for rank, name in enumerate(names)}
    # the last entry is read by the code −1 of a missing name
    ranks = np.array([index.get(str(name), -1) for name in found] + [-1], dtype=np.int64)
    ranked: npt.NDArray[np.int64] = ranks[codes]
    return ranked


class Spans:
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
