"""Pure checks over the per-step table: recover the normalization and turn each problem into findings.

Notation (SPEC §1): per record S, n, b; c = b/S (or the probe's Σ∂b/∂ℓ / n); e = c·g/D;
N = Σn over the step. A step is correct iff q = e·N = 1 for every record with n > 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import pandas as pd

from tokaudit.codes import DEFAULT_SEVERITY, Code, Severity
from tokaudit.report import Finding, Segment, StepRange

DEFAULT_RTOL = 1e-4
"""Relative tolerance: float32 sums of a few thousand tokens agree to ~1e-6; 1e-4 leaves room."""

# Candidate denominators, in the order that names a mistake when several explain the weights.
# Each maps to the per-step (low, high) columns of e·Den from the engine.
NONUNIFORM_CANDIDATES: tuple[tuple[str, str, str], ...] = (
    ("n_rank", "er_low", "er_high"),      # the rank's own count over the step: rank-local mean
    ("n_micro*M", "enm_low", "enm_high"),  # microbatch count × microbatches: local mean ÷ GAS
    ("n_micro", "en_low", "en_high"),      # the microbatch's own count
    ("N_m", "em_low", "em_high"),          # the microbatch's global count
    ("T", "et_low", "et_high"),            # positions, padding included
)
DENOMINATOR_WORDS = {
    "N": "the step's global valid-token count N",
    "N_m": "each microbatch's own global count N_m",
    "n_rank": "each rank's own valid-token count n_r",
    "n_micro*M": "each microbatch's own count n times the number of microbatches M",
    "n_micro": "each microbatch's own count n",
    "T": "the positions of each microbatch, padding and ignored labels included",
    "T_step": "the positions of the whole step, padding and ignored labels included",
    "1": "nothing (a raw loss sum)",
    "undetermined": "undetermined: counts are equal everywhere, so local and global means coincide",
    "unexplained": "no single denominator",
}


@dataclass(frozen=True, slots=True)
class StepDiagnosis:
    """What one step's weights say."""

    kind: str
    """correct, empty, unweighted, nonuniform or uniform_off."""
    denominator: str
    """Recovered denominator name (see DENOMINATOR_WORDS)."""
    factor: float | None
    """α in b·g = α·S/denominator."""
    distortion: float | None
    """q = e·N when the step's weights are uniform, else None."""
    balanced: bool
    """Every record of the step had the same count: local and global normalization coincide."""


# Tie-break when several denominators explain as many steps: the correct one first, then the
# mistakes from the most to the least common in the wild.
PREFERENCE = ("N", "n_rank", "n_micro*M", "n_micro", "N_m", "T", "T_step", "1")


def spread(low: float, high: float) -> float:
    """Relative width of [low, high]; 0 when both are equal."""
    scale = max(abs(low), abs(high))
    return 0.0 if scale == 0 else (high - low) / scale


def close(value: float, target: float, rtol: float) -> bool:
    return abs(value - target) <= rtol * max(abs(target), 1e-300)


def integer_factor(q: float, rtol: float) -> int | None:
    """k when q ≈ k or q ≈ 1/k for an integer k ≥ 2; negative k stands for 1/k."""
    for value, sign in ((q, 1), (1 / q if q else math.inf, -1)):
        k = round(value)
        if 2 <= k <= 1_000_000 and close(value, k, rtol):
            return sign * k
    return None


def _rounded(alpha: float) -> float:
    return float(f"{alpha:.4g}")


def step_hypotheses(row: Any, rtol: float) -> dict[str, float]:
    """Every denominator Den for which α = e·Den·D is constant over the step's valid records.

    α reads as the factor in b·g = α·S/Den: W for W·S/N into an average, 1 for S/N into a sum.
    """
    divisor = float(row.d_high)
    fits: dict[str, float] = {}
    if spread(row.e_low, row.e_high) <= rtol:
        weight = (row.e_low + row.e_high) / 2
        fits["N"] = _rounded(weight * row.tokens * divisor)
        fits["1"] = _rounded(weight * divisor)
        if row.positions_known == row.records and row.positions:
            fits["T_step"] = _rounded(weight * row.positions * divisor)
    for name, low, high in NONUNIFORM_CANDIDATES:
        lo, hi = getattr(row, low), getattr(row, high)
        if not pd.isna(lo) and not pd.isna(hi) and spread(lo, hi) <= rtol:
            fits[name] = _rounded((lo + hi) / 2 * divisor)
    return fits


def diagnose_steps(steps: pd.DataFrame, rtol: float) -> list[StepDiagnosis]:
    """Recover each step's normalization, letting the whole run vote.

    Small steps fit several denominators by coincidence (two equal counts, N = ΣT/2, ...). The
    hypothesis (denominator, α) that explains the most steps of the run wins those steps, then the
    next one takes what is left; a run that changed normalization at a resume shows both.
    """
    rows = list(steps.itertuples(index=False))
    candidates: list[dict[str, float]] = []
    for row in rows:
        usable = row.tokens > 0 and row.weighted_records > 0 and not pd.isna(row.e_low)
        candidates.append(step_hypotheses(row, rtol) if usable else {})
    assigned: list[tuple[str, float] | None] = [None] * len(rows)
    remaining = {i for i, fits in enumerate(candidates) if fits}
    while remaining:
        votes: dict[tuple[str, float], int] = {}
        for i in remaining:
            for fit in candidates[i].items():
                votes[fit] = votes.get(fit, 0) + 1
        best = max(votes, key=lambda h: (votes[h], -PREFERENCE.index(h[0])))
        if votes[best] == 1:
            # Nothing is shared any more: each step keeps its own best fit (keeps this linear).
            for i in remaining:
                assigned[i] = min(candidates[i].items(), key=lambda h: PREFERENCE.index(h[0]))
            break
        for i in [i for i in remaining if candidates[i].get(best[0]) == best[1]]:
            assigned[i] = best
            remaining.discard(i)
    nonempty = [row for row in rows if row.tokens > 0]
    all_balanced = bool(nonempty) and all(_balanced_row(row) for row in nonempty)
    diagnoses = []
    for row, hypothesis in zip(rows, assigned):
        balanced = _balanced_row(row)
        if row.tokens == 0:
            diagnoses.append(StepDiagnosis("empty", "undetermined", None, None, balanced))
            continue
        if hypothesis is None:
            kind = "nonuniform" if row.weighted_records > 0 and not pd.isna(row.e_low) else "unweighted"
            diagnoses.append(StepDiagnosis(kind, "unexplained" if kind == "nonuniform" else "undetermined",
                                           None, None, balanced))
            continue
        denominator, alpha = hypothesis
        factor: float | None = alpha
        uniform = spread(row.e_low, row.e_high) <= rtol
        q = (row.e_low + row.e_high) / 2 * float(row.tokens) if uniform else None
        if q is not None and close(q, 1.0, rtol):
            kind = "correct"
        else:
            kind = "uniform_off" if uniform else "nonuniform"
        if all_balanced and kind == "correct":
            denominator = "undetermined"
        diagnoses.append(StepDiagnosis(kind, denominator, factor, q, balanced))
    return diagnoses


def _balanced_row(row: Any) -> bool:
    return bool(row.n_low == row.n_high and row.m_low == row.m_high)


@dataclass
class RunContext:
    """What the fixes and messages of one run need to name."""

    run: str
    world_size: int
    microbatches: int
    divisor: float
    rtol: float


class LogQueries(Protocol):
    """What the checks may still ask of the log for evidence, one step at a time."""

    def ranks_at(self, run: str, group: str, step: int) -> list[int]: ...

    def extremes(self, run: str, group: str, step: int) -> tuple[dict[str, float], dict[str, float]]: ...


def check_run(run: str, steps: pd.DataFrame, rtol: float, log: LogQueries,
              duplicates: tuple[int, int, int, int] | None = None) -> tuple[list[Finding], list[Segment]]:
    """All checks for one run's steps (every group): its findings and its normalization segments.

    `duplicates`: (records dropped, first step, last step, steps) when the reader found repeated keys."""
    diagnoses = diagnose_steps(steps, rtol)
    context = RunContext(run=run, world_size=int(steps.w_high.mode().iloc[0]),
                         microbatches=int(steps.m_high.max()), divisor=float(steps.d_high.mode().iloc[0]), rtol=rtol)
    findings: list[Finding] = []
    findings.extend(_weighting_findings(steps, diagnoses, context, log))
    for check in (_structure_findings, _value_findings, _sync_findings, _reported_findings, _probe_findings):
        findings.extend(check(steps, context))
    findings.extend(_missing_ranks(steps, context, log))
    if duplicates is not None:
        findings.append(_duplicates(duplicates, context))
    findings.extend(_balanced(steps, diagnoses, context))
    return findings, _segments(steps, diagnoses)


def _finding(context: RunContext, code: Code, steps: list[int], message: str, fix: str,
             evidence: dict[str, Any], severity: Severity | None = None) -> Finding:
    return Finding(run=context.run, code=code, severity=severity or DEFAULT_SEVERITY[code],
                   steps=StepRange(first=min(steps), last=max(steps), count=len(set(steps))),
                   message=message, fix=fix, evidence=evidence)


def _fix_average(context: RunContext) -> str:
    w, m = context.world_size, context.microbatches
    over = f"all {m} microbatches of the step on all {w} ranks" if m > 1 else f"all {w} ranks"
    if context.divisor == 1:
        return (f"backpropagate S_r/N (the reduction sums, D=1) with N the valid tokens of {over}, "
                "counted before the first backward with one all-reduce")
    return (f"backpropagate W·S_r/N with W={w} (the size of the averaging group) and N summed over {over}, "
            "counted before the first backward with one all-reduce")


def _weighting_findings(steps: pd.DataFrame, diagnoses: list[StepDiagnosis], context: RunContext,
                        log: LogQueries) -> Iterator[Finding]:
    """local_mean, per_micro_denominator, padded_denominator, unexplained_weighting,
    world_size_mismatch, scale_mismatch: one finding per (code, denominator, factor)."""
    groups: dict[tuple[Code, str, float | None], list[tuple[Any, StepDiagnosis]]] = {}
    for row, diagnosis in zip(steps.itertuples(index=False), diagnoses):
        code = _weighting_code(diagnosis, context.rtol)
        if code is None:
            continue
        groups.setdefault((code, diagnosis.denominator, diagnosis.factor), []).append((row, diagnosis))
    for (code, denominator, factor), members in groups.items():
        step_numbers = [int(row.step) for row, _ in members]
        # Evidence from the step where tokens were weighted most unequally (or q is furthest from 1).
        row, diagnosis = max(members, key=lambda m: (_ratio(m[0]), abs(math.log(abs(m[1].distortion)))
                                                     if m[1].distortion else 0.0))
        extremes = log.extremes(context.run, str(row.grp), int(row.step)) if diagnosis.kind == "nonuniform" else None
        yield _weighting_finding(code, denominator, factor, row, diagnosis, step_numbers, context, extremes)


def _weighting_code(diagnosis: StepDiagnosis, rtol: float) -> Code | None:
    if diagnosis.kind == "nonuniform":
        return {"n_rank": Code.LOCAL_MEAN, "n_micro*M": Code.LOCAL_MEAN, "n_micro": Code.LOCAL_MEAN,
                "N_m": Code.PER_MICRO_DENOMINATOR, "T": Code.PADDED_DENOMINATOR}.get(
                    diagnosis.denominator, Code.UNEXPLAINED_WEIGHTING)
    if diagnosis.kind == "uniform_off":
        if diagnosis.denominator in ("T", "T_step"):
            return Code.PADDED_DENOMINATOR
        if diagnosis.denominator == "1":
            return Code.SCALE_MISMATCH
        if diagnosis.distortion and integer_factor(diagnosis.distortion, rtol):
            return Code.WORLD_SIZE_MISMATCH
        return Code.SCALE_MISMATCH
    return None


def _ratio(row: Any) -> float:
    return float(row.tok_high / row.tok_low) if row.tok_low and row.tok_low > 0 else math.inf


def _weighting_finding(code: Code, denominator: str, factor: float | None, row: Any, diagnosis: StepDiagnosis,
                       steps: list[int], context: RunContext,
                       extremes: tuple[dict[str, Any], dict[str, Any]] | None) -> Finding:
    step, w, tokens = int(row.step), int(row.w_high), int(row.tokens)
    evidence: dict[str, Any] = {"step": step, "denominator": denominator, "factor": factor,
                                "world_size": w, "grad_divisor": float(row.d_high), "global_tokens": tokens}
    group = f" (group {row.grp})" if row.grp != "0" else ""
    if extremes is not None:
        heavy, light = extremes
        ratio = heavy["e"] / light["e"] if light["e"] > 0 else math.inf
        evidence.update({"heaviest": _describe(heavy, tokens), "lightest": _describe(light, tokens),
                         "weight_ratio": ratio})
        where = (f"at step {step}{group} a token on rank {heavy['rank']} (microbatch {heavy['micro']}, n={heavy['n']}) "
                 f"received {ratio:.3g}× the weight of a token on rank {light['rank']} (microbatch "
                 f"{light['micro']}, n={light['n']}); the correct weight is 1/N = 1/{tokens}, they got "
                 f"{heavy['e'] * tokens:.3g}/N and {light['e'] * tokens:.3g}/N")
        words = DENOMINATOR_WORDS[denominator]
        alpha = "?" if factor is None else f"{factor:g}"
        message = {
            Code.LOCAL_MEAN: f"Each loss was divided by {words} (b·g = {alpha}·S/{denominator}), so ranks "
                             f"and microbatches count equally instead of tokens: {where}.",
            Code.PER_MICRO_DENOMINATOR: f"Each microbatch was divided by its own global count N_m instead of the "
                                        f"step's N (b·g = {alpha}·S/N_m): {where}.",
            Code.PADDED_DENOMINATOR: f"The loss was divided by the positions T of each microbatch, padding and "
                                     f"ignored labels included (b·g = {alpha}·S/T): {where}.",
            Code.UNEXPLAINED_WEIGHTING: f"Tokens of one step received different weights and no denominator "
                                        f"(n, n_r, n·M, N_m, N, T, 1) explains them: {where}.",
        }[code]
        return _finding(context, code, steps, message, _fix_average(context), evidence)
    q = diagnosis.distortion or 0.0
    evidence.update({"distortion": q, "effective_weight": q / tokens})
    scaled = f"every valid token received {q:.4g}/N instead of 1/N (step {step}{group}, N={tokens}, W={w}, D={row.d_high:g})"
    if code == Code.PADDED_DENOMINATOR:
        evidence["positions"] = int(row.positions)
        message = (f"The loss was divided by all {int(row.positions)} positions of the step, padding and ignored "
                   f"labels included, instead of its {tokens} valid tokens: {scaled}.")
        return _finding(context, code, steps, message, _fix_average(context), evidence)
    if code == Code.WORLD_SIZE_MISMATCH:
        k = integer_factor(q, context.rtol) or 1
        evidence["integer_factor"] = k if k > 0 else f"1/{-k}"
        if k < 0 and -k == w:
            cause = (f"the W factor is missing: S/N went into a reduction that averages over W={w}" if row.d_high != 1
                     else f"S/N was divided by W={w} once more")
        elif k > 0 and row.d_high == 1 and k == w:
            cause = f"W·S/N (W={w}) went into a summing reduction (D=1), which needs S/N"
        else:
            used = q * w
            cause = (f"the code scaled by {used:.4g} where the averaging group has W={w}: a hard-coded W, a stale "
                     "constant, or the global world size used on a data-parallel subgroup (DP×TP)")
        message = f"Weights are uniform but off by an integer factor: {scaled}; {cause}."
        return _finding(context, code, steps, message, _fix_average(context), evidence)
    if denominator == "1":
        message = (f"The loss sum was backpropagated without a token denominator (b·g = {factor:g}·S): {scaled}; "
                   "the effective learning rate grows with the number of valid tokens.")
    else:
        message = f"Weights are uniform but scaled by a constant: {scaled}."
    return _finding(context, code, steps, message, _fix_average(context), evidence)


def _describe(record: dict[str, Any], tokens: int) -> dict[str, Any]:
    return {"rank": int(record["rank"]), "micro": int(record["micro"]), "valid_tokens": int(record["n"]),
            "rank_tokens": int(record["rank_tokens"]), "effective_weight": float(record["e"]),
            "distortion": float(record["e"] * tokens)}


def _steps_where(steps: pd.DataFrame, mask: pd.Series) -> list[int]:
    return [int(s) for s in steps.step[mask]]


def _structure_findings(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """world_size_inconsistent, world_size_changed, uneven_microbatches."""
    inconsistent = steps.w_low != steps.w_high
    if inconsistent.any():
        row = steps[inconsistent].iloc[0]
        yield _finding(context, Code.WORLD_SIZE_INCONSISTENT, _steps_where(steps, inconsistent),
                       f"Ranks disagree on W within one step (step {int(row.step)}: W from {int(row.w_low)} to "
                       f"{int(row.w_high)}).",
                       "derive W from the process group that averages the gradients "
                       "(dist.get_world_size(ddp_model.process_group)) on every rank",
                       {"step": int(row.step), "world_size_low": int(row.w_low), "world_size_high": int(row.w_high)})
    for group, per_group in steps.groupby("grp", sort=True):
        sizes = list(dict.fromkeys(int(w) for w in per_group.w_high))
        if len(sizes) > 1:
            changed = per_group.w_high != per_group.w_high.iloc[0]
            yield _finding(context, Code.WORLD_SIZE_CHANGED, _steps_where(per_group, changed),
                           f"W changed between steps{'' if group == '0' else f' in group {group}'}: "
                           f"{' → '.join(map(str, sizes))} (an elastic restart or a resume on other hardware).",
                           "nothing to fix if the restart was intended; check that N and W were recomputed after it",
                           {"world_sizes": sizes})
    uneven = steps.m_low != steps.m_high
    if uneven.any():
        row = steps[uneven].iloc[0]
        yield _finding(context, Code.UNEVEN_MICROBATCHES, _steps_where(steps, uneven),
                       f"Ranks ran different numbers of microbatches in one step (step {int(row.step)}: from "
                       f"{int(row.m_low)} to {int(row.m_high)}); every backward that syncs must be matched on all "
                       "ranks, and N must count every microbatch.",
                       "give every rank the same number of microbatches per step (pad with empty ones that "
                       "still run backward with a zero contribution)",
                       {"step": int(row.step), "microbatches_low": int(row.m_low),
                        "microbatches_high": int(row.m_high)})


def _value_findings(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """nonfinite_values, zero_token_nonfinite, empty_update."""
    nonfinite = steps.nonfinite_valid > 0
    if nonfinite.any():
        yield _finding(context, Code.NONFINITE_VALUES, _steps_where(steps, nonfinite),
                       f"NaN or infinity in S, b or the probe columns of {int(steps.nonfinite_valid.sum())} "
                       "record(s) with valid tokens; the reduced gradient of those steps is not finite.",
                       "find the first non-finite loss (torch.autograd.set_detect_anomaly) and guard the division",
                       {"records": int(steps.nonfinite_valid.sum()), "first_step": int(steps.step[nonfinite].min())})
    zero_bad = steps.nonfinite_zero > 0
    if zero_bad.any():
        yield _finding(context, Code.ZERO_TOKEN_NONFINITE, _steps_where(steps, zero_bad),
                       f"{int(steps.nonfinite_zero.sum())} record(s) with no valid token have a non-finite backward "
                       "scalar: the code divided by its own zero count (0/0), and DDP spreads the NaN to every rank.",
                       "divide by the global count N (clamped to at least 1), never by the local count; a rank "
                       "with no valid token backpropagates an exact zero that stays connected to the graph",
                       {"records": int(steps.nonfinite_zero.sum())})
    empty = steps.tokens == 0
    if empty.any():
        rows = steps[empty]
        disagree = (rows.skipped_true > 0) & (rows.skipped_false > 0)
        bad = (rows.nonfinite_zero > 0) | disagree
        unmarked = (rows.skipped_true == 0)
        severity = Severity.ERROR if bad.any() else Severity.INFO
        details = []
        if disagree.any():
            details.append(f"ranks disagree on skipping it at step(s) {_list(rows.step[disagree])}")
        if (rows.nonfinite_zero > 0).any():
            details.append("some ranks backpropagated a non-finite value")
        if unmarked.any() and not disagree.any():
            details.append("the log does not say the update was skipped; an optimizer step on zero gradients still "
                           "moves weights through momentum and weight decay")
        yield _finding(context, Code.EMPTY_UPDATE, _steps_where(steps, empty),
                       f"No valid token anywhere in {int(empty.sum())} step(s) (N = 0)"
                       + (": " + "; ".join(details) if details else ", and every rank skipped it together.") + "",
                       "decide from the global N (known to every rank after one all-reduce): when N = 0, every rank "
                       "runs backward on a zero loss and skips optimizer.step() together",
                       {"steps": _list(rows.step)}, severity=severity)


def _sync_findings(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """missing_sync, sync_every_micro."""
    missing = steps.unsynced_ranks > 0
    if missing.any():
        yield _finding(context, Code.MISSING_SYNC, _steps_where(steps, missing),
                       f"The last microbatch of a step did not synchronize gradients on "
                       f"{int(steps.unsynced_ranks.sum())} rank-step(s): those ranks stepped on their local gradient.",
                       "run the last microbatch's forward and backward outside model.no_sync()",
                       {"rank_steps": int(steps.unsynced_ranks.sum())})
    multi = (steps.m_high > 1) & (steps.sync_known == steps.records)
    every = multi & (steps.sync_true == steps.records)
    if every.any() and every.sum() == multi.sum():
        yield _finding(context, Code.SYNC_EVERY_MICRO, _steps_where(steps, every),
                       f"Every microbatch synchronized gradients in {int(every.sum())} multi-microbatch step(s): "
                       f"correct, but {context.microbatches}× the communication.",
                       "wrap all but the last microbatch in model.no_sync()", {"steps": int(every.sum())})


def _reported_findings(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """reported_loss_mismatch."""
    known = (steps.reported > 0) & (steps.tokens > 0)
    if not known.any():
        return
    rows = steps[known]
    truth = rows.loss / rows.tokens  # true token mean ΣS/N
    off = ~(_close_series(rows.reported_low, truth, context.rtol) & _close_series(rows.reported_high, truth, context.rtol))
    if not off.any():
        return
    bad = rows[off]
    local = _close_series(bad.reported_low, bad.mean_of_local_means, context.rtol) & \
        _close_series(bad.reported_high, bad.mean_of_local_means, context.rtol)
    first = bad.iloc[0]
    true_value = float(first.loss / first.tokens)
    evidence = {"step": int(first.step), "reported": float(first.reported_high), "token_mean": true_value,
                "mean_of_local_means": float(first.mean_of_local_means)}
    if local.all():
        what = "the mean of per-rank means, not the token mean"
    elif local.any():
        what = "partly the mean of per-rank means"
    else:
        what = f"{float(first.reported_high) / true_value:.4g}× the token mean" if true_value else "not the token mean"
    yield _finding(context, Code.REPORTED_LOSS_MISMATCH, _steps_where(bad, pd.Series(True, index=bad.index)),
                   f"The reported loss differs from ΣS/N in {len(bad)} step(s); it is {what} (step {int(first.step)}: "
                   f"reported {float(first.reported_high):.6g}, ΣS/N = {true_value:.6g}, mean of local means "
                   f"{float(first.mean_of_local_means):.6g}).",
                   "report all_reduce(Σ S)/all_reduce(Σ n) over the step from detached sums and counts",
                   evidence)


def _close_series(values: pd.Series, target: pd.Series, rtol: float) -> pd.Series:
    return (values - target).abs() <= rtol * target.abs().clip(lower=1e-300)


def _probe_findings(steps: pd.DataFrame, context: RunContext) -> Iterator[Finding]:
    """nonuniform_in_microbatch, masked_tokens_weighted."""
    nonuniform = steps.probe_nonuniform > 0
    if nonuniform.any():
        yield _finding(context, Code.NONUNIFORM_IN_MICROBATCH, _steps_where(steps, nonuniform),
                       f"Valid tokens of one microbatch got different weights in {int(steps.probe_nonuniform.sum())} "
                       "record(s): a per-sequence or per-document mean, or a token weighting. Legitimate only when "
                       "chosen on purpose.",
                       "for the token-mean objective, sum per-token losses over the microbatch and divide once by N",
                       {"records": int(steps.probe_nonuniform.sum())})
    masked = steps.masked_weighted > 0
    if masked.any():
        yield _finding(context, Code.MASKED_TOKENS_WEIGHTED, _steps_where(steps, masked),
                       f"Positions that are not valid (padding, ignored labels) carry weight in "
                       f"{int(steps.masked_weighted.sum())} record(s): the loss averages over them.",
                       "mask per-token losses before reducing, and divide by the valid-token count, not the positions",
                       {"records": int(steps.masked_weighted.sum())})


def _missing_ranks(steps: pd.DataFrame, context: RunContext, log: LogQueries) -> Iterator[Finding]:
    """missing_rank: fewer ranks than W recorded a step that others recorded."""
    missing = steps.ranks < steps.w_high
    if not missing.any():
        return
    first = steps[missing].iloc[0]
    present = log.ranks_at(context.run, str(first.grp), int(first.step))
    absent = [r for r in range(int(first.w_high)) if r not in present]
    yield _finding(context, Code.MISSING_RANK, _steps_where(steps, missing),
                   f"{int(missing.sum())} step(s) lack records from some ranks (step {int(first.step)}: ranks "
                   f"{_list(absent)} of W={int(first.w_high)} have none). A rank that skips backward or a collective "
                   "desynchronizes DDP; if it only skipped recording, its tokens are missing from N here.",
                   "every rank runs forward, backward and every collective each microbatch, with a zero loss when "
                   "it has no valid token",
                   {"step": int(first.step), "missing_ranks": absent, "world_size": int(first.w_high)})


def _duplicates(duplicates: tuple[int, int, int, int], context: RunContext) -> Finding:
    """duplicate_records: the engine kept the later of each repeated (group, step, micro, rank)."""
    copies, first, last, count = duplicates
    return Finding(run=context.run, code=Code.DUPLICATE_RECORDS, severity=DEFAULT_SEVERITY[Code.DUPLICATE_RECORDS],
                   steps=StepRange(first, last, count),
                   message=f"{copies} record(s) repeat a (group, step, micro, rank) already logged, e.g. after a "
                           "resume that replayed steps; the later record (by `time`, then file) was kept.",
                   fix="resume from the checkpoint's step and start a new shard sequence; or delete the older shards",
                   evidence={"dropped_records": copies})


def _balanced(steps: pd.DataFrame, diagnoses: list[StepDiagnosis], context: RunContext) -> Iterator[Finding]:
    """balanced_counts: every step with tokens had equal counts everywhere, so the logs cannot tell."""
    nonempty = [d for d in diagnoses if d.kind != "empty"]
    if not nonempty or not all(d.balanced for d in nonempty):
        return
    counts = sorted({int(n) for n in steps.n_high[steps.tokens > 0]})
    yield _finding(context, Code.BALANCED_COUNTS, [int(s) for s in steps.step[steps.tokens > 0]],
                   f"Every record of every step had the same valid-token count ({_list(counts)}), so a local mean "
                   "and the global token mean give the same weights here: this run cannot show which one the code "
                   "uses.",
                   "audit a run with uneven counts (padding, ignored labels, different sequence lengths per rank)",
                   {"counts": counts})


def _segments(steps: pd.DataFrame, diagnoses: list[StepDiagnosis]) -> list[Segment]:
    """Consecutive steps with the same recovered normalization, merged."""
    segments: list[Segment] = []
    ordered = sorted(zip(steps.itertuples(index=False), diagnoses), key=lambda pair: (pair[0].step, pair[0].grp))
    for row, diagnosis in ordered:
        if diagnosis.kind == "empty":
            continue
        factor = diagnosis.factor
        step = int(row.step)
        last = segments[-1] if segments else None
        if last and last.denominator == diagnosis.denominator and last.factor == factor and last.last <= step:
            segments[-1] = Segment(last.first, step, last.steps + (step != last.last), last.denominator, factor)
        else:
            segments.append(Segment(step, step, 1, diagnosis.denominator, factor))
    return segments


def _list(values: Any) -> str:
    items = [str(int(v)) for v in values]
    return ", ".join(items[:8]) + (f", … ({len(items)} in all)" if len(items) > 8 else "")
