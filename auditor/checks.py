"""Checks over the per-step table: each problem becomes one finding with its numbers and its fix.

Pure functions of the step table (one row per run, group, term and step): no Parquet, no DuckDB.
Notation (SPEC §1): per record S, n, b; c = b/S (or the probe's Σ∂b/∂ℓ / n); e = c·g/D;
N = Σn over the step of one term. A step is correct iff q = e·N = 1 for every record with n > 0.
How the normalization is recovered lives in `tokaudit.normalization`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit.codes import DEFAULT_SEVERITY, Code, Severity
from tokaudit.engine import one_value
from tokaudit.normalization import (
    BLOCK_STEPS,
    DENOMINATORS,
    FORMULA,
    Denominator,
    Diagnoses,
    FactorExplanation,
    FactorKind,
    Span,
    StepKind,
    cluster,
    diagnose_steps,
    explain_factor,
    row_indices,
    segments,
)
from tokaudit.report import Finding, StepRange
from tokaudit.schema import UNNAMED

DENOMINATOR_WORDS = {
    Denominator.N: "the step's global valid-token count N",
    Denominator.MICRO_GLOBAL: "each microbatch's own global count N_m",
    Denominator.RANK: "each rank's own valid-token count n_r",
    Denominator.MICRO_TIMES_M: "each microbatch's own mean (its own count n) divided by the number of microbatches M",
    Denominator.MICRO: "each microbatch's own count n",
    Denominator.POSITIONS: "the positions of each microbatch, padding and ignored labels included",
    Denominator.STEP_POSITIONS: "the positions of the whole step, padding and ignored labels included",
    Denominator.ONE: "nothing (a raw loss sum)",
    Denominator.UNDETERMINED: "undetermined: counts are equal everywhere, so local and global means coincide",
    Denominator.UNEXPLAINED: "no single denominator",
}

_NONUNIFORM_CODES = {
    Denominator.RANK: Code.LOCAL_MEAN, Denominator.MICRO_TIMES_M: Code.LOCAL_MEAN, Denominator.MICRO: Code.LOCAL_MEAN,
    Denominator.MICRO_GLOBAL: Code.PER_MICRO_DENOMINATOR, Denominator.POSITIONS: Code.PADDED_DENOMINATOR,
}

VARYING_CLUSTERS = 3
PLAUSIBLE_SHARE = 0.9
"""More distinct uniform factors than VARYING_CLUSTERS, most of them no plausible W or loss scale:
one factor that varies from step to step, whatever a few steps happen to land on."""

MAX_DECIMALS = 6
"""A reported loss rounded to at most this many decimals is compared within half its last digit."""


@dataclass(frozen=True, slots=True)
class RunContext:
    """What the fixes and messages of one run (and one loss term) need to name."""

    run: str
    term: str
    world_size: int
    world_sizes: tuple[int, ...]
    microbatches: int
    divisor: float
    rtol: float


Extremes = Callable[[Any], Any]
"""Given a row of the step table without the evidence columns (`engine.EXTREME_COLUMNS`), a row with them."""


def check_run(run: str, steps: pd.DataFrame, rtol: float,
              duplicates: tuple[int, int, int, int] | None = None,
              extremes: Extremes | None = None) -> tuple[list[Finding], list[Span], int]:
    """All checks for one run's steps (every group and term): its findings, its normalization spans
    (at most `MAX_SPANS` per group and term) and how many spans were left out.

    Each loss term is its own token mean (SPEC §1): recovery and weight checks run per term.
    `duplicates`: (records dropped, first step, last step, steps) when the reader found repeated keys.
    `extremes`: where the heaviest and lightest token of an evidence step were, when the table does not
    hold them (the audit aggregates them for the few steps a finding names)."""
    findings: list[Finding] = []
    spans: list[Span] = []
    omitted = 0
    sizes = tuple(world_sizes(steps))
    terms = loss_terms(steps)
    for term in terms:
        frame = steps if len(terms) == 1 else steps[steps.term.astype(str) == term].reset_index(drop=True)
        diagnoses = diagnose_steps(frame, rtol)
        context = RunContext(run=run, term=term, world_size=int(frame.w_high.mode().iloc[0]), world_sizes=sizes,
                             microbatches=int(frame.m_high.max()), divisor=float(frame.d_high.mode().iloc[0]),
                             rtol=rtol)
        findings.extend(_weighting_findings(frame, diagnoses, context, extremes))
        checks = [_value_findings, _probe_findings, _missing_ranks, _divisor_findings, _weight_presence]
        if term == terms[0]:
            # What concerns the backward passes themselves (W, microbatches, sync) is said once.
            checks = [_structure_findings, _sync_findings, *checks]
        for check in checks:
            findings.extend(check(frame, context))
        findings.extend(_balanced(frame, diagnoses, context))
        listed, left_out = segments(frame, diagnoses)
        spans.extend(listed)
        omitted += left_out
    findings.extend(_reported_findings(steps, run, rtol, terms[0]))
    if duplicates is not None:
        findings.append(_duplicates(duplicates, run))
    return findings, spans, omitted


def _finding(context: RunContext, code: Code, steps: list[int] | np.ndarray, message: str, fix: str,
             evidence: dict[str, Any], severity: Severity | None = None) -> Finding:
    numbers = np.asarray(steps, dtype=np.int64)
    if context.term != UNNAMED:
        message = f"[term {context.term}] {message}"
    # Steps of one group come in order, each once: counted without a hash of millions of them.
    increasing = len(numbers) < 2 or bool((numbers[1:] > numbers[:-1]).all())
    return Finding(run=context.run, code=code, severity=severity or DEFAULT_SEVERITY[code],
                   steps=StepRange(first=int(numbers.min()), last=int(numbers.max()),
                                   count=len(numbers) if increasing else len(np.unique(numbers))),
                   message=message, fix=fix, evidence=evidence, term=context.term)


def _fix_average(context: RunContext) -> str:
    w, m = context.world_size, context.microbatches
    over = f"all {m} microbatches of the step on all {w} ranks" if m > 1 else f"all {w} ranks"
    if context.divisor == 1:
        return (f"backpropagate S_r/N (the reduction sums, D=1) with N the valid tokens of {over}, "
                "counted before the first backward with one all-reduce")
    return (f"backpropagate W·S_r/N with W={w} (the size of the averaging group) and N summed over {over}, "
            "counted before the first backward with one all-reduce")


# ---------------------------------------------------------------------------------- weights


_CODES: tuple[Code, ...] = tuple(Code)


def _weighting_codes(diagnoses: Diagnoses, explanation: npt.NDArray[np.int32],
                     table: list[FactorExplanation]) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.int32]]:
    """Per step, the index in _CODES of its weighting finding (−1: none), and the explanation whose
    label tells kinds of factor apart (for world_size_mismatch and loss_scale; −1 otherwise).
    Narrow integers (2 and 4 bytes a step): at millions of steps every per-step array counts."""
    by_denominator = np.array([_CODES.index(_NONUNIFORM_CODES.get(d, Code.UNEXPLAINED_WEIGHTING))
                               for d in DENOMINATORS], dtype=np.int16)
    code = np.where(diagnoses.kind_is(StepKind.NONUNIFORM), by_denominator[diagnoses.denominator], np.int16(-1))
    kinds = {FactorKind.WORLD_SIZE: Code.WORLD_SIZE_MISMATCH, FactorKind.LOSS_SCALE: Code.LOSS_SCALE,
             FactorKind.OTHER: Code.SCALE_MISMATCH}
    by_explanation = np.array([_CODES.index(kinds[e.kind]) for e in table] + [_CODES.index(Code.SCALE_MISMATCH)],
                              dtype=np.int16)  # the last entry stands for "none"
    labelled = np.array([e.kind != FactorKind.OTHER for e in table] + [False])
    off = diagnoses.kind_is(StepKind.UNIFORM_OFF)
    padded = np.isin(diagnoses.denominator, [DENOMINATORS.index(Denominator.POSITIONS),
                                             DENOMINATORS.index(Denominator.STEP_POSITIONS)])
    raw = diagnoses.denominator == DENOMINATORS.index(Denominator.ONE)
    named = np.where(explanation >= 0, explanation, np.int32(len(table)))
    # Written in place, one condition at a time: no nested np.where of whole columns.
    code[off] = by_explanation[named[off]]
    code[off & raw] = _CODES.index(Code.SCALE_MISMATCH)
    code[off & padded] = _CODES.index(Code.PADDED_DENOMINATOR)
    label = np.where(off & ~padded & ~raw & labelled[named], named, np.int32(-1))
    return code, label


def _weighting_findings(steps: pd.DataFrame, diagnoses: Diagnoses, context: RunContext,
                        extremes: Extremes | None = None) -> Iterator[Finding]:
    """local_mean, per_micro_denominator, padded_denominator, unexplained_weighting, world_size_mismatch,
    loss_scale, scale_mismatch: one finding per (code, denominator, kind of factor), however many
    steps it spans, with the range of its factor. Steps are grouped as columns, not one by one."""
    explanation, table = _factor_explanations(steps, diagnoses, context)
    code, label = _weighting_codes(diagnoses, explanation, table)
    flagged = row_indices(code >= 0)
    if not len(flagged):
        return
    # One finding per (code, denominator, label of the factor, approximate fit), in order of first
    # appearance: the four as one integer key (labels of equal text are one label), each flagged step's
    # key's number found a block of steps at a time (a few distinct keys: no sort of every flagged step).
    names = [e.label for e in table] + [""]
    label_numbers = np.array([names.index(name) for name in names], dtype=np.int64)
    group = np.empty(len(flagged), dtype=np.int32)
    numbers: dict[int, int] = {}
    for start in range(0, len(flagged), BLOCK_STEPS):
        rows = flagged[start:start + BLOCK_STEPS]
        key = ((code[rows].astype(np.int64) * len(DENOMINATORS) + diagnoses.denominator[rows]) * len(names)
               + label_numbers[label[rows]]) * 2 + np.isnan(diagnoses.approximate[rows])
        keys, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        for value in keys[np.argsort(first)]:
            numbers.setdefault(int(value), len(numbers))
        group[start:start + len(rows)] = np.array([numbers[int(value)] for value in keys], np.int32)[inverse]
    del label
    for number in range(len(numbers)):
        members = flagged[group == number]
        worst = _worst(steps, diagnoses, members, context.rtol)
        code_index = int(code[members[0]])
        yield _weighting_finding(_CODES[code_index], DENOMINATORS[int(diagnoses.denominator[members[0]])], steps,
                                 diagnoses, members, worst, explanation, table, context, extremes)


def _worst(steps: pd.DataFrame, diagnoses: Diagnoses, members: npt.NDArray[Any], rtol: float) -> int:
    """The step of a finding its evidence comes from: where tokens were weighted most unequally, then
    where q is furthest from 1, the last of equals (np.lexsort((far, unequal))[-1] over every member),
    found a block of members at a time (no ratio, log and sort of millions of steps at once)."""
    best: tuple[float, float, int] | None = None
    for start in range(0, len(members), BLOCK_STEPS):
        rows = members[start:start + BLOCK_STEPS]
        ratio = _ratios(steps, rows)
        unequal = np.where(ratio > 1 + rtol, ratio, 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            far = np.nan_to_num(np.abs(np.log(np.abs(diagnoses.distortion[rows]))), nan=0.0)
        here = int(np.lexsort((far, unequal))[-1])
        candidate = (float(unequal[here]), float(far[here]), int(rows[here]))
        # a later block wins ties, as the later row does within one
        if best is None or candidate[:2] >= best[:2]:
            best = candidate
    assert best is not None
    return best[2]


def _factor_explanations(steps: pd.DataFrame, diagnoses: Diagnoses, context: RunContext
                         ) -> tuple[npt.NDArray[np.int32], list[FactorExplanation]]:
    """Name each uniform factor q ≠ 1, per cluster of equal q: per step an index into the returned
    table (−1: none). A factor that differs from step to step (a count off by a few tokens per
    row: q = N/(N+4)) is one varying constant: its steps that land on 1/2 or 1/3 by chance are no
    world-size mistake."""
    ids = np.full(len(diagnoses), -1, dtype=np.int32)
    off = np.flatnonzero(diagnoses.kind_is(StepKind.UNIFORM_OFF) & ~np.isnan(diagnoses.distortion))
    if not len(off):
        return ids, []
    q = diagnoses.distortion[off]
    labels = cluster(q, context.rtol)
    world = steps.w_high.to_numpy()[off].astype(np.int64)
    pairs, inverse = np.unique(np.stack([labels, world], axis=1), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    table = []
    for index, (label, w) in enumerate(pairs):
        center = float(np.median(q[inverse == index]))
        table.append(explain_factor(center, int(w), context.world_sizes, context.rtol))
    plausible = np.array([e.kind != FactorKind.OTHER for e in table])[inverse].sum()
    if len(table) > VARYING_CLUSTERS and plausible < PLAUSIBLE_SHARE * len(off):
        table, inverse = [FactorExplanation(FactorKind.OTHER, "c")], np.zeros(len(off), dtype=np.int64)
    ids[off] = inverse
    return ids, table


def _ratios(steps: pd.DataFrame, rows: np.ndarray | None = None) -> np.ndarray:
    """Per step (at these rows), the heaviest token's weight over the lightest's (∞ when the lightest is 0)."""
    low, high = steps.tok_low.to_numpy(dtype=float), steps.tok_high.to_numpy(dtype=float)
    if rows is not None:
        low, high = low[rows], high[rows]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(low > 0, high / low, np.inf)


def _range(values: list[float]) -> list[float]:
    return [float(min(values)), float(max(values))]


def _weighting_finding(code: Code, denominator: Denominator, steps: pd.DataFrame, diagnoses: Diagnoses,
                       members: npt.NDArray[np.int64], worst: int, explanations: npt.NDArray[np.int32],
                       table: list[FactorExplanation], context: RunContext, extremes: Extremes | None = None) -> Finding:
    row = steps.iloc[worst]
    diagnosis = diagnoses[worst]
    step, w, tokens = int(row.step), int(row.w_high), int(row.tokens)
    step_numbers = steps.step.to_numpy()[members]
    explanation = table[explanations[worst]] if explanations[worst] >= 0 else None
    member_factors = diagnoses.factor[members]
    factors = [float(np.nanmin(member_factors)), float(np.nanmax(member_factors))] \
        if not np.isnan(member_factors).all() else []
    evidence: dict[str, Any] = {"step": step, "denominator": denominator.value, "factor": diagnosis.factor,
                                "world_size": w, "grad_divisor": float(row.d_high), "global_tokens": tokens}
    if factors:
        evidence["factor_range"] = _range(factors)
    group = f" (group {row.grp})" if str(row.grp) != UNNAMED else ""
    if diagnosis.kind == StepKind.NONUNIFORM:
        heavy_e, light_e = float(row.e_high), float(row.e_low)
        ratio = heavy_e / light_e if light_e > 0 else math.inf
        if "heavy_rank" in steps.columns:
            located = row
        elif extremes is not None:
            located = extremes(row)
        else:
            raise ValueError("the step table lacks the evidence columns (heavy_rank, ...) and no way to find them")
        heavy = _describe(located, "heavy", heavy_e, tokens)
        light = _describe(located, "light", light_e, tokens)
        evidence.update({"heaviest": heavy, "lightest": light, "weight_ratio": ratio})
        where = (f"at step {step}{group} a token on rank {heavy['rank']} (microbatch {heavy['micro']}, "
                 f"n={heavy['valid_tokens']}) received {ratio:.3g}× the weight of a token on rank {light['rank']} "
                 f"(microbatch {light['micro']}, n={light['valid_tokens']}); the correct weight is 1/N = 1/{tokens}, "
                 f"they got {heavy_e * tokens:.3g}/N and {light_e * tokens:.3g}/N")
        alpha = "?" if diagnosis.factor is None else f"{diagnosis.factor:.4g}"
        formula = f"b·g = {alpha}·{FORMULA.get(denominator, '?')}"
        near = ""
        if diagnosis.approximate is not None:
            off = float(np.nanmax(diagnoses.approximate[members]))
            evidence.update({"approximate": True, "approximation_error": off})
            near = (f"The weights fit {DENOMINATOR_WORDS[denominator]} only approximately (α varies by up to "
                    f"{off:.2%}; a count that is off by a few tokens per sequence, such as one extra label per "
                    "row from unshifted labels, does this). ")
        if code == Code.LOCAL_MEAN and denominator == Denominator.MICRO_TIMES_M:
            message = (f"{near}Each microbatch's loss was its own mean over its n valid tokens, divided by the "
                       f"number of microbatches M={context.microbatches} (loss.mean() / gradient_accumulation_steps; "
                       f"{formula}), so microbatches count equally instead of tokens: {where}.")
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
        else:
            message = (f"Tokens of one step received different weights and no denominator (n, n_r, n·M, N_m, N, T, "
                       f"1) explains them: {where}.")
        return _finding(context, code, step_numbers, message, _fix_average(context), evidence)

    q = diagnosis.distortion or 0.0
    member_q = diagnoses.distortion[members]
    distortions = [float(np.nanmin(member_q)), float(np.nanmax(member_q))] if not np.isnan(member_q).all() else []
    evidence.update({"distortion": q, "effective_weight": q / tokens, "distortion_range": _range(distortions)})
    spread = "" if len(set(np.round(distortions, 12))) <= 1 else \
        f"; over the {len(members)} step(s) q ranges from {min(distortions):.4g} to {max(distortions):.4g}"
    scaled = (f"every valid token received {q:.4g}/N instead of 1/N (step {step}{group}, N={tokens}, W={w}, "
              f"D={row.d_high:g}){spread}")
    if code == Code.PADDED_DENOMINATOR:
        evidence["positions"] = int(row.positions)
        message = (f"The loss was divided by all {int(row.positions)} positions of the step, padding and ignored "
                   f"labels included, instead of its {tokens} valid tokens: {scaled}.")
        return _finding(context, code, step_numbers, message, _fix_average(context), evidence)
    if code == Code.LOSS_SCALE:
        assert explanation is not None
        exponents = sorted({j for i in np.unique(explanations[members]) if i >= 0
                            and (j := table[i].integer) is not None})
        evidence["loss_scale_exponents"] = exponents
        shown = " to ".join(f"2^{j}" for j in ([exponents[0], exponents[-1]] if len(exponents) > 1 else exponents))
        message = (f"Weights are uniform but carry a power-of-two factor ({shown}) that W={w} does not explain: "
                   f"{scaled}. This is the loss scale of mixed precision (a GradScaler), which the log does not "
                   "record, so the gradient's true scale cannot be judged here.")
        fix = ("pass the scaler to the recorder, Recorder(..., scaler=scaler), so its scale is divided out of the "
               "weights (the Hugging Face and Lightning callbacks find the trainer's scaler themselves)")
        return _finding(context, code, step_numbers, message, fix, evidence)
    if code == Code.WORLD_SIZE_MISMATCH:
        assert explanation is not None
        cause = _world_size_cause(explanation, q, w, float(row.d_high))
        evidence["integer_factor"] = {"1/W": f"1/{w}", "1/k": f"1/{explanation.integer}", "W'/W": f"{explanation.integer}/{w}",
                                      "k/W": f"{explanation.integer}/{w}"}.get(explanation.label, explanation.integer)
        if explanation.label == "W'/W":
            evidence["world_sizes"] = [explanation.integer, w]
            evidence["stale_world_size"] = explanation.integer
        message = f"Weights are uniform but off by a world-size factor: {scaled}; {cause}."
        return _finding(context, code, step_numbers, message, _fix_average(context), evidence)
    if denominator == Denominator.ONE:
        message = (f"The loss sum was backpropagated without a token denominator (b·g = {diagnosis.factor:g}·S): "
                   f"{scaled}; the gradient's size grows with the number of valid tokens (under SGD so does the step; "
                   "under Adam(W) its balance against epsilon, weight decay and gradient clipping shifts).")
    else:
        aux = (" If this term is weighted on purpose (an auxiliary loss coefficient λ), this is that λ."
               if context.term != UNNAMED else "")
        what = "a constant" if not spread else "a factor that changes from step to step"
        message = f"Weights are uniform within each step but scaled by {what}: {scaled}.{aux}"
    return _finding(context, code, step_numbers, message, _fix_average(context), evidence)


def _world_size_cause(explanation: FactorExplanation, q: float, w: int, divisor: float) -> str:
    k = explanation.integer
    if explanation.label == "1/W":
        return (f"the W factor is missing: S/N went into a reduction that averages over W={w}" if divisor != 1
                else f"S/N was divided by W={w} once more")
    if explanation.label == "W":
        if divisor == 1:
            return f"W·S/N (W={w}) went into a summing reduction (D=1), which needs S/N"
    if explanation.label == "W'/W":
        return (f"the code still scales by W={k} while the averaging group now has W={w}: a stale W kept "
                "across an elastic resize or a resume on other hardware")
    if explanation.label == "1/k":
        return (f"the gradient is {k}× too small: N counted {k}× the tokens (ranks that replicate the batch, "
                f"such as tensor- or context-parallel ranks, counted in N), or a constant 1/{k} in the code")
    used = q * w
    return (f"the code scaled by {used:.4g} where the averaging group has W={w}: a hard-coded W, a stale "
            "constant, the global world size used on a data-parallel subgroup (DP×TP), or W applied twice")


def _describe(row: Any, which: str, weight: float, tokens: int) -> dict[str, Any]:
    return {"rank": int(getattr(row, f"{which}_rank")), "micro": int(getattr(row, f"{which}_micro")),
            "valid_tokens": int(getattr(row, f"{which}_n")), "rank_tokens": int(getattr(row, f"{which}_rank_tokens")),
            "effective_weight": weight, "distortion": weight * tokens}


# ---------------------------------------------------------------------------------- other checks


def _structure_findings(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """world_size_inconsistent, world_size_changed, uneven_microbatches. W and M are compared as arrays
    (one held as one value, `engine._constant`, as that value), and W's changes are looked for group by
    group only when W is not one value: a frame's comparisons and group-by copied 43 bytes a step."""
    inconsistent = _unequal(steps, "w_low", "w_high")
    if inconsistent is not None:
        row = _first(steps, inconsistent)
        yield _finding(context, Code.WORLD_SIZE_INCONSISTENT, steps.step.to_numpy()[inconsistent],
                       f"Ranks disagree on W within one step (step {int(row.step)}: W from {int(row.w_low)} to "
                       f"{int(row.w_high)}).",
                       "derive W from the process group that averages the gradients "
                       "(dist.get_world_size(ddp_model.process_group)) on every rank",
                       {"step": int(row.step), "world_size_low": int(row.w_low), "world_size_high": int(row.w_high)})
    world = steps.w_high.to_numpy()
    for group, rows in ([] if one_value(world) else _groups(steps.grp)):
        values = world[rows]
        sizes = [int(w) for w in values[np.sort(np.unique(values, return_index=True)[1])]]  # in order of appearance
        if len(sizes) > 1:
            yield _finding(context, Code.WORLD_SIZE_CHANGED, steps.step.to_numpy()[rows][values != values[0]],
                           f"W changed between steps{'' if group == UNNAMED else f' in group {group}'}: "
                           f"{' → '.join(map(str, sizes))} (an elastic restart or a resume on other hardware).",
                           "nothing to fix if the restart was intended; check that N and W were recomputed after it",
                           {"world_sizes": sizes})
    uneven = _unequal(steps, "m_low", "m_high")
    if uneven is not None:
        row = _first(steps, uneven)
        yield _finding(context, Code.UNEVEN_MICROBATCHES, steps.step.to_numpy()[uneven],
                       f"Ranks ran different numbers of microbatches in one step (step {int(row.step)}: from "
                       f"{int(row.m_low)} to {int(row.m_high)}); every backward that syncs must be matched on all "
                       "ranks, and N must count every microbatch.",
                       "give every rank the same number of microbatches per step (pad with empty ones that "
                       "still run backward with a zero contribution)",
                       {"step": int(row.step), "microbatches_low": int(row.m_low),
                        "microbatches_high": int(row.m_high)})


def world_sizes(steps: pd.DataFrame) -> list[int]:
    """Every W the steps saw, sorted: each column's distinct values (one value: that value), not a sort of
    both columns joined (200 MB at 12.5M steps)."""
    return sorted({int(w) for column in (steps.w_low, steps.w_high) for w in distinct(column)})


def distinct(column: pd.Series) -> npt.NDArray[Any]:
    """The distinct values of a column, sorted: its one value when it is held as one (`engine._constant`)."""
    values = column.to_numpy()
    return np.unique(values[:1] if one_value(values) else values)


def _unequal(steps: pd.DataFrame, low: str, high: str) -> npt.NDArray[np.bool_] | None:
    """Where two columns differ (NaN differs from everything, as pandas compares), None where nowhere;
    two columns held as one value each compare as those values."""
    one, other = steps[low].to_numpy(), steps[high].to_numpy()
    if one_value(one) and one_value(other):
        return None if one[0] == other[0] else np.ones(len(one), dtype=bool)
    differ: npt.NDArray[np.bool_] = one != other
    return differ if differ.any() else None


def _groups(column: pd.Series) -> Iterator[tuple[str, Any]]:
    """(name, rows) per group, in a group-by's order (the categories', or the names sorted): rows a slice of
    every row when there is one group, else the group's indices."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes, names = column.cat.codes.to_numpy(), list(column.cat.categories)
    else:
        codes, uniques = pd.factorize(column, sort=True)
        names = list(uniques)
    present = [int(code) for code in np.unique(codes) if code >= 0]
    if len(present) == 1:
        yield names[present[0]], slice(None)
        return
    for code in present:
        yield names[code], np.flatnonzero(codes == code)


def _value_findings(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """nonfinite_values, zero_token_nonfinite, empty_update. Non-finite values of an update the
    trainer skipped (a GradScaler overflow) did not reach the weights: they are not errors."""
    skipped = steps.skipped_true > 0
    nonfinite = (steps.nonfinite_valid > 0) & ~skipped
    if nonfinite.any():
        records = int(steps.nonfinite_valid[nonfinite].sum())
        yield _finding(context, Code.NONFINITE_VALUES, steps.step[nonfinite].to_numpy(),
                       f"NaN or infinity in S, b, g, D or the probe columns of {records} record(s) with valid tokens; "
                       "the reduced gradient of those steps is not finite, or its weight cannot be read.",
                       "find the first non-finite loss (torch.autograd.set_detect_anomaly) and guard the division; "
                       "record finite grad_scale and grad_divisor values",
                       {"records": records, "first_step": int(steps.step[nonfinite].min())})
    zero_bad = steps.nonfinite_zero > 0
    if zero_bad.any():
        yield _finding(context, Code.ZERO_TOKEN_NONFINITE, steps.step[zero_bad].to_numpy(),
                       f"{int(steps.nonfinite_zero.sum())} record(s) with no valid token have a non-finite backward "
                       "scalar: the code divided by its own zero count (0/0), and DDP spreads the NaN to every rank.",
                       "divide by the global count N (clamped to at least 1), never by the local count; a rank "
                       "with no valid token backpropagates an exact zero that stays connected to the graph",
                       {"records": int(steps.nonfinite_zero.sum())})
    empty = steps.tokens == 0
    if empty.any():
        rows = steps.loc[empty, ["step", "skipped_true", "skipped_false", "nonfinite_zero"]]
        disagree = (rows.skipped_true > 0) & (rows.skipped_false > 0)
        bad = (rows.nonfinite_zero > 0) | disagree
        unmarked = rows.skipped_true == 0
        severity = Severity.ERROR if bad.any() else Severity.INFO
        details = []
        if disagree.any():
            details.append(f"ranks disagree on skipping it at step(s) {_list(rows.step[disagree])}")
        if (rows.nonfinite_zero > 0).any():
            details.append("some ranks backpropagated a non-finite value")
        if unmarked.any() and not disagree.any():
            details.append("the log does not say the update was skipped; an optimizer step on zero gradients still "
                           "moves weights through momentum and weight decay")
        yield _finding(context, Code.EMPTY_UPDATE, rows.step.to_numpy(),
                       f"No valid token anywhere in {int(empty.sum())} step(s) (N = 0)"
                       + (": " + "; ".join(details) if details else ", and every rank skipped it together."),
                       "decide from the global N (known to every rank after one all-reduce): when N = 0, every rank "
                       "runs backward on a zero loss and skips optimizer.step() together",
                       {"steps": _list(rows.step)}, severity=severity)


def _sync_findings(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """missing_sync, sync_every_micro."""
    missing = steps.unsynced_ranks > 0
    if missing.any():
        yield _finding(context, Code.MISSING_SYNC, steps.step[missing].to_numpy(),
                       f"The last microbatch of a step did not synchronize gradients on "
                       f"{int(steps.unsynced_ranks.sum())} rank-step(s): those ranks stepped on their local gradient.",
                       "run the last microbatch's forward and backward outside model.no_sync()",
                       {"rank_steps": int(steps.unsynced_ranks.sum())})
    multi = (steps.m_high > 1) & (steps.sync_known == steps.records)
    every = multi & (steps.sync_true == steps.records)
    if every.any() and every.sum() == multi.sum():
        yield _finding(context, Code.SYNC_EVERY_MICRO, steps.step[every].to_numpy(),
                       f"Every microbatch synchronized gradients in {int(every.sum())} multi-microbatch step(s): "
                       f"correct, but {context.microbatches}× the communication.",
                       "wrap all but the last microbatch in model.no_sync()", {"steps": int(every.sum())})


def decimals(values: np.ndarray) -> np.ndarray:
    """Per value, the fewest decimals (0..MAX_DECIMALS) it is rounded to, float32 storage allowed
    for; −1 when it has more."""
    out = np.full(len(values), -1)
    for k in range(MAX_DECIMALS, -1, -1):
        rounded = np.round(values, k)
        exact = np.abs(values - rounded) <= 1e-7 * np.maximum(np.abs(values), 1e-12)
        out = np.where(exact, k, out)
    return out


def rounding_of(values: np.ndarray) -> float:
    """Half a unit of the last decimal a trainer rounded its logged losses to, read from all of
    them (a value with few decimals by chance says nothing alone); 0 when they are not rounded."""
    if not len(values):
        return 0.0
    k = decimals(values)
    if (k < 0).any():
        return 0.0
    return 0.5 * 10.0 ** (-int(k.max())) * (1 + 1e-6)


def _agrees(reported: np.ndarray, truth: np.ndarray, rtol: float, rounding: float) -> np.ndarray:
    """reported equals truth within rtol, or within half a unit of the decimal it was rounded to."""
    tolerance = np.maximum(rtol * np.abs(truth), rounding)
    agrees: np.ndarray = np.abs(reported - truth) <= tolerance
    return agrees


def _reported_findings(steps: pd.DataFrame, run: str, rtol: float, main_term: str) -> Iterator[Finding]:
    """reported_loss_mismatch: the logged loss against ΣS/N of the main term, or against the sum of
    the terms' token means when the trainer logs the whole objective."""
    reported = (steps.reported > 0) & (steps.tokens > 0)
    if not reported.any():
        return
    known = steps.loc[reported, ["grp", "term", "step", "loss", "tokens", "reported_low", "reported_high",
                                 "mean_of_local_means"]]
    means = known.assign(mean=known.loss / known.tokens)
    total = means.groupby(["grp", "step"], observed=True)["mean"].transform("sum")
    rows = means[means.term.astype(str) == main_term].copy()
    if rows.empty:
        return
    rows["total"] = total[rows.index]
    low, high = rows.reported_low.to_numpy(float), rows.reported_high.to_numpy(float)
    truth, whole = rows["mean"].to_numpy(float), rows["total"].to_numpy(float)
    rounding = rounding_of(np.concatenate([low, high]))
    fine = (_agrees(low, truth, rtol, rounding) & _agrees(high, truth, rtol, rounding)) | \
        (_agrees(low, whole, rtol, rounding) & _agrees(high, whole, rtol, rounding))
    if fine.all():
        return
    bad = rows[~fine]
    local_of = bad.mean_of_local_means.to_numpy(float)
    local = _agrees(bad.reported_low.to_numpy(float), local_of, rtol, rounding) & \
        _agrees(bad.reported_high.to_numpy(float), local_of, rtol, rounding)
    first = bad.iloc[0]
    true_value = float(first.loss / first.tokens)
    evidence = {"step": int(first.step), "reported": float(first.reported_high), "token_mean": true_value,
                "mean_of_local_means": float(first.mean_of_local_means), "rounding": rounding}
    if local.all():
        what = "the mean of per-rank means, not the token mean"
    elif local.any():
        what = "partly the mean of per-rank means"
    else:
        what = f"{float(first.reported_high) / true_value:.4g}× the token mean" if true_value else "not the token mean"
    context = RunContext(run=run, term=main_term, world_size=0, world_sizes=(), microbatches=0, divisor=0.0, rtol=rtol)
    yield _finding(context, Code.REPORTED_LOSS_MISMATCH, bad.step.to_numpy(),
                   f"The reported loss differs from ΣS/N in {len(bad)} step(s), beyond rounding; it is {what} (step "
                   f"{int(first.step)}: reported {float(first.reported_high):.6g}, ΣS/N = {true_value:.6g}, mean of "
                   f"local means {float(first.mean_of_local_means):.6g}).",
                   "report all_reduce(Σ S)/all_reduce(Σ n) over the step from detached sums and counts",
                   evidence)


def _probe_findings(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """nonuniform_in_microbatch, masked_tokens_weighted."""
    nonuniform = steps.probe_nonuniform > 0
    if nonuniform.any():
        yield _finding(context, Code.NONUNIFORM_IN_MICROBATCH, steps.step[nonuniform].to_numpy(),
                       f"Valid tokens of one microbatch got different weights in {int(steps.probe_nonuniform.sum())} "
                       "record(s): a per-sequence or per-document mean, or a token weighting. Legitimate only when "
                       "chosen on purpose.",
                       "for the token-mean objective, sum per-token losses over the microbatch and divide once by N",
                       {"records": int(steps.probe_nonuniform.sum())})
    masked = steps.masked_weighted > 0
    if masked.any():
        yield _finding(context, Code.MASKED_TOKENS_WEIGHTED, steps.step[masked].to_numpy(),
                       f"Positions that are not valid and whose loss is not 0 (padding labelled as a real token, "
                       f"a mask applied after the loss) carry weight in {int(steps.masked_weighted.sum())} "
                       "record(s): their loss is trained.",
                       "label padding and ignored positions with ignore_index (their loss is then exactly 0), or "
                       "mask per-token losses before reducing; divide by the valid-token count",
                       {"records": int(steps.masked_weighted.sum())})


def _missing_ranks(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """missing_rank: fewer ranks than W recorded a step that others recorded."""
    missing = steps.ranks < steps.w_high
    if not missing.any():
        return
    first = _first(steps, missing)
    w = int(first.w_high)
    mask = 0 if pd.isna(first.rank_mask) else int(first.rank_mask)
    absent = [r for r in range(min(w, 64)) if not mask >> r & 1]
    listed = f"ranks {_list(absent)}" if w <= 64 else f"{w - int(first.ranks)} ranks (of those below 64: {_list(absent)})"
    yield _finding(context, Code.MISSING_RANK, steps.step[missing].to_numpy(),
                   f"{int(missing.sum())} step(s) lack records from some ranks (step {int(first.step)}: {listed} "
                   f"of W={w} have none). A rank that skips backward or a collective desynchronizes DDP; if it only "
                   "skipped recording, its tokens are missing from N here.",
                   "every rank runs forward, backward and every collective each microbatch, with a zero loss when "
                   "it has no valid token",
                   {"step": int(first.step), "missing_ranks": absent, "world_size": w})


def _divisor_findings(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """unknown_divisor: D could not be seen, so the weights' absolute scale is not judged."""
    unknown = (steps.unknown_divisor > 0) & (steps.tokens > 0)
    if not unknown.any():
        return
    rows = steps.loc[unknown, ["step", "unknown_divisor", "weighted_records", "e_low", "e_high", "tokens"]]
    weighted = rows[rows.weighted_records > 0]
    evidence: dict[str, Any] = {"records": int(rows.unknown_divisor.sum()), "world_size": context.world_size}
    detail = ""
    if not weighted.empty:
        # The log assumed D = W; with a summing reduction (D = 1) every weight is W× larger.
        q = float(((weighted.e_low + weighted.e_high) / 2 * weighted.tokens).median())
        evidence.update({"distortion_if_average": q, "distortion_if_sum": q * context.world_size})
        detail = (f" If the reduction averages (D = W = {context.world_size}), tokens got q = e·N = {q:.4g}; "
                  f"if it sums (D = 1), q = {q * context.world_size:.4g} (correct is 1).")
    yield _finding(context, Code.UNKNOWN_DIVISOR, rows.step.to_numpy(),
                   f"The divisor D of the gradient reduction could not be seen in {len(rows)} step(s) (a DDP comm hook "
                   "the recorder does not know, or no DDP model given), so the absolute scale of the weights is not "
                   f"judged; relative checks (local means, per-microbatch denominators) still ran.{detail}",
                   "tell the recorder what the reduction divides by: Recorder(..., grad_divisor=1) for a summing "
                   f"hook, grad_divisor={context.world_size} for an average (or pass the DDP model as model=)",
                   evidence)


def _weight_presence(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """no_weights: valid records without a usable weight (no b and no probe, or S = 0 without a probe)."""
    unweighted = steps.unweighted_records > 0
    if not unweighted.any():
        return
    records = int(steps.unweighted_records[unweighted].sum())
    none_at_all = int((unweighted & (steps.weighted_records == 0)).sum())
    yield _finding(context, Code.NO_WEIGHTS, steps.step[unweighted].to_numpy(),
                   f"{records} record(s) with valid tokens carry no usable weight (no backward scalar and no probe, "
                   f"or a loss sum of 0 without a probe); {none_at_all} step(s) have no weight at all, so their "
                   "normalization cannot be judged.",
                   "record backward_scalar= with every record, or wrap the per-token loss in rec.probe()",
                   {"records": records, "steps_without_weight": none_at_all})


def _duplicates(duplicates: tuple[int, int, int, int], run: str) -> Finding:
    """duplicate_records: the engine kept the later of each repeated (group, term, step, micro, rank)."""
    copies, first, last, count = duplicates
    return Finding(run=run, code=Code.DUPLICATE_RECORDS, severity=DEFAULT_SEVERITY[Code.DUPLICATE_RECORDS],
                   steps=StepRange(first, last, count),
                   message=f"{copies} record(s) repeat a (group, term, step, micro, rank) already logged, e.g. after a "
                           "resume that replayed steps; the later record (by `time`, then file) was kept.",
                   fix="resume from the checkpoint's step and start a new shard sequence; or delete the older shards",
                   evidence={"dropped_records": copies})


_CONFUSED_COUNTS = {
    Denominator.RANK: ("each rank held the same number of valid tokens n_r", "a rank-local mean"),
    Denominator.MICRO_TIMES_M: ("every microbatch held the same number of valid tokens",
                                "a per-microbatch mean divided by M"),
    Denominator.MICRO: ("every microbatch held the same number of valid tokens", "a per-microbatch mean"),
    Denominator.MICRO_GLOBAL: ("every microbatch index held the same number of valid tokens over the ranks",
                               "a per-microbatch global count N_m"),
}


def _balanced(steps: pd.DataFrame, diagnoses: Diagnoses, context: RunContext) -> Iterator[Finding]:
    """balanced_counts: in every step the counts that a local normalization needs to differ were
    equal, so the logs cannot tell it from the token mean."""
    confused = diagnoses.confused
    if confused is None:
        return
    nonempty = steps.tokens > 0
    counts = [int(n) for n in np.unique(steps.n_high.to_numpy()[nonempty.to_numpy()])]  # not a Python int a step
    what, mistake = _CONFUSED_COUNTS[confused]
    detail = f"every record had the same valid-token count ({_list(counts)})" if bool(
        diagnoses.balanced[nonempty.to_numpy()].all()) else what
    yield _finding(context, Code.BALANCED_COUNTS, steps.step[nonempty].to_numpy(),
                   f"In every step {detail}, so {mistake} and the global token mean give the same weights here: "
                   "this run cannot show which one the code uses.",
                   "audit a run with uneven counts (padding, ignored labels, different sequence lengths per rank)",
                   {"counts": counts, "indistinguishable_from": confused.value})


def loss_terms(steps: pd.DataFrame) -> list[str]:
    """The loss terms of a step table, as text, the main term (UNNAMED, "0") first: each distinct value named
    once, not every row converted."""
    return sorted({str(term) for term in steps.term.unique()}, key=lambda t: (t != UNNAMED, t))


def _first(steps: pd.DataFrame, mask: pd.Series | npt.NDArray[np.bool_]) -> Any:
    """The first row where mask holds, without copying every row it holds."""
    return steps.iloc[int(np.argmax(np.asarray(mask)))]


def _list(values: Any) -> str:
    items = [str(int(v)) for v in values]
    return ", ".join(items[:8]) + (f", … ({len(items)} in all)" if len(items) > 8 else "")

