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

from tokaudit.codes import Code


Floats = npt.NDArray[np.float64]


class Denominator(str, Enum):
    """A recovered denominator: the count each loss sum was divided by."""

    N = "N"  # the step's global valid-token count: the token mean
    MICRO_GLOBAL = "N_m"  # the microbatch's count over all ranks
    RANK = "n_rank"  # the rank's own count over the step: a rank-local mean
    MICRO_TIMES_M = "n_micro*M"  # the microbatch's own count times the microbatches M: loss.mean() / M
    MICRO = "n_micro"  # the microbatch's own count
    POSITIONS = "T"  # the microbatch's positions, padding included
    STEP_POSITIONS = "T_step"  # the step's positions, padding included
    ONE = "1"  # nothing: a raw loss sum
    UNDETERMINED = "undetermined"  # equal counts everywhere: local and global means coincide
    UNEXPLAINED = "unexplained"  # weights differ and nothing explains them


class StepKind(str, Enum):
    """What one step's weights say."""

    CORRECT = "correct"  # every token weighs 1/N
    UNIFORM_OFF = "uniform_off"  # every token weighs the same, q = e·N ≠ 1
    NONUNIFORM = "nonuniform"  # tokens of one step weigh differently
    UNJUDGED = "unjudged"  # uniform, but D could not be seen: the absolute scale is not judged
    UNWEIGHTED = "unweighted"  # valid tokens without a usable weight
    EMPTY = "empty"  # N = 0
    SKIPPED = "skipped"  # an update the trainer skipped: it changed no weight, its records are no evidence


class FactorKind(str, Enum):
    """What a uniform factor q ≠ 1 most plausibly is."""

    WORLD_SIZE = "world_size"  # W, 1/W, W'/W, or a small integer: a world-size mistake
    LOSS_SCALE = "loss_scale"  # a large power of two: an AMP loss scale that was not recorded
    OTHER = "other"  # any other constant


@dataclass(frozen=True)
class DenominatorFacts:
    """What tokaudit knows of one denominator: the one table the recovery, the checks and the renderers read."""

    words: str
    """How a finding names it."""
    formula: str = ""
    """How it reads in b·g = α·S/Den."""
    bounds: tuple[str, str] | None = None
    """The step columns of the least and greatest e·Den over the step's records (a record-level candidate)."""
    code: Code | None = None
    """The finding a weighting by it is, where the weights differ."""
    local: bool = False
    """A local count: where the counts it needs to differ never do, the logs cannot tell it from the token mean."""
    confused: tuple[str, str] = ("", "")
    """Where it cannot be told from N: what was equal everywhere, and the mistake in words (`balanced_counts`)."""


DENOMINATOR_FACTS: dict[Denominator, DenominatorFacts] = {
    Denominator.N: DenominatorFacts("the step's global valid-token count N", "S/N"),
    Denominator.MICRO_GLOBAL: DenominatorFacts(
        "each microbatch's own global count N_m",
        "S/N_m",
        ("weight_by_micro_low", "weight_by_micro_high"),
        Code.PER_MICRO_DENOMINATOR,
        local=True,
        confused=(
            "every microbatch index held the same number of valid tokens over the ranks",
            "a per-microbatch global count N_m",
        ),
    ),
    Denominator.RANK: DenominatorFacts(
        "each rank's own valid-token count n_r",
        "S/n_r",
        ("weight_by_rank_low", "weight_by_rank_high"),
        Code.LOCAL_MEAN,
        local=True,
        confused=("each rank held the same number of valid tokens n_r", "a rank-local mean"),
    ),
    Denominator.MICRO_TIMES_M: DenominatorFacts(
        "each microbatch's own mean (its own count n) divided by the number of microbatches M",
        "S/(n·M)",
        ("weight_by_record_m_low", "weight_by_record_m_high"),
        Code.LOCAL_MEAN,
        local=True,
        confused=("every microbatch held the same number of valid tokens", "a per-microbatch mean divided by M"),
    ),
    Denominator.MICRO: DenominatorFacts(
        "each microbatch's own count n",
        "S/n",
        ("weight_by_record_low", "weight_by_record_high"),
        Code.LOCAL_MEAN,
        local=True,
        confused=("every microbatch held the same number of valid tokens", "a per-microbatch mean"),
    ),
    Denominator.POSITIONS: DenominatorFacts(
        "the positions of each microbatch, padding and ignored labels included",
        "S/T",
        ("weight_by_positions_low", "weight_by_positions_high"),
        Code.PADDED_DENOMINATOR,
    ),
    Denominator.STEP_POSITIONS: DenominatorFacts(
        "the positions of the whole step, padding and ignored labels included", "S/T_step"
    ),
    Denominator.ONE: DenominatorFacts("nothing (a raw loss sum)", "S"),
    Denominator.UNDETERMINED: DenominatorFacts(
        "undetermined: counts are equal everywhere, so local and global means coincide"
    ),
    Denominator.UNEXPLAINED: DenominatorFacts("no single denominator", code=Code.UNEXPLAINED_WEIGHTING),
}
"""Every denominator's facts (a test holds it to the enum)."""

FORMULA = {d: facts.formula for d, facts in DENOMINATOR_FACTS.items() if facts.formula}
"""How each denominator reads in b·g = α·S/Den."""

# Tie-break when several denominators explain as many steps: the correct one first, then the
# mistakes from the most to the least common in the wild; a constant (1) before the positions, which fit
# exactly the steps a constant fits wherever T never changes: positions are named only where they vary
# as the weights do, or where α = 1 says the divisor was T itself (`Decisions._cover`).
PREFERENCE: tuple[Denominator, ...] = (
    Denominator.N,
    Denominator.RANK,
    Denominator.MICRO_TIMES_M,
    Denominator.MICRO,
    Denominator.MICRO_GLOBAL,
    Denominator.ONE,
    Denominator.POSITIONS,
    Denominator.STEP_POSITIONS,
)

RECORD_BOUNDS = {d: facts.bounds for d, facts in DENOMINATOR_FACTS.items() if facts.bounds}
"""Record-level candidates: the (low, high) columns of e·Den over the step's records."""

LOCAL_DENOMINATORS = tuple(d for d in PREFERENCE if DENOMINATOR_FACTS[d].local)
"""The local counts, in the order of preference."""

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

        return StepDiagnosis(
            KINDS[self.kind[i]],
            DENOMINATORS[self.denominator[i]],
            number(self.factor),
            number(self.distortion),
            bool(self.balanced[i]),
            number(self.approximate),
        )

    def __iter__(self) -> Iterator[StepDiagnosis]:
        return (self[i] for i in range(len(self)))

    def kind_is(self, *kinds: StepKind) -> npt.NDArray[np.bool_]:
        return np.isin(self.kind, [KINDS.index(k) for k in kinds])
