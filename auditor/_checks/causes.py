"""What a uniform factor q = e·N says happened, in words: a world-size factor's cause, an overcount, a raw sum."""

from __future__ import annotations

from tokaudit._checks.base import RunContext
from tokaudit._normalization import FactorExplanation, close
from tokaudit._recipes import advice

UNTOLD = (
    " If the gradients are divided by N after backward instead (torchtune's training.scale_grads), tell the "
    "recorder beside it: rec.scale_grads(factor)."
)
"""b = S, the loss sum itself: right where a rescale after backward that the log does not show normalizes it."""

COUNTED_BEFORE_SHIFT_FIX = (
    "count each microbatch's n over the labels its loss is computed on, after the causal shift, and N as their "
    'sum: in torchtune\'s recipes, (labels[..., 1:] != ignore_index).sum() instead of (batch["labels"] != '
    "ignore_index).sum(); or multiply the loss function's mean by the count it divided by"
)


def counted_before_shift(heavy: tuple[int, float], light: tuple[int, float], tokens: int, records: int) -> int | None:
    """k where a step's weights say each record's mean S/n was multiplied by n + k (k labels more than the loss
    is over, as a count taken before the causal shift has, one a row) and the step divided by the sum of those
    counts, N + k·R: a record's share x = e·n of the update is then (n + k)/(N + k·R). The heaviest and the
    lightest record (n, e) give C = N + k·R = (n_h − n_l)/(x_h − x_l) and k = x_h·C − n_h. k must be whole and at
    most the heavier record's n (a label a row, and a row has a label after the shift), and R the step's records
    (each microbatch's mean is the loss's own, so none is empty). A local mean (x_h = x_l) or a token mean (e_h =
    e_l) never fits, nor does a count off by one (S/(n + 1): k = n_h·n_l > n_h)."""
    (n_heavy, e_heavy), (n_light, e_light) = heavy, light
    x_heavy, x_light = e_heavy * n_heavy, e_light * n_light
    if n_heavy >= n_light or not x_light > x_heavy > 0:
        return None
    total = (n_heavy - n_light) / (x_heavy - x_light)
    k = x_heavy * total - n_heavy
    if not 0.5 < k <= n_heavy + 0.02 or abs(k - round(k)) > 0.02:
        return None
    return round(k) if abs((total - tokens) / round(k) - records) <= 0.02 else None


def counted_before_shift_text(k: int, where: str) -> str:
    return (
        f"Each microbatch's mean loss was multiplied by a count of its n valid labels plus {k}, and the step "
        "divided by the sum of those counts: the count was taken before the causal shift, which drops a label "
        f'per row ({k} per microbatch here; torchtune\'s recipes count batch["labels"] before _loss_step '
        f"shifts them), so tokens of small microbatches weigh more: {where}."
    )


def overcounted(context: RunContext) -> str:
    """q = N/N' < 1, varying: the loss was divided by a count N' above the tokens it summed."""
    own = advice(context.trainer, "overcounted")
    trainer = f": {own}" if own else ""
    return (
        " Every token is light by a share that varies: N counted more labels than the loss was computed on "
        f"(one label per row counted before a causal shift does this{trainer}), or the loss is a weighted mean (class "
        "weights over their sum), an objective of its own."
    )


def world_size_cause(explanation: FactorExplanation, q: float, w: int, divisor: float, context: RunContext) -> str:
    k, microbatches, launch = explanation.integer, context.microbatches, context.provenance.launch_world_size
    if (
        explanation.label in ("1/W", "1/k")
        and launch is not None
        and launch > w
        and q > 0
        and close(q * launch / w, 1.0, context.rtol)
    ):
        # q = W/G: N all-reduced over the G processes of the launch, whose W-rank group holds each token G/W times
        return (
            f"the gradient is {launch // w}× too small: N was counted over all {launch} processes of the "
            f"launch, not the averaging group's W={w}; the {launch // w} tensor- or context-parallel ranks that "
            "share each data-parallel rank's tokens each counted them (count N over the data-parallel group, "
            "or once per sequence)"
        )
    # q = 1/M with M the microbatches in the log: the token mean (N over every microbatch) divided by M again,
    # as `loss / gradient_accumulation_steps` does, or as Accelerate's and Lightning's backward do by themselves
    again = (
        f"the token mean was divided again by the M={microbatches} accumulation steps (loss / "
        "gradient_accumulation_steps after N already counted every microbatch; Accelerate's "
        "accelerator.backward and Lightning divide by them themselves)"
    )
    if explanation.label == "1/W":
        cause = (
            f"the W factor is missing: S/N went into a reduction that averages over W={w}"
            if divisor != 1
            else f"S/N was divided by W={w} once more"
        )
        return cause if microbatches != w or microbatches < 2 else f"{cause}; or, as M = W here, {again}"
    if explanation.label == "1/k" and k == microbatches:
        return f"the gradient is {k}× too small: {again}, or N counted {k}× the tokens"
    # q = M: a per-microbatch mean (S/n, every n the same here, so the weights are uniform) summed over M
    # microbatches without the 1/M: M× the token mean whatever W is
    summed = (
        f"; or each microbatch's own mean (its count n, the same in every microbatch here) summed over the "
        f"M={microbatches} microbatches without dividing by M"
        if microbatches >= 2 and close(q, microbatches, context.rtol)
        else ""
    )
    if explanation.label == "W":
        if divisor == 1:
            return f"W·S/N (W={w}) went into a summing reduction (D=1), which needs S/N{summed}"
    if explanation.label == "W'/W":
        return (
            f"the code still scales by W={k} while the averaging group now has W={w}: a stale W kept "
            "across an elastic resize or a resume on other hardware"
        )
    if explanation.label == "1/k":
        return (
            f"the gradient is {k}× too small: N counted {k}× the tokens (ranks that replicate the batch, "
            f"such as tensor- or context-parallel ranks, counted in N), or a constant 1/{k} in the code"
        )
    used = q * w
    return (
        f"the code scaled by {used:.4g} where the averaging group has W={w}: a hard-coded W, a stale "
        f"constant, the global world size used on a data-parallel subgroup (DP×TP), or W applied twice{summed}"
    )
