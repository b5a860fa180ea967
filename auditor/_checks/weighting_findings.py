"""The finding of a group of steps weighted alike: weights unequal within a step, or uniform but off by a factor."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


from tokaudit._checks.base import BF16_HINT, BF16_ROUNDING, DENOMINATOR_WORDS, Extremes, RunContext, StepsSeen
from tokaudit._checks.base import average_fix, make_finding, weight_ratio
from tokaudit._checks.causes import COUNTED_BEFORE_SHIFT_FIX, UNTOLD, counted_before_shift, counted_before_shift_text
from tokaudit._checks.causes import overcounted, world_size_cause
from tokaudit._checks.rescale import schedule_finding
from tokaudit.codes import Code
from tokaudit._normalization import FORMULA, Denominator, FactorExplanation, FactorKind, StepKind, close
from tokaudit._recipes import advice
from tokaudit._report import Finding
from tokaudit._schema import UNNAMED


@dataclass
class WeightingGroup:
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


def _range(values: list[float]) -> list[float]:
    return [float(min(values)), float(max(values))]


def weighting_finding(
    group: WeightingGroup, table: list[FactorExplanation], context: RunContext, extremes: Extremes | None = None
) -> Finding:
    """The finding of one group of steps weighted alike: the evidence every such finding holds, then what is
    said of weights that differ inside a step or of uniform weights off by a factor."""
    row, diagnosis = group.row, group.diagnosis
    factors = group.factor_range
    evidence: dict[str, Any] = {
        "step": int(row.step),
        "denominator": group.denominator.value,
        "factor": diagnosis.factor,
        "world_size": int(row.world_high),
        "grad_divisor": float(row.divisor_high),
        "global_tokens": int(row.tokens),
    }
    if factors:
        evidence["factor_range"] = _range(factors)
    grp = f" (group {row.grp})" if str(row.grp) != UNNAMED else ""
    tokens = int(row.tokens)
    lightest, heaviest = (
        (float(row.weight_low) * tokens, float(row.weight_high) * tokens)
        if diagnosis.kind == StepKind.NONUNIFORM
        else _range(group.distortion_range or [math.nan])
    )
    rescaled = schedule_finding(context, group.steps, lightest, heaviest, int(row.step), tokens, evidence)
    if rescaled is not None:
        return rescaled
    if diagnosis.kind == StepKind.NONUNIFORM:
        return _nonuniform_finding(group, context, evidence, grp, extremes)
    return _uniform_finding(group, table, context, evidence, grp)


def _nonuniform_finding(
    group: WeightingGroup, context: RunContext, evidence: dict[str, Any], grp: str, extremes: Extremes | None
) -> Finding:
    """Tokens of one step weighed differently: where the heaviest and lightest were, and the denominator."""
    code, row = group.code, group.row
    step, tokens = int(row.step), int(row.tokens)
    heavy_e, light_e = float(row.weight_high), float(row.weight_low)
    ratio = heavy_e / light_e if light_e > 0 else math.inf
    heavy, light = _described(row, extremes, heavy_e, light_e, tokens)
    # the gate's ratio (--min-ratio) is the tokens' (`weight_ratio`): the probe's where it saw weights differ inside
    # a record, which the records' mean weights described here cannot show
    tokens_ratio = float(weight_ratio(float(row.token_weight_low), float(row.token_weight_high)))
    evidence.update({"heaviest": heavy, "lightest": light, "weight_ratio": tokens_ratio})
    # two records of one n weighed apart by their ranks' totals: the totals say why
    totals = heavy["valid_tokens"] == light["valid_tokens"] and heavy["rank_tokens"] != light["rank_tokens"]
    heavy_n, light_n = (
        (f"n={record['valid_tokens']}" + (f" of its rank's n_r={record['rank_tokens']}" if totals else ""))
        for record in (heavy, light)
    )
    where = (
        f"at step {step}{grp} a token on rank {heavy['rank']} (microbatch {heavy['micro']}, {heavy_n}) received "
        f"{ratio:.3g}× the weight of a token on rank {light['rank']} (microbatch {light['micro']}, {light_n}); the "
        f"correct weight is 1/N = 1/{tokens}, they got {heavy_e * tokens:.3g}/N and {light_e * tokens:.3g}/N"
        if light_e >= 0  # a weight below 0 is no ratio of weights: a loss ascended, not descended
        else f"at step {step}{grp} a token on rank {light['rank']} (microbatch {light['micro']}, {light_n}) received "
        f"a negative weight, {light_e * tokens:.3g}/N: the update ascended its loss (a sign flipped); the correct "
        f"weight is 1/N = 1/{tokens}, and a token on rank {heavy['rank']} (microbatch {heavy['micro']}, {heavy_n}) "
        f"got {heavy_e * tokens:.3g}/N"
    )
    shift = (
        counted_before_shift(
            (heavy["valid_tokens"], heavy_e), (light["valid_tokens"], light_e), tokens, int(row.records)
        )
        if code in (Code.LOCAL_MEAN, Code.UNEXPLAINED_WEIGHTING)
        else None
    )
    if shift is not None:  # no denominator of the vocabulary: a count, the labels' own, with k more labels
        evidence["extra_labels_per_record"] = shift
        return make_finding(
            context,
            Code.UNEXPLAINED_WEIGHTING,
            group.steps,
            counted_before_shift_text(shift, where),
            COUNTED_BEFORE_SHIFT_FIX,
            evidence,
        )
    message = _nonuniform_message(group, context, evidence, where)
    return make_finding(context, code, group.steps, message, average_fix(context, group.row), evidence)


def _nonuniform_message(group: WeightingGroup, context: RunContext, evidence: dict[str, Any], where: str) -> str:
    """What the denominator that weighed the tokens of one step differently says, `where` they were."""
    code, denominator, row, diagnosis = group.code, group.denominator, group.row, group.diagnosis
    alpha = "?" if diagnosis.factor is None else f"{diagnosis.factor:.4g}"
    formula = f"b·g = {alpha}·{FORMULA.get(denominator, '?')}"
    near = _approximate_text(group, evidence)
    if code == Code.LOCAL_MEAN and denominator == Denominator.MICRO_TIMES_M:
        message = (
            f"{near}Each microbatch's loss was its own mean over its n valid tokens, divided by the "
            f"number of microbatches M={_step_m(context, row)} (loss.mean() / gradient_accumulation_steps; "
            f"{formula}), so microbatches count equally instead of tokens: {where}."
        )
    elif code == Code.LOCAL_MEAN and denominator == Denominator.MICRO and _is_world_size(diagnosis.factor, context):
        message = _mean_times_w(context, near, formula, where)
    elif code == Code.LOCAL_MEAN:
        message = (
            f"{near}Each loss was divided by {DENOMINATOR_WORDS[denominator]} ({formula}), so ranks "
            f"and microbatches count equally instead of tokens: {where}."
        )
    elif code == Code.PER_MICRO_DENOMINATOR:
        message = (
            f"{near}Each microbatch was divided by its own global count N_m instead of the step's N "
            f"({formula}): {where}."
        )
    elif code == Code.PADDED_DENOMINATOR:
        message = (
            f"{near}The loss was divided by the positions T of each microbatch, padding and ignored "
            f"labels included ({formula}): {where}."
        )
    elif diagnosis.approximate is not None:
        message = (
            f"Tokens of one step received different weights; the nearest denominator is "
            f"{DENOMINATOR_WORDS[denominator]} ({formula}), off by up to "
            f"{evidence['approximation_error']:.2%}: {where}."
        )
        # nearest to the token mean itself (b·g = D·S/N, q = 1), and within bf16's rounding of it
        if (
            denominator == Denominator.N
            and evidence["approximation_error"] <= BF16_ROUNDING
            and diagnosis.factor is not None
            and abs(diagnosis.factor / float(row.divisor_high) - 1) <= BF16_ROUNDING
        ):
            evidence["within_bfloat16_rounding"] = True
            message += BF16_HINT
    else:
        message = (
            f"Tokens of one step received different weights and no denominator (n, n_r, n·M, N_m, N, T, "
            f"1) explains them: {where}."
        )
        # q = e·N equal to the record's own n: b/S' = (W·S/N)/(S/n), the token mean's b over a logged mean S' = S/n
        records = (evidence["heaviest"], evidence["lightest"])
        if all(close(record["distortion"], record["valid_tokens"], context.rtol) for record in records):
            message += (
                " Each of these tokens weighs its record's own n/N: the token mean's b over a loss_sum that holds "
                "the record's mean (S/n, a mean loss's .item()) gives exactly that; if the log holds means, record "
                "each record's sum and audit again."
            )
    return message


def _approximate_text(group: WeightingGroup, evidence: dict[str, Any]) -> str:
    """Where the weights fit the denominator only approximately: by how much, and what does this; else ""."""
    if group.diagnosis.approximate is None:
        return ""
    off = group.approximate
    evidence.update({"approximate": True, "approximation_error": off})
    return (
        f"The weights fit {DENOMINATOR_WORDS[group.denominator]} only approximately (α varies by up to "
        f"{off:.2%}; a count that is off by a few tokens per sequence, such as one extra label per "
        "row from unshifted labels, does this). "
    )


def _uniform_finding(
    group: WeightingGroup, table: list[FactorExplanation], context: RunContext, evidence: dict[str, Any], grp: str
) -> Finding:
    """Every token of a step weighed alike, but q = e·N is not 1: a padded count, a loss scale, a world-size
    factor, a raw sum or another constant."""
    code, row, diagnosis = group.code, group.row, group.diagnosis
    step, w, tokens = int(row.step), int(row.world_high), int(row.tokens)
    explanation = table[group.explanation] if group.explanation >= 0 else None
    q = diagnosis.distortion or 0.0
    distortions = group.distortion_range
    evidence.update({"distortion": q, "effective_weight": q / tokens, "distortion_range": _range(distortions)})
    # q changes from step to step only beyond the tolerance the run is judged at (float32 noise is no change)
    spread = (
        ""
        if close(min(distortions), max(distortions), context.rtol)
        else f"; over the {group.count} step(s) q ranges from {_q(min(distortions))} to {_q(max(distortions))}"
    )
    near = abs(q - 1) < NEAR_ONE  # say the tolerance a q this close to 1 was judged against
    scaled = (
        f"every valid token received {_q(q)}/N instead of 1/N (step {step}{grp}, N={tokens}, W={w}, "
        f"D={row.divisor_high:g}){spread}"
        + (f", |q − 1| = {abs(q - 1):.2g} past the tolerance rtol = {context.rtol:g} (--rtol)" if near else "")
    )
    if code == Code.PADDED_DENOMINATOR:
        evidence["positions"] = int(row.positions)
        message = (
            f"The loss was divided by all {int(row.positions)} positions of the step, padding and ignored "
            f"labels included, instead of its {tokens} valid tokens: {scaled}."
            if group.denominator == Denominator.STEP_POSITIONS
            else "Each microbatch's loss was divided by its own positions T (every record of the step holds as many), "
            f"padding and ignored labels included, instead of the step's {tokens} valid tokens: {scaled}."
        )
        return make_finding(context, code, group.steps, message, average_fix(context, group.row), evidence)
    if code == Code.UNDECLARED_TERM_WEIGHT:
        return _term_weight_finding(group, explanation, context, evidence, scaled, len(table))
    if code == Code.LOSS_SCALE:
        assert explanation is not None
        return _loss_scale_finding(group, table, context, evidence, scaled)
    if code == Code.WORLD_SIZE_MISMATCH:
        assert explanation is not None
        return _world_size_finding(group, explanation, context, evidence, scaled)
    return _constant_finding(group, context, evidence, scaled, spread)


def _term_weight_finding(
    group: WeightingGroup,
    explanation: FactorExplanation | None,
    context: RunContext,
    evidence: dict[str, Any],
    scaled: str,
    factors: int,
) -> Finding:
    """A named term's tokens all weigh q/N, one q over the run or over each span of a schedule of `factors` values:
    a coefficient λ = q chosen on purpose, or a factor missing from the term's loss (what the factor looks like,
    where it looks like one); the logs cannot tell."""
    q = group.diagnosis.distortion or 0.0
    steps = group.steps.range()
    over = (
        "by one factor over the run"
        if factors == 1
        else f"by one factor over steps {steps.first}–{steps.last}, one of {factors} over the run (a schedule of λ)"
    )
    w = int(group.row.world_high)
    looks = (
        f", or a factor missing from this term's loss ({world_size_cause(explanation, q, w, float(group.row.divisor_high), context)})"
        if explanation is not None and explanation.kind == FactorKind.WORLD_SIZE
        else ", or a factor this term's loss should not carry"
    )
    message = (
        f"Every step of loss term {context.term} weighed all its tokens alike, {over}: {scaled}. "
        f"That is a coefficient λ = {q:.4g} the objective gives this term on purpose{looks}; the logs cannot tell "
        "which, as no weight was declared for the term."
    )
    fix = (
        f"if λ = {q:.4g} is chosen on purpose, declare it: `with rec.loss_term({context.term!r}, weight={q:.4g}):` "
        "(its tokens are then judged against λ/N); else normalize this term as the main one"
    )
    return make_finding(context, group.code, group.steps, message, fix, evidence)


def _loss_scale_finding(
    group: WeightingGroup, table: list[FactorExplanation], context: RunContext, evidence: dict[str, Any], scaled: str
) -> Finding:
    """Uniform weights off by a power of two that W does not explain: the loss scale of mixed precision."""
    w = int(group.row.world_high)
    exponents = sorted({j for i in group.explanations if i >= 0 and (j := table[i].integer) is not None})
    evidence["loss_scale_exponents"] = exponents
    shown = " to ".join(f"2^{j}" for j in ([exponents[0], exponents[-1]] if len(exponents) > 1 else exponents))
    message = (
        f"Weights are uniform but carry a power-of-two factor ({shown}) that W={w} does not explain: "
        f"{scaled}. This is the loss scale of mixed precision (a GradScaler), which the log does not "
        "record, so the gradient's true scale cannot be judged here."
    )
    fix = (
        "pass the scaler to the recorder, Recorder(..., scaler=scaler), so its scale is divided out of the "
        "weights (the Hugging Face and Lightning callbacks find the trainer's scaler themselves)"
    )
    return make_finding(context, group.code, group.steps, message, fix, evidence)


def _world_size_finding(
    group: WeightingGroup, explanation: FactorExplanation, context: RunContext, evidence: dict[str, Any], scaled: str
) -> Finding:
    """Uniform weights off by a world-size factor (1/W, 1/k, W'/W, k/W): its cause, and whether b is a raw sum."""
    row = group.row
    w, tokens, q = int(row.world_high), int(row.tokens), group.diagnosis.distortion or 0.0
    cause = world_size_cause(explanation, q, w, float(row.divisor_high), context)
    evidence["integer_factor"] = {
        "1/W": f"1/{w}",
        "1/k": f"1/{explanation.integer}",
        "W'/W": f"{explanation.integer}/{w}",
        "k/W": f"{explanation.integer}/{w}",
    }.get(explanation.label, explanation.integer)
    if explanation.label == "W'/W":
        evidence["world_sizes"] = [explanation.integer, w]
        evidence["stale_world_size"] = explanation.integer
    message = f"Weights are uniform but off by a world-size factor: {scaled}; {cause}."
    divisor, fix = float(row.divisor_high), average_fix(context, group.row)
    if close(q * divisor, float(tokens), context.rtol):  # e = 1/D: b = S, as a raw sum
        message += UNTOLD
    if float(row.divisor_low) == divisor and divisor.is_integer() and 1 < divisor < w and w % divisor == 0:
        # D said, of a group W/D times smaller than the ranks recorded: a DP×TP (or CP) loop recorded without group=
        # counts each token once per replica in N, and all ranks as W
        message += (
            f" D={divisor:g} is no average over W={w}: if the gradients are averaged over a data-parallel group "
            f"of {divisor:g} ranks, each token held by {w // int(divisor)} ranks (DP×TP, DP×CP), the log counts every "
            f"token once per rank that holds it, and all {w} ranks as W."
        )
        fix = f"record with Recorder(group=the data-parallel group) where the gradients average over one; else {fix}"
    return make_finding(context, group.code, group.steps, message, fix, evidence)


NEAR_ONE = 0.01
"""A uniform factor this close to 1 is said with the tolerance it was judged against."""


def _q(q: float) -> str:
    """q in 4 significant digits, more where 4 would show a q ≠ 1 as 1."""
    digits = 4
    while f"{q:.{digits}g}" == "1" and q != 1 and digits < 17:
        digits += 1
    return f"{q:.{digits}g}"


def _constant_finding(
    group: WeightingGroup, context: RunContext, evidence: dict[str, Any], scaled: str, spread: str
) -> Finding:
    """Uniform weights off by no count, loss scale or world size: a raw sum (no denominator), or a constant or
    a factor that changes from step to step (`spread`)."""
    code, denominator, diagnosis, distortions = group.code, group.denominator, group.diagnosis, group.distortion_range
    if denominator == Denominator.ONE:
        message = (
            f"The loss sum was backpropagated without a token denominator (b·g = {diagnosis.factor:g}·S): "
            f"{scaled}; the gradient's size grows with the number of valid tokens (under SGD so does the step; "
            f"under Adam(W) its balance against epsilon, weight decay and gradient clipping shifts).{UNTOLD}"
        )
        if close(diagnosis.factor, 1.0, context.rtol):  # b = S: both columns may hold one value, the record's mean
            message += (
                " If loss_sum holds each record's mean (S/n) rather than its sum, as b does, the loss was each "
                "microbatch's own mean (local_mean): record the sum to tell."
            )
    else:
        aux = (
            " If this term is weighted on purpose (an auxiliary loss coefficient λ), this is that λ."
            if context.term != UNNAMED
            else ""
        )
        what = "a constant" if not spread else "a factor that changes from step to step"
        message = f"Weights are uniform within each step but scaled by {what}: {scaled}.{aux}"
        if max(distortions) < 0:
            message += (
                " Every weight is negative: the update ascended the loss rather than descended it (a sign flipped)."
            )
        if spread and max(distortions) < 1:
            message += overcounted(context)
            if own_fix := advice(context.trainer, "overcounted_fix"):
                return make_finding(context, code, group.steps, message, own_fix, evidence)
        if max(abs(d - 1) for d in distortions) <= BF16_ROUNDING:
            evidence["within_bfloat16_rounding"] = True
            message += BF16_HINT
    return make_finding(context, code, group.steps, message, average_fix(context, group.row), evidence)


def _step_m(context: RunContext, row: Any) -> int | str:
    """The M of the step shown, its ranks' own (e·n·M is read per rank), not the run's most."""
    low, high = (int(row.microbatches_low), int(row.microbatches_high)) if row is not None else (0, 0)
    return context.microbatches if high < 1 else high if low == high else f"{low}–{high}"


def _mean_times_w(context: RunContext, near: str, formula: str, where: str) -> str:
    """b·g = W·S/n: each microbatch's own mean, times the W meant for a sum divided by the step's N, and not
    divided by M; DDP's average then sums W·M such means, about W·M times the token mean's size."""
    w, m = context.world_size, context.microbatches
    own = advice(context.trainer, "mean_times_w")
    trainer = f" {own}" if own else ""
    return (
        f"{near}Each microbatch's loss was its own mean over its n valid tokens, multiplied by W={w} and not "
        f"divided by the M={m} microbatches ({formula}), so microbatches count equally instead of tokens and "
        f"the gradient is about W·M={w * m} times the token mean's: {where}.{trainer}"
    )


def _is_world_size(factor: float | None, context: RunContext) -> bool:
    """α is the run's W (several: any of them), within the tolerance."""
    sizes = context.world_sizes or (context.world_size,)
    return factor is not None and any(w > 0 and close(factor, float(w), context.rtol) for w in sizes)


def _described(
    row: Any, extremes: Extremes | None, heavy_e: float, light_e: float, tokens: int
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
    return {
        "rank": int(getattr(row, f"{which}_rank")),
        "micro": int(getattr(row, f"{which}_micro")),
        "valid_tokens": int(getattr(row, f"{which}_n")),
        "rank_tokens": int(getattr(row, f"{which}_rank_tokens")),
        "effective_weight": weight,
        "distortion": weight * tokens,
    }
