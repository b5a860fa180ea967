"""The weights: which denominator and factor the run used, and the finding that names them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._checks.base import Check, RunContext, StepsSeen, TermInputs, weight_ratio, column_of, make_finding
from tokaudit._checks.base import step_list
from tokaudit._checks.structure import ALL_CODES
from tokaudit._checks.weighting_findings import WeightingGroup, weighting_finding
from tokaudit.codes import Code
from tokaudit._normalization import DENOMINATOR_FACTS, DENOMINATORS, Denominator, Diagnoses, FactorExplanation
from tokaudit._normalization import FactorKind, StepKind, ClusterStarts, cluster, explain_factor, one_scaler
from tokaudit._report import Finding, StepRange
from tokaudit._schema import UNNAMED
from tokaudit._sorting import SortedColumn, middle, middle_positions


_NONUNIFORM_CODES = {d: facts.code for d, facts in DENOMINATOR_FACTS.items() if facts.code is not None}

VARYING_CLUSTERS = 3

TERM_WEIGHTS = 4
"""The most constant factors of a named term read as a schedule of its coefficient λ (undeclared_term_weight)."""

PLAUSIBLE_SHARE = 0.9
"""More distinct uniform factors than VARYING_CLUSTERS, most of them no plausible W or loss scale:
one factor that varies from step to step, whatever a few steps happen to land on."""


def _weighting_codes(
    diagnoses: Diagnoses,
    explanation: npt.NDArray[np.int32],
    table: list[FactorExplanation],
    term_weight: bool,
    whole: npt.NDArray[np.bool_],
) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.int32]]:
    """Per step, the index in ALL_CODES of its weighting finding (−1: none), and the explanation whose
    label tells kinds of factor apart (for world_size_mismatch and loss_scale; −1 otherwise).
    `term_weight`: uniform weights off by the term's one factor are undeclared_term_weight (`WeightingCheck`).
    `whole`: the steps every rank recorded (`_whole`); uniform weights of another are missing_rank's to say.
    Narrow integers (2 and 4 bytes a step): at millions of steps every per-step array counts."""
    by_denominator = np.array(
        [ALL_CODES.index(_NONUNIFORM_CODES.get(d, Code.UNEXPLAINED_WEIGHTING)) for d in DENOMINATORS], dtype=np.int16
    )
    code = np.where(diagnoses.kind_is(StepKind.NONUNIFORM), by_denominator[diagnoses.denominator], np.int16(-1))
    kinds = {
        FactorKind.WORLD_SIZE: Code.WORLD_SIZE_MISMATCH,
        FactorKind.LOSS_SCALE: Code.LOSS_SCALE,
        FactorKind.OTHER: Code.SCALE_MISMATCH,
    }
    by_explanation = np.array(
        [ALL_CODES.index(kinds[e.kind]) for e in table] + [ALL_CODES.index(Code.SCALE_MISMATCH)], dtype=np.int16
    )  # the last entry stands for "none"
    labelled = np.array([e.kind != FactorKind.OTHER for e in table] + [False])
    off = diagnoses.kind_is(StepKind.UNIFORM_OFF) & whole
    padded = np.isin(
        diagnoses.denominator,
        [DENOMINATORS.index(Denominator.POSITIONS), DENOMINATORS.index(Denominator.STEP_POSITIONS)],
    )
    raw = diagnoses.denominator == DENOMINATORS.index(Denominator.ONE)
    named = np.where(explanation >= 0, explanation, np.int32(len(table)))
    # Written in place, one condition at a time: no nested np.where of whole columns.
    code[off] = by_explanation[named[off]]
    if term_weight:
        code[off] = ALL_CODES.index(Code.UNDECLARED_TERM_WEIGHT)
    code[off & raw] = ALL_CODES.index(Code.SCALE_MISMATCH)
    code[off & padded] = ALL_CODES.index(Code.PADDED_DENOMINATOR)
    label = np.where(off & ~padded & ~raw & labelled[named], named, np.int32(-1))
    return code, label


@dataclass
class FactorTable:
    """Each uniform factor q ≠ 1 named, per cluster of equal q (and W): the clusters' smallest q, the
    explanation of each (cluster, W), and per step the index of its explanation (`ids`). A factor that
    differs from step to step (a count off by a few tokens per row: q = N/(N+4)) is one varying constant:
    its steps that land on 1/2 or 1/3 by chance are no world-size mistake."""

    rtol: float
    anchors: npt.NDArray[np.float64]
    pairs: dict[tuple[int, int], int]
    table: list[FactorExplanation]
    varying: bool
    """Every factor is the one varying constant (table holds it alone)."""

    @classmethod
    def of(cls, diagnosed: Iterable[tuple[pd.DataFrame, Diagnoses]], context: RunContext) -> FactorTable:
        """From every step's q where the weights are uniform and off, read in the table's order, each with
        its W (held in memory up to `sorting.RUN_VALUES`, past that on disk in sorted runs)."""
        column = SortedColumn()
        try:
            for block, diagnoses in diagnosed:
                off = _uniform_off(block, diagnoses)
                if off.any():
                    column.add(diagnoses.distortion[off], column_of(block, "world_high")[off].astype(np.int64))
            if not column.count:
                return cls(context.rtol, np.zeros(0), {}, [], False)
            anchors, pairs, counts, centers = factor_pairs(column, context.rtol)
        finally:
            column.close()
        table = [explain_factor(center, w, context.world_sizes, context.rtol) for (_, w), center in zip(pairs, centers)]
        table = one_scaler(table, centers, context.rtol)
        plausible = sum(count for count, e in zip(counts, table) if e.kind != FactorKind.OTHER)
        numbered = {pair: index for index, pair in enumerate(pairs)}
        if len(table) > VARYING_CLUSTERS and plausible < PLAUSIBLE_SHARE * column.count:
            return cls(context.rtol, anchors, numbered, [FactorExplanation(FactorKind.OTHER, "c")], True)
        return cls(context.rtol, anchors, numbered, table, False)

    def in_spans(self, diagnosed: Iterable[tuple[pd.DataFrame, Diagnoses]]) -> bool:
        """Whether each factor holds over one span of the off steps of each group, as a schedule of λ does (0.3 for
        steps 0–999, then 0.1), rather than coming back (factors that alternate with the steps' counts)."""
        seen: set[tuple[str, int]] = set()
        last: tuple[str, int] | None = None
        for block, diagnoses in diagnosed:  # (a term's blocks: by group, then step)
            ids = self.ids(block, diagnoses)
            off = ids >= 0
            groups, labels = block.grp.astype(str).to_numpy()[off], ids[off]
            change = np.r_[True, (groups[1:] != groups[:-1]) | (labels[1:] != labels[:-1])] if len(labels) else off[:0]
            for key in zip(groups[change].tolist(), labels[change].tolist()):
                if key != last and key in seen:
                    return False
                seen.add(key)
                last = key
        return True

    def ids(self, block: pd.DataFrame, diagnoses: Diagnoses) -> npt.NDArray[np.int32]:
        """Per step of this block, the index of its explanation in `table` (−1: none)."""
        ids = np.full(len(diagnoses), -1, dtype=np.int32)
        off = np.flatnonzero(_uniform_off(block, diagnoses))
        if not len(off) or not self.table:
            return ids
        if self.varying:
            ids[off] = 0
            return ids
        # every q lies in the cluster whose smallest q is the largest at or below it
        labels = np.searchsorted(self.anchors, diagnoses.distortion[off], side="right") - 1
        world = column_of(block, "world_high")[off].astype(np.int64)
        found, inverse = np.unique(np.stack([labels, world], axis=1), axis=0, return_inverse=True)
        numbers = np.array([self.pairs[(int(label), int(w))] for label, w in found], dtype=np.int32)
        ids[off] = numbers[inverse.reshape(-1)]  # a lookup per distinct (cluster, W), not per step
        return ids


def _whole(block: pd.DataFrame) -> npt.NDArray[np.bool_]:
    """The steps every rank recorded: where one recorded none (missing_rank), N lacks its tokens and uniform
    weights read light by their share, no factor of the loss."""
    return np.asarray(column_of(block, "ranks") >= column_of(block, "world_high"))


def _uniform_off(block: pd.DataFrame, diagnoses: Diagnoses) -> npt.NDArray[np.bool_]:
    """The steps of every rank whose tokens all weigh q/N, one q ≠ 1."""
    return diagnoses.kind_is(StepKind.UNIFORM_OFF) & ~np.isnan(diagnoses.distortion) & _whole(block)


def factor_pairs(
    column: SortedColumn, rtol: float
) -> tuple[npt.NDArray[np.float64], list[tuple[int, int]], list[int], list[float]]:
    """The clusters of q (`cluster`) as their smallest q, and per (cluster, W) in that order (as np.unique
    orders them): its steps and its median q."""
    if not column.spilled:
        q, world = column.in_order()
        labels = cluster(q, rtol)
        found, inverse, counts = np.unique(
            np.stack([labels, world], axis=1), axis=0, return_inverse=True, return_counts=True
        )
        inverse = inverse.reshape(-1)
        order = np.argsort(q, kind="stable")
        anchors = q[order][np.flatnonzero(np.r_[True, np.diff(labels[order]) != 0])]
        centers = [float(np.median(q[inverse == index])) for index in range(len(found))]
        return anchors, [(int(label), int(w)) for label, w in found], [int(c) for c in counts], centers
    # On disk: one pass for the clusters and each (cluster, W)'s count, one for the medians, each the
    # middle of that pair's q in ascending order.
    chain = ClusterStarts(rtol)
    count: dict[tuple[int, int], int] = {}
    for values, worlds in column.chunks():
        for (label, w), n in zip(*_counted(chain.add(values), worlds)):
            count[(label, w)] = count.get((label, w), 0) + n
    pairs = sorted(count)
    wanted = {pair: middle_positions(0, count[pair]) for pair in pairs}
    seen = dict.fromkeys(pairs, 0)
    picked: dict[tuple[int, int], list[float]] = {pair: [] for pair in pairs}
    for values, worlds in column.chunks():
        labels = chain.of(values)
        for (label, w), _ in zip(*_counted(labels, worlds)):
            pair = (label, w)
            mine = values[(labels == label) & (worlds == w)]
            for position in wanted[pair]:
                if seen[pair] <= position < seen[pair] + len(mine):
                    picked[pair].append(float(mine[position - seen[pair]]))
            seen[pair] += len(mine)
    return np.array(chain.starts), pairs, [count[pair] for pair in pairs], [middle(picked[pair]) for pair in pairs]


def _counted(labels: npt.NDArray[Any], worlds: npt.NDArray[Any]) -> tuple[list[tuple[int, int]], list[int]]:
    """The distinct (label, W) of a chunk and how many of each."""
    found, counts = np.unique(np.stack([labels, worlds], axis=1), axis=0, return_counts=True)
    return [(int(label), int(w)) for label, w in found], [int(c) for c in counts]


def _extend(bounds: list[float], values: npt.NDArray[np.float64]) -> list[float]:
    """[lowest, highest] of the values seen so far, NaN left out (empty while none is a number)."""
    values = values[~np.isnan(values)]
    if not len(values):
        return bounds
    low, high = float(values.min()), float(values.max())
    return [min(bounds[0], low), max(bounds[1], high)] if bounds else [low, high]


class WeightingCheck(Check):
    """local_mean, per_micro_denominator, padded_denominator, unexplained_weighting, world_size_mismatch,
    loss_scale, scale_mismatch: one finding per (code, denominator, kind of factor, approximate fit), in
    order of first appearance, however many steps it spans, with the range of its factor."""

    judges_weighting = True

    def __init__(self, term: TermInputs) -> None:
        super().__init__(term)
        self.factors: FactorTable = term.factors
        self.extremes = term.extremes
        # A named term beside others (not the default "0") whose uniform weights are off by one factor over the
        # whole run, or by a few, each over its steps (a schedule: DeepSeek-V3's MTP weight 0.3, then 0.1), where
        # the terms are not all off by one factor: a coefficient λ chosen on purpose, or a factor missing from its
        # loss; only a declared λ tells (it is then divided out of e, and q is 1).
        self.term_weight = (
            self.context.term != UNNAMED
            and term.coefficient
            and 0 < len(self.factors.table) <= TERM_WEIGHTS
            and not self.factors.varying
            # a loss scale, and a W kept across a resize (W'/W from the resize on), are what they look like
            and not any(e.kind == FactorKind.LOSS_SCALE or e.label == "W'/W" for e in self.factors.table)
        )
        names = [e.label for e in self.factors.table] + [""]
        self.label_numbers = np.array([names.index(name) for name in names], dtype=np.int64)
        self.names = len(names)
        self.groups: dict[int, WeightingGroup] = {}

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        assert diagnoses is not None  # (judges_weighting)
        explanation = self.factors.ids(block, diagnoses)
        code, label = _weighting_codes(diagnoses, explanation, self.factors.table, self.term_weight, _whole(block))
        flagged = np.flatnonzero(code >= 0)
        if not len(flagged):
            return
        # The four as one integer key (labels of equal text are one label).
        key = (
            (code[flagged].astype(np.int64) * len(DENOMINATORS) + diagnoses.denominator[flagged]) * self.names
            + self.label_numbers[label[flagged]]
        ) * 2 + np.isnan(diagnoses.approximate[flagged])
        keys, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        steps = column_of(block, "step")
        ratio_all = weight_ratio(
            column_of(block, "token_weight_low").astype(float), column_of(block, "token_weight_high").astype(float)
        )
        for index in np.argsort(first):
            value = int(keys[index])
            rows = flagged[inverse == index]
            group = self.groups.get(value)
            if group is None:
                group = self.groups[value] = WeightingGroup(
                    ALL_CODES[int(code[rows[0]])],
                    DENOMINATORS[int(diagnoses.denominator[rows[0]])],
                    StepsSeen(self.keep_steps),
                )
            group.steps.add(steps[rows])
            group.count += len(rows)
            group.factor_range = _extend(group.factor_range, diagnoses.factor[rows])
            group.distortion_range = _extend(group.distortion_range, diagnoses.distortion[rows])
            approximate = diagnoses.approximate[rows]
            if not np.isnan(approximate).all():
                here = float(np.nanmax(approximate))
                group.approximate = here if math.isnan(group.approximate) else max(group.approximate, here)
            group.explanations.update(int(i) for i in np.unique(explanation[rows]))
            # The evidence's step: where tokens were weighted most unequally, then where q is furthest
            # from 1, the last of equals (np.lexsort((far, unequal))[-1] over every member).
            ratio = ratio_all[rows]
            unequal = np.where(ratio > 1 + self.context.rtol, ratio, 1.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                far = np.nan_to_num(np.abs(np.log(np.abs(diagnoses.distortion[rows]))), nan=0.0)
            here_index = int(np.lexsort((far, unequal))[-1])
            candidate = (float(unequal[here_index]), float(far[here_index]))
            if group.worst is None or candidate >= group.worst:  # a later step wins ties
                row = int(rows[here_index])
                group.worst, group.row = candidate, block.iloc[row]
                group.diagnosis, group.explanation = diagnoses[row], int(explanation[row])

    def findings(self) -> Iterator[Finding]:
        found = [
            weighting_finding(group, self.factors.table, self.context, self.extremes) for group in self.groups.values()
        ]
        # a count taken before the shift, read in groups of steps its weights fit differently: one finding,
        # the evidence of its most unequal step
        shifted = [f for f in found if "extra_labels_per_record" in f.evidence]
        if len(shifted) > 1:
            worst = max(shifted, key=lambda f: f.evidence["weight_ratio"])
            steps = StepRange(
                min(f.steps.first for f in shifted),
                max(f.steps.last for f in shifted),
                sum(f.steps.count for f in shifted),
            )
            found = [
                replace(f, steps=steps) if f is worst else f
                for f in found
                if f is worst or "extra_labels_per_record" not in f.evidence
            ]
        yield from found


class BalancedCheck(Check):
    """balanced_counts: in every step the counts that a local normalization needs to differ were
    equal, so the logs cannot tell it from the token mean."""

    judges_weighting = True

    def __init__(self, term: TermInputs) -> None:
        super().__init__(term)
        self.confused = term.confused
        self.nonempty = self.steps()
        self.counts: set[int] = set()
        self.balanced = True

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        if self.confused is None or diagnoses is None:
            return
        nonempty = column_of(block, "tokens") > 0
        self.nonempty.add(column_of(block, "step")[nonempty])
        self.counts.update(int(n) for n in np.unique(column_of(block, "record_tokens_high")[nonempty]))
        self.balanced = self.balanced and bool(diagnoses.balanced[nonempty].all())

    def findings(self) -> Iterator[Finding]:
        if self.confused is None:
            return
        counts = sorted(self.counts)
        what, mistake = DENOMINATOR_FACTS[self.confused].confused
        detail = f"every record had the same valid-token count ({step_list(counts)})" if self.balanced else what
        yield make_finding(
            self.context,
            Code.BALANCED_COUNTS,
            self.nonempty,
            f"In every step {detail}, so {mistake} and the global token mean give the same weights here: "
            "this run cannot show which one the code uses.",
            "audit a run with uneven counts (padding, ignored labels, different sequence lengths per rank)",
            {"counts": counts, "indistinguishable_from": self.confused.value},
        )
