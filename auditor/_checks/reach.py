"""Whether a non-finite value that a record of no valid token backpropagated reached the weights: the steps after
it say. Weights once NaN stay NaN, and every later loss with them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class Later:
    """Of a run, over every loss term and group: its last step with valid tokens, its last whose losses ΣS are
    finite, and its last a record says was applied (`skipped` false) (-inf: none)."""

    told: float = -math.inf
    finite: float = -math.inf
    applied: float = -math.inf

    @classmethod
    def of(
        cls,
        step: npt.NDArray[np.int64],
        told: npt.NDArray[np.bool_],
        finite: npt.NDArray[np.bool_],
        applied: npt.NDArray[np.bool_],
    ) -> Later:
        """Of these steps: the last with valid tokens (`told`), the last of those whose losses are `finite`, and the
        last said `applied`."""
        finite = told & finite
        return cls(*(float(step[at].max()) if at.any() else -math.inf for at in (told, finite, applied)))

    def joined(self, other: Later) -> Later:
        """Over both: the later of each."""
        return Later(max(self.told, other.told), max(self.finite, other.finite), max(self.applied, other.applied))

    def reached(self, steps: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
        """Of these steps, where the value reached the weights (a step with valid tokens follows, and none after
        it has finite losses), and where the logs cannot tell (none follows). The others never reached them: a
        later loss is finite (cross-entropy's backward gives an ignored position an exact 0, whatever flows in)."""
        reached = (steps >= self.finite) & (steps < self.told)
        return reached, steps >= self.told
