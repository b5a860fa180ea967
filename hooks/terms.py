"""Which captured loss calls of one microbatch are one loss term, from their targets alone.

Chunks of one cross-entropy (over disjoint slices of the sequence) read disjoint elements of the
same label storage: one term, whose S, n and probe add up. A second head over the same tokens
(an auxiliary loss) or the shifted labels of multi-token prediction read overlapping elements, or
other storage: another term. Computed from shapes and strides on the host: no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

EXACT_LIMIT = 1 << 22
"""Views larger than this whose address ranges overlap are taken as overlapping, not enumerated."""


@dataclass(frozen=True, slots=True)
class Footprint:
    """Where a target tensor's elements live: its storage, offset, sizes and strides."""

    storage: int
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Footprint:
        return cls(tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()),
                   tuple(int(n) for n in tensor.shape), tuple(int(s) for s in tensor.stride()))

    def _span(self) -> tuple[int, int]:
        # [first, last] element index; strides of views may be 0 or negative only in odd cases
        low = self.offset + sum((n - 1) * s for n, s in zip(self.sizes, self.strides) if s < 0 and n > 0)
        high = self.offset + sum((n - 1) * s for n, s in zip(self.sizes, self.strides) if s > 0 and n > 0)
        return low, high

    def _elements(self) -> np.ndarray:
        index = np.full((1,), self.offset, dtype=np.int64)
        for n, s in zip(self.sizes, self.strides):
            index = (index[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
        return index

    def disjoint(self, other: Footprint) -> bool:
        """True when the two views share no element of one storage (chunks of one sequence)."""
        if self.storage != other.storage or self.storage == 0:
            return False
        if 0 in self.sizes or 0 in other.sizes:
            return True
        (a_low, a_high), (b_low, b_high) = self._span(), other._span()
        if a_high < b_low or b_high < a_low:
            return True
        if max(np.prod(self.sizes), np.prod(other.sizes)) > EXACT_LIMIT:
            return False
        return not np.intersect1d(self._elements(), other._elements(), assume_unique=False).size
