"""Record every training cross-entropy call, whatever the trainer does with the loss afterwards.

While active, `torch.nn.functional.cross_entropy` (and so `nn.CrossEntropyLoss`, which calls it)
runs unchanged and returns exactly what it would: the same tensor, to the bit, with the same
gradient. Beside it the call records S, n and the positions, and a probe on its output measures
∂b/∂ℓᵢ in backward, so each token's weight is known even when the trainer divides by the
accumulation steps, multiplies by W or adds auxiliary terms.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tokaudit.hooks._probe import ProbeResult, ScalarProbe, TokenProbe
from tokaudit.hooks._terms import Footprint


class Recorder(Protocol):
    """What a capture asks of the recorder it records for (`hooks.recorder.Recorder`)."""

    provenance: dict[str, Any]
    """In every shard's footer: a call with class weights says so here (`class_weights`)."""

    def probe_failed(self, error: BaseException) -> None: ...

    def warn_once(self, key: str, message: str) -> None: ...

    def captured_call(
        self, footprint: Footprint, loss_sum: torch.Tensor, valid_tokens: torch.Tensor, positions: int
    ) -> ProbeResult: ...


NOTHING_CAPTURED = (
    "no cross-entropy call was captured: the loss is computed by a function tokaudit cannot see (a "
    "fused or vocab-parallel cross-entropy such as Liger's, cut-cross-entropy or Megatron's); record it "
    "with rec.probe(per_token_loss, valid) and rec.record(...) around that loss"
)
"""Said once when an optimizer steps with no record while cross-entropy calls are captured."""


def _valid_mask(input: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Valid positions, shaped like the per-token loss."""
    if target.is_floating_point():  # class probabilities: every sample counts
        shape = input.shape[:1] + input.shape[2:] if input.dim() > 1 else torch.Size([])
        return torch.ones(shape, dtype=torch.bool, device=input.device)
    return target != ignore_index


@contextmanager
def capture_cross_entropy(recorder: Recorder) -> Iterator[None]:
    """Patch F.cross_entropy for the duration; calls without grad (evaluation) pass through. Used through
    `Recorder.capture_cross_entropy()`, which knows it is capturing."""
    original = F.cross_entropy

    def captured(
        input: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None = None,
        size_average: bool | None = None,
        ignore_index: int = -100,
        reduce: bool | None = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        out = original(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        if torch.compiler.is_compiling():
            # Inside a compiled region recording would break the graph at every step: leave the call
            # alone (the optimizer step then says nothing was captured) and say how to record instead.
            recorder.warn_once(
                "compiled",
                "tokaudit: a cross-entropy inside torch.compile is not captured; "
                "return the per-token loss from the compiled function and wrap it "
                "with rec.probe() and rec.record() outside it",
            )
            return out
        if not (torch.is_grad_enabled() and out.requires_grad):
            return out
        try:
            if size_average is not None or reduce is not None:
                reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
            return _record(recorder, out, input, target, weight, ignore_index, reduction)
        except Exception as error:
            reraise_control(error)
            recorder.warn_once("capture", f"tokaudit: a cross-entropy call was not recorded ({error!r})")
            return out

    F.cross_entropy = captured
    try:
        yield
    finally:
        F.cross_entropy = original


def reraise_control(error: Exception) -> None:
    """Raise again what is no failure of the recording but the control flow of the code around it: non-reentrant
    activation checkpointing stops its recomputation in backward by raising from a tensor the recomputed forward
    saves (one of ours, when the loss is recomputed): caught, the recomputation would run on, with a false warning."""
    from torch.utils import checkpoint

    if isinstance(error, getattr(checkpoint, "_StopRecomputationError", ())):
        raise error


def _record(
    recorder: Recorder,
    out: torch.Tensor,
    input: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
) -> torch.Tensor:
    valid = _valid_mask(input, target, ignore_index)
    valid_count = valid.sum()
    # Every class weighing one c (weight=torch.full(...), read on the CPU alone: a device's would cost a sync at every
    # call) is no class weighting of labels: ℓᵢ = c·ℓ'ᵢ, the mean Σcℓ'/(c·n) is the unweighted one, and a sum's
    # token ℓ'ᵢ gets c·∂b/∂out. Other weights: the mean is over Σw, which no record holds (the audit's N counts
    # tokens), so a right normalization weighs every token N/Σw of 1/N: the audit is told.
    one = _one_weight(weight)
    c = one if not target.is_floating_point() and reduction != "none" else None
    if weight is not None and c is None and one != 1.0:  # (weights of 1 are none, whatever the reduction)
        recorder.provenance["class_weights"] = True
    if reduction == "none":
        loss_sum = out.detach().sum()  # positions that are not valid hold 0
        result = _captured_call(recorder, loss_sum, valid_count, valid.numel(), target, input)
        return probe_into(recorder, out, valid, result)
    # mean = Σℓᵢ / Σw_{yᵢ} over valid positions (Σw = n without class weights; the sample
    # count for probability targets); sum = Σℓᵢ. So ∂loss/∂ℓᵢ is 1/Σw or 1 for every valid i.
    if reduction == "mean":
        if target.is_floating_point():
            denominator = torch.full((), float(valid.numel()), device=out.device)
        elif weight is not None and c is None:
            denominator = (weight[target.masked_fill(~valid, 0)] * valid).sum()
        else:
            denominator = valid_count.to(out.dtype)
        return record_mean(recorder, out, valid, valid_count, target, denominator, input)
    # sum = Σℓᵢ: ∂loss/∂ℓᵢ = 1 (of an unweighted token ℓ'ᵢ = ℓᵢ/c, c)
    scale = 1.0 if c is None else c
    return _probed_scalar(
        recorder,
        out,
        out.detach() / scale,
        torch.full((), scale, dtype=torch.float64, device=out.device),
        valid,
        valid_count,
        target,
        input,
    )


def _one_weight(weight: torch.Tensor | None) -> float | None:
    """c > 0 where a CPU tensor of class weights gives every class c; else None."""
    if weight is None or weight.device.type != "cpu" or not weight.numel():
        return None
    c = float(weight.reshape(-1)[0])
    return c if c > 0 and bool((weight == c).all()) else None


def record_mean(
    recorder: Recorder,
    out: torch.Tensor,
    valid: torch.Tensor,
    valid_count: torch.Tensor,
    target: torch.Tensor,
    denominator: torch.Tensor,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Record a reduced loss out = Σℓᵢ / denominator over the `valid` positions of `target` (`valid_count` of
    them): S = out·denominator, and every valid token got ∂b/∂out / denominator."""
    loss_sum = torch.where(denominator > 0, out.detach() * denominator, 0.0)
    return _probed_scalar(
        recorder, out, loss_sum, 1 / denominator.to(torch.float64), valid, valid_count, target, logits
    )


def _probed_scalar(
    recorder: Recorder,
    out: torch.Tensor,
    loss_sum: torch.Tensor,
    token_factor: torch.Tensor,
    valid: torch.Tensor,
    valid_count: torch.Tensor,
    target: torch.Tensor,
    logits: torch.Tensor | None,
) -> torch.Tensor:
    """`out` through a probe that reads ∂b/∂out in backward: each valid token got ∂b/∂out · token_factor."""
    result = _captured_call(recorder, loss_sum, valid_count, valid.numel(), target, logits)
    probed: torch.Tensor = ScalarProbe.apply(  # type: ignore[no-untyped-call]
        out, token_factor, valid_count, result, recorder.probe_failed
    )
    return probed


def probe_into(
    recorder: Recorder, per_token_loss: torch.Tensor, valid_mask: torch.Tensor | None, result: ProbeResult
) -> torch.Tensor:
    """`per_token_loss` through a probe that adds what backward gave its valid positions into `result`."""
    try:
        if valid_mask is None:
            valid = torch.ones_like(per_token_loss, dtype=torch.bool)
        else:
            valid = valid_mask.to(device=per_token_loss.device, dtype=torch.bool).expand_as(per_token_loss)
        probed: torch.Tensor = TokenProbe.apply(  # type: ignore[no-untyped-call]
            per_token_loss, valid, result, recorder.probe_failed
        )
        return probed
    except Exception as error:
        if type(error).__name__ == "_StopRecomputationError":
            raise  # a non-reentrant checkpoint ending its recomputation early: torch's own control flow
        recorder.warn_once("probe", f"tokaudit: probe disabled for this call ({error!r})")
        return per_token_loss


def _captured_call(
    recorder: Recorder,
    loss_sum: torch.Tensor,
    valid_tokens: torch.Tensor,
    positions: int,
    target: torch.Tensor,
    logits: torch.Tensor | None,
) -> ProbeResult:
    """Where one captured cross-entropy call goes (`Recorder.captured_call`), known by its labels' footprint
    and the split its logits come from."""
    return recorder.captured_call(Footprint.of(target, logits), loss_sum, valid_tokens, positions)
