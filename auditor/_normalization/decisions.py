"""The run's decisions: which denominator the steps vote for, and each step's diagnosis."""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._normalization.fits import (
    Confusion,
    FitBlock,
    block_fits,
    close,
    clusters_of,
    float_column,
    skipped_updates,
)
from tokaudit._normalization.vocabulary import DENOMINATORS, Denominator, Diagnoses, Floats, KINDS, PREFERENCE, StepKind
from tokaudit._sorting import SortedColumn


def _first_pass(
    first: Iterable[FitBlock], rtol: float
) -> tuple[list[SortedColumn], npt.NDArray[np.bool_], Confusion, bool]:
    """What `Decisions.of` reads of the blocks the first time: per candidate its α over the steps it fits (in memory
    up to `sorting.RUN_VALUES`, past that on disk) and whether it fits a step N does not; what `Confusion` asks;
    and whether some step's weights are uniform with q = e·N not within rtol of 1."""
    candidates = len(PREFERENCE)
    alphas = [SortedColumn() for _ in range(candidates)]
    beyond_token_mean = np.zeros(candidates, dtype=bool)
    confusion = Confusion(rtol)
    may_be_off = False
    for found in first:
        for c in range(candidates):
            alphas[c].add(found.alphas[found.fits[:, c], c])
        beyond_token_mean |= (found.fits & ~found.fits[:, :1]).any(axis=0)
        confusion.add(found)
        with np.errstate(invalid="ignore"):
            may_be_off = may_be_off or bool((found.fits[:, 0] & ~(np.abs(found.distortion - 1.0) <= rtol)).any())
    return alphas, beyond_token_mean, confusion, may_be_off


@dataclass
class Decisions:
    """What a run decides as a whole and every step then reads: the vote's hypotheses, the ones it picked
    for each signature of hypotheses a step can belong to, and the local normalization the logs cannot tell
    from the token mean (`Confusion`). Made from two passes over blocks of the step table, then applied
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
    def of(
        cls,
        first: Iterable[FitBlock],
        again: Callable[[], Iterable[FitBlock]],
        rtol: float,
        world_sizes: Callable[[], Iterable[int]] = tuple,
    ) -> Decisions:
        """Read the blocks' candidates (`block_fits`) twice, in the same order: `first`, for the α of every
        fitting candidate (its clusters and medians) and what `Confusion` asks, then `again()`, for the
        count of each signature; the cover runs over those counts. `world_sizes()`: the run's W, asked
        after `first` is read (a mean × W is a plain reading, as α = 1 is)."""
        candidates = len(PREFERENCE)
        alphas, beyond_token_mean, confusion, may_be_off = _first_pass(first, rtol)
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
            starts, medians = clusters_of(fitting, rtol)
            fitting.close()  # let go of what is read no more
            anchors[c] = starts
            owner.extend([c] * len(medians))
            values.extend(medians)
            token_mean_whole = token_mean_whole or (c == 0 and len(medians) == 1 and not has_nan[c])
        decisions = cls(
            rtol,
            voters,
            anchors,
            first_hypothesis,
            has_nan,
            owner,
            values,
            {},
            [],
            np.zeros(0, np.int64),
            confusion.result(),
            may_be_off,
        )
        decisions.picked = decisions._cover(decisions._count_signatures(again()), set(world_sizes()))
        return decisions

    def _count_signatures(self, blocks: Iterable[FitBlock]) -> npt.NDArray[np.int64]:
        """How many steps hold each signature (which hypotheses each candidate's α falls in), numbering the
        signatures in the order they are first seen."""
        counts: list[int] = []
        for found in blocks:
            codes = self._codes(found)
            if not codes.shape[1]:
                continue
            keys, first_row, seen = self._distinct(codes)
            for key, row, count in zip(keys, first_row.tolist(), seen.tolist()):
                number = self.signatures.setdefault(key, len(counts))
                if number == len(counts):
                    counts.append(0)
                    self.signature_codes.append(codes[row].copy())
                counts[number] += count
        return np.array(counts, dtype=np.int64)

    def _distinct(
        self, codes: npt.NDArray[np.int32]
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

    def _codes(self, found: FitBlock) -> npt.NDArray[np.int32]:
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

    def _cover(self, counts: npt.NDArray[np.int64], world_sizes: set[int]) -> npt.NDArray[np.int64]:
        """The greedy cover over the signatures' counts. A lazy max-heap keeps it near-linear: a popped
        hypothesis whose count has shrunk is pushed back with its true count."""
        picked = np.full(len(counts), -1, dtype=np.int64)
        if not len(counts):
            return picked
        member_of = self._hypotheses(
            np.array(self.signature_codes, dtype=np.int32)
        )  # per signature, per voter: its hypothesis
        signatures_of: list[list[int]] = [[] for _ in self.owner]
        for signature, hypotheses in enumerate(member_of.tolist()):
            for h in hypotheses:
                if h >= 0:
                    signatures_of[h].append(signature)
        members = [np.array(s, dtype=np.int64) for s in signatures_of]
        sizes = [int(counts[m].sum()) for m in members]
        # Among hypotheses that explain as many steps: N (the token mean) first, then α = 1, the simplest
        # reading (S/n rather than 2·S/(n·M)), then α = W (a microbatch's mean × W, as the HF Trainer makes
        # of a model's own mean, reads 2·S/n rather than 4·S/(n·M)), then PREFERENCE.
        plain = [
            0
            if self.owner[h] == 0
            else 1
            if close(self.values[h], 1.0, self.rtol)
            else 2
            if any(w > 1 and close(self.values[h], float(w), self.rtol) for w in world_sizes)
            else 3
            for h in range(len(self.owner))
        ]
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
        found = block_fits(block, self.rtol)
        fits, usable, distortion, nearest = found.fits, found.usable, found.distortion, found.nearest
        chosen, factor = self.vote(found)

        balanced = (float_column(block, "record_tokens_low") == float_column(block, "record_tokens_high")) & (
            float_column(block, "microbatches_low") == float_column(block, "microbatches_high")
        )
        unknown_divisor = (
            float_column(block, "unknown_divisor") > 0 if "unknown_divisor" in block else np.zeros(count, dtype=bool)
        )
        empty = float_column(block, "tokens") == 0
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
        kind[skipped_updates(block) & ~empty] = index(StepKind.SKIPPED)
        unjudged_here = ~usable | empty
        undetermined = DENOMINATORS.index(Denominator.UNDETERMINED)
        denominator[unjudged_here] = undetermined
        if self.confused is not None:
            denominator[np.isin(kind, [index(StepKind.CORRECT), index(StepKind.UNJUDGED)])] = undetermined
        factor[unjudged_here] = np.nan
        distortion[unjudged_here] = np.nan
        approximate[unjudged_here] = np.nan
        return Diagnoses(kind, denominator, factor, distortion, balanced, approximate, self.confused)

    def vote(self, found: FitBlock) -> tuple[npt.NDArray[np.int8], Floats]:
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
