"""Record every training cross-entropy call, whatever the trainer does with the loss afterwards.

While active, `torch.nn.functional.cross_entropy` (and so `nn.CrossEntropyLoss`, which calls it)
runs unchanged and returns exactly what it would: the same tensor, to the bit, with the same
gradient. Beside it the call records S, n and the positions, and a probe on its output measures
∂b/∂ℓᵢ in backward, so each token's weight is known even when the trainer divides by the
accumulation steps, multiplies by W or adds auxiliary terms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tokaudit.hooks.recorder import ProbeResult, Recorder


class _ScalarProbe(torch.autograd.Function):
    """Identity on a reduced loss; backward sees g = ∂b/∂loss, so every valid token got g·∂loss/∂ℓᵢ."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, token_factor: torch.Tensor, valid_count: torch.Tensor,
                result: ProbeResult, on_error: Callable[[BaseException], None]) -> torch.Tensor:
        ctx.save_for_backward(token_factor, valid_count)
        ctx.result = result
        ctx.on_error = on_error
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        token_factor, valid_count = ctx.saved_tensors
        try:
            ctx.result.add_uniform(grad * token_factor, valid_count)
        except Exception as error:  # the probe never breaks training
            ctx.on_error(error)
        return grad, None, None, None, None


def _valid_mask(input: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Valid positions, shaped like the per-token loss."""
    if target.is_floating_point():  # class probabilities: every sample counts
        shape = input.shape[:1] + input.shape[2:] if input.dim() > 1 else torch.Size([])
        return torch.ones(shape, dtype=torch.bool, device=input.device)
    return target != ignore_index


@contextmanager
def capture_cross_entropy(recorder: Recorder) -> Iterator[None]:
    """Patch F.cross_entropy for the duration; calls without grad (evaluation) pass through."""
    original = F.cross_entropy

    def captured(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                 size_average: bool | None = None, ignore_index: int = -100, reduce: bool | None = None,
                 reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
        out = original(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        if not (torch.is_grad_enabled() and out.requires_grad):
            return out
        try:
            if size_average is not None or reduce is not None:
                reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
            return _record(recorder, out, input, target, weight, ignore_index, reduction)
        except Exception as error:
            recorder._warn_once("capture", f"tokaudit: a cross-entropy call was not recorded ({error!r})")
            return out

    F.cross_entropy = captured
    try:
        yield
    finally:
        F.cross_entropy = original


def _record(recorder: Recorder, out: torch.Tensor, input: torch.Tensor, target: torch.Tensor,
            weight: torch.Tensor | None, ignore_index: int, reduction: str) -> torch.Tensor:
    from tokaudit.hooks.recorder import ProbeResult

    valid = _valid_mask(input, target, ignore_index)
    valid_count = valid.sum()
    if reduction == "none":
        probed = recorder.probe(out, valid)
        result = recorder._pending_probe
        loss_sum = out.detach().sum()  # positions that are not valid hold 0
    else:
        # mean = Σℓᵢ / Σw_{yᵢ} over valid positions (Σw = n without class weights; the sample
        # count for probability targets); sum = Σℓᵢ. So ∂loss/∂ℓᵢ is 1/Σw or 1 for every valid i.
        if reduction == "mean":
            if target.is_floating_point():
                denominator = torch.full((), float(valid.numel()), device=out.device)
            elif weight is not None:
                denominator = (weight[target.masked_fill(~valid, 0)] * valid).sum()
            else:
                denominator = valid_count.to(out.dtype)
            loss_sum = torch.where(denominator > 0, out.detach() * denominator, 0.0)
            token_factor = 1 / denominator.to(torch.float64)
        else:
            loss_sum = out.detach()
            token_factor = torch.ones((), dtype=torch.float64, device=out.device)
        result = ProbeResult()
        probed = _ScalarProbe.apply(  # type: ignore[no-untyped-call]
            out, token_factor, valid_count, result, recorder._probe_failed)
    recorder._pending_probe = result
    recorder.record(loss_sum=loss_sum, valid_tokens=valid_count, backward_scalar=None, positions=valid.numel(),
                    _captured=True)
    return probed
