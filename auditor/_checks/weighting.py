"""The weights: which denominator and factor the run used, and the finding that names them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._checks.base import BF16_HINT, BF16_ROUNDING, DENOMINATOR_WORDS, Check, Extremes, RunContext, StepsSeen, TermInputs, weight_ratio, average_fix, column_of, make_finding, step_list
from tokaudit._checks.causes import COUNTED_BEFORE_SHIFT_FIX, UNTOLD, counted_before_shift, counted_before_shift_text, overcounted, world_size_cause
from tokaudit._checks.rescale import schedule_finding
from tokaudit._checks.structure import ALL_CODES
from tokaudit.codes import Code
from tokaudit._normalization import DENOMINATOR_FACTS, DENOMINATORS, FORMULA, Denominator, Diagnoses, FactorExplanation, FactorKind, StepKind, ClusterStarts, close, cluster, explain_factor
from tokaudit._recipes import advice
from tokaudit._report import Finding, StepRange
from tokaudit._schema import UNNAMED
from tokaudit._sorting import SortedColumn, middle, middle_positions


_NONUNIFORM_CODES = {d: facts.code for d, facts in DENOMINATOR_FACTS.items() if facts.code is not None}

VARYING_CLUSTERS = 3

PLAUSIBLE_SHARE = 0.9
"""More distinct uniform factors than VARYING_CLUSTERS, most of them no plausible W or loss scale:
one factor that varies from step to step, whatever a few steps happen to land on."""

def _weighting_codes(diagnoses: Diagnoses, explanation: npt.NDArray[np.int32],
                     table: list[FactorExplanation]) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.int32]]:
    """Per step, the index in ALL_CODES of its weighting finding (−1: none), and the explanation whose
    label tells kinds of factor apart (for world_size_mismatch and loss_scale; −1 otherwise).
    Narrow integers (2 and 4 bytes a step): at millions of steps every per-step array counts."""
    by_denominator = np.array([ALL_CODES.index(_NONUNIFORM_CODES.get(d, Code.UNEXPLAINED_WEIGHTING))
                               for d in DENOMINATORS], dtype=np.int16)
    code = np.where(diagnoses.kind_is(StepKind.NONUNIFORM), by_denominator[diagnoses.denominator], np.int16(-1))
    kinds = {FactorKind.WORLD_SIZE: Code.WORLD_SIZE_MISMATCH, FactorKind.LOSS_SCALE: Code.LOSS_SCALE,
             FactorKind.OTHER: Code.SCALE_MISMATCH}
    by_explanation = np.array([ALL_CODES.index(kinds[e.kind]) for e in table] + [ALL_CODES.index(Code.SCALE_MISMATCH)],
                              dtype=np.int16)  # the last entry stands for "none"
    labelled = np.array([e.kind != FactorKind.OTHER for e in table] + [False])
    off = diagnoses.kind_is(StepKind.UNIFORM_OFF)
    padded = np.isin(diagnoses.denominator, [DENOMINATORS.index(Denominator.POSITIONS),
                                             DENOMINATORS.index(Denominator.STEP_POSITIONS)])
    raw = diagnoses.denominator == DENOMINATORS.index(Denominator.ONE)
    named = np.where(explanation >= 0, explanation, np.int32(len(table)))
    # Written in place, one condition at a time: no nested np.where of whole columns.
    code[off] = by_explanation[named[off]]
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
                off = diagnoses.kind_is(StepKind.UNIFORM_OFF) & ~np.isnan(diagnoses.distortion)
                if off.any():
                    column.add(diagnoses.distortion[off], column_of(block, "world_high")[off].astype(np.int64))
            if not column.count:
                return cls(context.rtol, np.zeros(0), {}, [], False)
            anchors, pairs, counts, centers = factor_pairs(column, context.rtol)
        finally:
            column.close()
        table = [explain_factor(center, w, context.world_sizes, context.rtol) for (_, w), center in zip(pairs, centers)]
        plausible = sum(count for count, e in zip(counts, table) if e.kind != FactorKind.OTHER)
        numbered = {pair: index for index, pair in enumerate(pairs)}
        if len(table) > VARYING_CLUSTERS and plausible < PLAUSIBLE_SHARE * column.count:
            return cls(context.rtol, anchors, numbered, [FactorExplanation(FactorKind.OTHER, "c")], True)
        return cls(context.rtol, anchors, numbered, table, False)

    def ids(self, block: pd.DataFrame, diagnoses: Diagnoses) -> npt.NDArray[np.int32]:
        """Per step of this block, the index of its explanation in `table` (−1: none)."""
        ids = np.full(len(diagnoses), -1, dtype=np.int32)
        off = np.flatnonzero(diagnoses.kind_is(StepKind.UNIFORM_OFF) & ~np.isnan(diagnoses.distortion))
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

def factor_pairs(column: SortedColumn, rtol: float
           ) -> tuple[npt.NDArray[np.float64], list[tuple[int, int]], list[int], list[float]]:
    """The clusters of q (`cluster`) as their smallest q, and per (cluster, W) in that order (as np.unique
    orders them): its steps and its median q."""
    if not column.spilled:
        q, world = column.in_order()
        labels = cluster(q, rtol)
        found, inverse, counts = np.unique(np.stack([labels, world], axis=1), axis=0, return_inverse=True,
                                           return_counts=True)
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

@dataclass
class _WeightingGroup:
    """The steps of one weighting finding (one code, denominator, kind of factor and fit)."""

    code: Code
    denominator: Denominator
    steps: StepsSeen
    worst: tuple[float, float] | None = None
    """(how unequally tokens were weighted, how far q is from 1) at the worst step so far."""
    row: Any = None
    diagnosis: Any = None
    explanation: int = -1
    factor_range: list[float] = field(default_factory=list)
    distortion_range: list[float] = field(default_factory=list)
    approximate: float = math.nan
    explanations: set[int] = field(default_factory=set)
    count: int = 0

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
        names = [e.label for e in self.factors.table] + [""]
        self.label_numbers = np.array([names.index(name) for name in names], dtype=np.int64)
        self.names = len(names)
        self.groups: dict[int, _WeightingGroup] = {}

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        assert diagnoses is not None  # (judges_weighting)
        explanation = self.factors.ids(block, diagnoses)
        code, label = _weighting_codes(diagnoses, explanation, self.factors.table)
        flagged = np.flatnonzero(code >= 0)
        if not len(flagged):
            return
        # The four as one integer key (labels of equal text are one label).
        key = ((code[flagged].astype(np.int64) * len(DENOMINATORS) + diagnoses.denominator[flagged]) * self.names
               + self.label_numbers[label[flagged]]) * 2 + np.isnan(diagnoses.approximate[flagged])
        keys, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        steps = column_of(block, "step")
        ratio_all = weight_ratio(column_of(block, "token_weight_low").astype(float),
                                 column_of(block, "token_weight_high").astype(float))
        for index in np.argsort(first):
            value = int(keys[index])
            rows = flagged[inverse == index]
            group = self.groups.get(value)
            if group is None:
                group = self.groups[value] = _WeightingGroup(ALL_CODES[int(code[rows[0]])],
                                                             DENOMINATORS[int(diagnoses.denominator[rows[0]])],
                                                             StepsSeen(self.keep_steps))
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
        found = [_weighting_finding(group, self.factors.table, self.context, self.extremes)
                 for group in self.groups.values()]
        # a count taken before the shift, read in groups of steps its weights fit differently: one finding,
        # the evidence of its most unequal step
        shifted = [f for f in found if "extra_labels_per_record" in f.evidence]
        if len(shifted) > 1:
            worst = max(shifted, key=lambda f: f.evidence["weight_ratio"])
            steps = StepRange(min(f.steps.first for f in shifted), max(f.steps.last for f in shifted),
                              sum(f.steps.count for f in shifted))
            found = [replace(f, steps=steps) if f is worst else f for f in found
                     if f is worst or "extra_labels_per_record" not in f.evidence]
        yield from found

def _range(values: list[float]) -> list[float]:
    return [float(min(values)), float(max(values))]

def _weighting_finding(group: _WeightingGroup, table: list[FactorExplanation], context: RunContext,
                       extremes: Extremes | None = None) -> Finding:
    """The finding of one group of steps weighted alike: the evidence every such finding holds, then what is
    said of weights that differ inside a step or of uniform weights off by a factor."""
    row, diagnosis = group.row, group.diagnosis
    factors = group.factor_range
    evidence: dict[str, Any] = {"step": int(row.step), "denominator": group.denominator.value,
                                "factor": diagnosis.factor, "world_size": int(row.world_high),
                                "grad_divisor": float(row.divisor_high), "global_tokens": int(row.tokens)}
    if factors:
        evidence["factor_range"] = _range(factors)
    grp = f" (group {row.grp})" if str(row.grp) != UNNAMED else ""
    tokens = int(row.tokens)
    lightest, heaviest = ((float(row.weight_low) * tokens, float(row.weight_high) * tokens)
                          if diagnosis.kind == StepKind.NONUNIFORM else _range(group.distortion_range or [math.nan]))
    rescaled = schedule_finding(context, group.steps, lightest, heaviest, int(row.step), tokens, evidence)
    if rescaled is not None:
        return rescaled
    if diagnosis.kind == StepKind.NONUNIFORM:
        return _nonuniform_finding(group, context, evidence, grp, extremes)
    return _uniform_finding(group, table, context, evidence, grp)


def _nonuniform_finding(group: _WeightingGroup, context: RunContext, evidence: dict[str, Any], grp: str,
                        extremes: Extremes | None) -> Finding:
    """Tokens of one step weighed differently: where the heaviest and lightest were, and the denominator."""
    code, denominator, row, diagnosis = group.code, group.denominator, group.row, group.diagnosis
    step, tokens = int(row.step), int(row.tokens)
    heavy_e, light_e = float(row.weight_high), float(row.weight_low)
    ratio = heavy_e / light_e if light_e > 0 else math.inf
    heavy, light = _described(row, extremes, heavy_e, light_e, tokens)
    # the gate's ratio (--min-ratio) is the tokens' (`weight_ratio`): the probe's where it saw weights differ inside
    # a record, which the records' mean weights described here cannot show
    tokens_ratio = float(weight_ratio(float(row.token_weight_low), float(row.token_weight_high)))
    evidence.update({"heaviest": heavy, "lightest": light, "weight_ratio": tokens_ratio})
    where = (f"at step {step}{grp} a token on rank {heavy['rank']} (microbatch {heavy['micro']}, "
             f"n={heavy['valid_tokens']}) received {ratio:.3g}× the weight of a token on rank {light['rank']} "
             f"(microbatch {light['micro']}, n={light['valid_tokens']}); the correct weight is 1/N = 1/{tokens}, "
             f"they got {heavy_e * tokens:.3g}/N and {light_e * tokens:.3g}/N")
    shift = counted_before_shift((heavy["valid_tokens"], heavy_e), (light["valid_tokens"], light_e), tokens,
                                 int(row.records)) if code in (Code.LOCAL_MEAN, Code.UNEXPLAINED_WEIGHTING) else None
    if shift is not None:  # no denominator of the vocabulary: a count, the labels' own, with k more labels
        evidence["extra_labels_per_record"] = shift
        return make_finding(context, Code.UNEXPLAINED_WEIGHTING, group.steps, counted_before_shift_text(shift, where),
                            COUNTED_BEFORE_SHIFT_FIX, evidence)
    alpha = "?" if diagnosis.factor is None else f"{diagnosis.factor:.4g}"
    formula = f"b·g = {alpha}·{FORMULA.get(denominator, '?')}"
    near = ""
    if diagnosis.approximate is not None:
        off = group.approximate
        evidence.update({"approximate": True, "approximation_error": off})
        near = (f"The weights fit {DENOMINATOR_WORDS[denominator]} only approximately (α varies by up to "
                f"{off:.2%}; a count that is off by a few tokens per sequence, such as one extra label per "
                "row from unshifted labels, does this). ")
    if code == Code.LOCAL_MEAN and denominator == Denominator.MICRO_TIMES_M:
        message = (f"{near}Each microbatch's loss was its own mean over its n valid tokens, divided by the "
                   f"number of microbatches M={context.microbatches} (loss.mean() / gradient_accumulation_steps; "
                   f"{formula}), so microbatches count equally instead of tokens: {where}.")
    elif code == Code.LOCAL_MEAN and denominator == Denominator.MICRO and _is_world_size(diagnosis.factor, context):
        message = _mean_times_w(context, near, formula, where)
    elif code == Code.LOCAL_MEAN:
        message = (f"{near}Each loss was divided by {DENOMINATOR_WORDS[denominator]} ({formula}), so ranks "
                   f"and microbatches count equally instead of tokens: {where}.")
    elif code == Code.PER_MICRO_DENOMINATOR:
        message = (f"{near}Each microbatch was divided by its own global count N_m instead of the step's N "
                   f"({formula}): {where}.")
    elif code == Code.PADDED_DENOMINATOR:
        message = (f"{near}The loss was divided by the positions T of each microbatch, padding and ignored "
                   f"labels included ({formula}): {where}.")
    elif diagnosis.approximate is not None:
        message = (f"Tokens of one step received different weights; the nearest denominator is "
                   f"{DENOMINATOR_WORDS[denominator]} ({formula}), off by up to "
                   f"{evidence['approximation_error']:.2%}: {where}.")
        # nearest to the token mean itself (b·g = D·S/N, q = 1), and within bf16's rounding of it
        if denominator == Denominator.N and evidence["approximation_error"] <= BF16_ROUNDING and \
                diagnosis.factor is not None and abs(diagnosis.factor / float(row.divisor_high) - 1) <= BF16_ROUNDING:
            evidence["within_bfloat16_rounding"] = True
            message += BF16_HINT
    else:
        message = (f"Tokens of one step received different weights and no denominator (n, n_r, n·M, N_m, N, T, "
                   f"1) explains them: {where}.")
    return make_finding(context, code, group.steps, message, average_fix(context), evidence)


def _uniform_finding(group: _WeightingGroup, table: list[FactorExplanation], context: RunContext,
                     evidence: dict[str, Any], grp: str) -> Finding:
    """Every token of a step weighed alike, but q = e·N is not 1: a padded count, a loss scale, a world-size
    factor, a raw sum or another constant."""
    code, denominator, row, diagnosis = group.code, group.denominator, group.row, group.diagnosis
    step, w, tokens = int(row.step), int(row.world_high), int(row.tokens)
    explanation = table[group.explanation] if group.explanation >= 0 else None
    q = diagnosis.distortion or 0.0
    distortions = group.distortion_range
    evidence.update({"distortion": q, "effective_weight": q / tokens, "distortion_range": _range(distortions)})
    spread = "" if len(set(np.round(distortions, 12))) <= 1 else \
        f"; over the {group.count} step(s) q ranges from {min(distortions):.4g} to {max(distortions):.4g}"
    scaled = (f"every valid token received {q:.4g}/N instead of 1/N (step {step}{grp}, N={tokens}, W={w}, "
              f"D={row.divisor_high:g}){spread}")
    if code == Code.PADDED_DENOMINATOR:
        evidence["positions"] = int(row.positions)
        message = (f"The loss was divided by all {int(row.positions)} positions of the step, padding and ignored "
                   f"labels included, instead of its {tokens} valid tokens: {scaled}.")
        return make_finding(context, code, group.steps, message, average_fix(context), evidence)
    if code == Code.LOSS_SCALE:
        assert explanation is not None
        exponents = sorted({j for i in group.explanations if i >= 0 and (j := table[i].integer) is not None})
        evidence["loss_scale_exponents"] = exponents
        shown = " to ".join(f"2^{j}" for j in ([exponents[0], exponents[-1]] if len(exponents) > 1 else exponents))
        message = (f"Weights are uniform but carry a power-of-two factor ({shown}) that W={w} does not explain: "
                   f"{scaled}. This is the loss scale of mixed precision (a GradScaler), which the log does not "
                   "record, so the gradient's true scale cannot be judged here.")
        fix = ("pass the scaler to the recorder, Recorder(..., scaler=scaler), so its scale is divided out of the "
               "weights (the Hugging Face and Lightning callbacks find the trainer's scaler themselves)")
        return make_finding(context, code, group.steps, message, fix, evidence)
    if code == Code.WORLD_SIZE_MISMATCH:
        assert explanation is not None
        cause = world_size_cause(explanation, q, w, float(row.divisor_high), context)
        evidence["integer_factor"] = {"1/W": f"1/{w}", "1/k": f"1/{explanation.integer}", "W'/W": f"{explanation.integer}/{w}",
                                      "k/W": f"{explanation.integer}/{w}"}.get(explanation.label, explanation.integer)
        if explanation.label == "W'/W":
            evidence["world_sizes"] = [explanation.integer, w]
            evidence["stale_world_size"] = explanation.integer
        message = f"Weights are uniform but off by a world-size factor: {scaled}; {cause}."
        if close(q * float(row.divisor_high), float(tokens), context.rtol):  # e = 1/D: b = S, as a raw sum
            message += UNTOLD
        return make_finding(context, code, group.steps, message, average_fix(context), evidence)
    if denominator == Denominator.ONE:
        message = (f"The loss sum was backpropagated without a token denominator (b·g = {diagnosis.factor:g}·S): "
                   f"{scaled}; the gradient's size grows with the number of valid tokens (under SGD so does the step; "
                   f"under Adam(W) its balance against epsilon, weight decay and gradient clipping shifts).{UNTOLD}")
    else:
        aux = (" If this term is weighted on purpose (an auxiliary loss coefficient λ), this is that λ."
               if context.term != UNNAMED else "")
        what = "a constant" if not spread else "a factor that changes from step to step"
        message = f"Weights are uniform within each step but scaled by {what}: {scaled}.{aux}"
        if spread and max(distortions) < 1:
            message += overcounted(context)
            if own_fix := advice(context.trainer, "overcounted_fix"):
                return make_finding(context, code, group.steps, message, own_fix, evidence)
        if max(abs(d - 1) for d in distortions) <= BF16_ROUNDING:
            evidence["within_bfloat16_rounding"] = True
            message += BF16_HINT
    return make_finding(context, code, group.steps, message, average_fix(context), evidence)


def _mean_times_w(context: RunContext, near: str, formula: str, where: str) -> str:
    """b·g = W·S/n: each microbatch's own mean, times the W meant for a sum divided by the step's N, and not
    divided by M; DDP's average then sums W·M such means, about W·M times the token mean's size."""
    w, m = context.world_size, context.microbatches
    own = advice(context.trainer, "mean_times_w")
    trainer = f" {own}" if own else ""
    return (f"{near}Each microbatch's loss was its own mean over its n valid tokens, multiplied by W={w} and not "
            f"divided by the M={m} microbatches ({formula}), so microbatches count equally instead of tokens and "
            f"the gradient is about W·M={w * m} times the token mean's: {where}.{trainer}")


def _is_world_size(factor: float | None, context: RunContext) -> bool:
    """α is the run's W (several: any of them), within the tolerance."""
    sizes = context.world_sizes or (context.world_size,)
    return factor is not None and any(w > 0 and close(factor, float(w), context.rtol) for w in sizes)


def _described(row: Any, extremes: Extremes | None, heavy_e: float, light_e: float, tokens: int
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The records of the step's heaviest and lightest token (`_describe`), from the row's own evidence columns
    or found now."""
    if "heavy_rank" in row.index:
        located = row
    elif extremes is not None:
        located = extremes(row)
    else:
        raise ValueError("the step table lacks the evidence columns (heavy_rank, ...) and no way to find them")
    return _describe(located, "heavy", heavy_e, tokens), _describe(located, "light", light_e, tokens)


def _describe(row: Any, which: str, weight: float, tokens: int) -> dict[str, Any]:
    return {"rank": int(getattr(row, f"{which}_rank")), "micro": int(getattr(row, f"{which}_micro")),
            "valid_tokens": int(getattr(row, f"{which}_n")), "rank_tokens": int(getattr(row, f"{which}_rank_tokens")),
            "effective_weight": weight, "distortion": weight * tokens}


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
        yield make_finding(self.context, Code.BALANCED_COUNTS, self.nonempty,
                       f"In every step {detail}, so {mistake} and the global token mean give the same weights here: "
                       "this run cannot show which one the code uses.",
                       "audit a run with uneven counts (padding, ignored labels, different sequence lengths per rank)",
                       {"counts": counts, "indistinguishable_from": self.confused.value})
