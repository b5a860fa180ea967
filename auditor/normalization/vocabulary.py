"""What normalization recovery names: denominators, step kinds, factor kinds, and one step's diagnosis.

Per record, e = c·g/D is the effective weight of one valid token and N = Σn over the step (of one group and
one term); the step is correct iff q = e·N = 1 for every record with n > 0. For a candidate denominator Den,
α = e·Den·D is the factor in b·g = α·S/Den (W for W·S/N into an average, 1 for S/N into a sum); Den explains a
step when α is the same for every valid record of it, within rtol."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import numpy as np
import numpy.typing as npt


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
# mistakes from the most to the least common in the wild; a constant (1) before the positions, which fit
# exactly the steps a constant fits wherever T never changes: positions are named only where they vary
# as the weights do, or where α = 1 says the divisor was T itself (`Decisions._cover`).
PREFERENCE: tuple[Denominator, ...] = (
    Denominator.N, Denominator.RANK, Denominator.MICRO_TIMES_M, Denominator.MICRO, Denominator.MICRO_GLOBAL,
    Denominator.ONE, Denominator.POSITIONS, Denominator.STEP_POSITIONS,
)

# Record-level candidates: the (low, high) columns of e·Den over the step's records.
RECORD_BOUNDS = {
    Denominator.RANK: ("weight_by_rank_low", "weight_by_rank_high"),
    Denominator.MICRO_TIMES_M: ("weight_by_record_m_low", "weight_by_record_m_high"),
    Denominator.MICRO: ("weight_by_record_low", "weight_by_record_high"),
    Denominator.MICRO_GLOBAL: ("weight_by_micro_low", "weight_by_micro_high"),
    Denominator.POSITIONS: ("weight_by_positions_low", "weight_by_positions_high"),
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

