"""The backward probe: an identity in forward that reads ∂b/∂ℓᵢ, the weight each token's loss got."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tokaudit.hooks._columns import Packed, significant_bits


class ProbeResult:
    """Per-microbatch weights that backward gave the per-token losses, kept on the device.

    Filled by `TokenProbe.backward` and `ScalarProbe.backward`; several probes in one microbatch accumulate.
    """

    VALUES = ("weight_sum", "weight_min", "weight_max", "masked_abs_sum", "valid_count")
    """What a backward measures, each a one-number tensor on the device (packed once its update closes)."""
    __slots__ = (*VALUES, "filled", "on_fill", "bits")

    def __init__(self) -> None:
        # a tensor until its update closes; then a place in the update's pack (`Recorder._pack`)
        self.weight_sum: torch.Tensor | Packed | None = None
        self.weight_min: torch.Tensor | Packed | None = None
        self.weight_max: torch.Tensor | Packed | None = None
        self.masked_abs_sum: torch.Tensor | Packed | None = None
        self.valid_count: torch.Tensor | Packed | None = None
        self.filled = False
        self.on_fill: Callable[[], None] | None = None
        """Called once, when the first backward reaches this probe."""
        self.bits: int | None = None
        """The fewest significant bits of the gradients it read (`significant_bits`)."""

    def add(self, grad: torch.Tensor, valid: torch.Tensor, masked_live: torch.Tensor) -> None:
        """`masked_live`: positions that are not valid and whose loss is not an exact 0."""
        # grad = ∂b/∂ℓᵢ for every position; reductions stay on the device (no host sync) and
        # accumulate in float64, the per-token values stay in the gradient's own dtype.
        weight = grad.detach()
        self._note_bits(grad)
        inf = float("inf")  # Python scalars: no host-to-device copy inside backward
        weight_sum = torch.where(valid, weight, 0).sum(dtype=torch.float64)
        weight_min = torch.where(valid, weight, inf).amin().double()
        weight_max = torch.where(valid, weight, -inf).amax().double()
        # A masked position whose loss is an exact 0 (cross_entropy's ignore_index) passes no gradient
        # to the model whatever weight it gets: ∂b/∂θ = Σᵢ wᵢ·∂ℓᵢ/∂θ and ∂ℓᵢ/∂θ = 0 there. So
        # `per_token.sum() / N` is not flagged; weight on a masked loss that is not 0 (padding
        # labelled as a real token) is.
        masked_abs_sum = torch.where(masked_live, weight.abs(), 0).sum(dtype=torch.float64)
        self._accumulate(weight_sum, weight_min, weight_max, masked_abs_sum, valid.sum())

    def add_uniform(self, weight: torch.Tensor, valid_count: torch.Tensor, grad: torch.Tensor) -> None:
        """Every valid token got the same weight (a reduced loss, whose gradient is `grad`); positions that are
        not valid got 0."""
        self._note_bits(grad)
        weight = weight.detach().to(torch.float64).reshape(())
        inf = float("inf")
        has_tokens = valid_count > 0
        self._accumulate(
            weight * valid_count,
            torch.where(has_tokens, weight, inf),
            torch.where(has_tokens, weight, -inf),
            torch.zeros_like(weight),
            valid_count,
        )

    def _note_bits(self, grad: torch.Tensor) -> None:
        bits = significant_bits(grad)  # a dtype, read without touching the values: no device sync
        if bits is not None:
            self.bits = bits if self.bits is None else min(self.bits, bits)

    def _accumulate(
        self,
        weight_sum: torch.Tensor,
        weight_min: torch.Tensor,
        weight_max: torch.Tensor,
        masked_abs_sum: torch.Tensor,
        valid_count: torch.Tensor,
    ) -> None:
        if self.weight_sum is None:
            self.weight_sum, self.weight_min, self.weight_max = weight_sum, weight_min, weight_max
            self.masked_abs_sum, self.valid_count = masked_abs_sum, valid_count
        else:
            # a backward that reaches a probe again after its update was packed adds to the packed values
            held_sum, held_min, held_max, held_masked, held_count = (
                value.tensor() if isinstance(value, Packed) else value
                for value in (getattr(self, name) for name in self.VALUES)
            )
            assert held_sum is not None and held_min is not None and held_max is not None
            assert held_masked is not None and held_count is not None
            self.weight_sum = held_sum + weight_sum
            self.weight_min = torch.minimum(held_min, weight_min)
            self.weight_max = torch.maximum(held_max, weight_max)
            self.masked_abs_sum = held_masked + masked_abs_sum
            self.valid_count = held_count + valid_count
        first = not self.filled
        self.filled = True
        if first and self.on_fill is not None:
            self.on_fill()


class TokenProbe(torch.autograd.Function):
    """Identity in forward; in backward it reads ∂b/∂ℓᵢ and passes the gradient on unchanged."""

    @staticmethod
    def forward(
        ctx: Any,
        per_token_loss: torch.Tensor,
        valid: torch.Tensor,
        result: ProbeResult,
        on_error: Callable[[BaseException], None],
    ) -> torch.Tensor:
        # One elementwise op on the device, no sync: which masked positions hold a loss that is not 0.
        ctx.save_for_backward(valid, ~valid & (per_token_loss.detach() != 0))
        ctx.result = result
        ctx.on_error = on_error
        # A new tensor, not a view: a trainer may modify the result in place (`loss *= k`), which autograd
        # refuses on a view made inside a custom Function. clone() keeps every bit, dtype and layout.
        return per_token_loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        valid, masked_live = ctx.saved_tensors
        try:
            ctx.result.add(grad, valid, masked_live)
        except Exception as error:  # the probe never breaks training
            ctx.on_error(error)
        return grad, None, None, None


class ScalarProbe(torch.autograd.Function):
    """Identity on a reduced loss; backward sees g = ∂b/∂loss, so every valid token got g·∂loss/∂ℓᵢ."""

    @staticmethod
    def forward(
        ctx: Any,
        loss: torch.Tensor,
        token_factor: torch.Tensor,
        valid_count: torch.Tensor,
        result: ProbeResult,
        on_error: Callable[[BaseException], None],
    ) -> torch.Tensor:
        ctx.save_for_backward(token_factor, valid_count)
        ctx.result = result
        ctx.on_error = on_error
        return loss.clone()  # not a view: `loss *= k` after the probe must work (see TokenProbe.forward)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        token_factor, valid_count = ctx.saved_tensors
        try:
            ctx.result.add_uniform(grad * token_factor, valid_count, grad)
        except Exception as error:  # the probe never breaks training
            ctx.on_error(error)
        return grad, None, None, None, None


def unprobed(per_token_loss: object) -> tuple[str, str] | None:
    """Why `Recorder.probe` returns its input as it is and measures nothing (a warning's key and text), if it does:
    no tensor, or one that requires grad under torch.no_grad() (its output would cut the gradient)."""
    if not isinstance(per_token_loss, torch.Tensor):
        return "probe-type", (
            f"tokaudit: probe() was given a {type(per_token_loss).__name__}, not the per-token loss tensor; it returns "
            "it as it is and measures nothing"
        )
    if per_token_loss.requires_grad and not torch.is_grad_enabled():
        return "probe-no-grad", (
            "tokaudit: probe() was called under torch.no_grad(); it returns its input as it is and measures nothing "
            "there (call it where the loss is computed, with gradients on)"
        )
    return None


def in_backward() -> bool:
    """Whether autograd is running a backward now (a checkpoint recomputes its function there)."""
    return bool(torch._C._current_graph_task_id() != -1)


class Recomputations:
    """Activation checkpointing with the probe inside the checkpointed function.

    A reentrant checkpoint runs the function without grad in forward, so the probe measures nothing
    there, and runs it again with grad inside backward: that second probe measures the record made for
    it in between (the records waiting, in order). A non-reentrant checkpoint's forward has grad and its
    probe measures; its recomputation inside backward feeds nothing back to it."""

    def __init__(self) -> None:
        self.asked = False
        """A probe was asked for without grad since the last record."""
        self.waiting: list[Any] = []
        """Records whose probe a recomputation is to bring, in the order they were made."""

    def recorded(self, record: Any) -> None:
        if self.asked and record.probe is None:
            self.waiting.append(record)
        self.asked = False

    def result(self, with_grad: bool) -> ProbeResult | None:
        """The result a probe asked for now measures into: None without grad (no probe); inside backward the
        waiting record's, else one that is never written (a non-reentrant recomputation must save the tensors
        its forward saved, so it runs the probe too)."""
        if not with_grad:
            self.asked = True
            return None
        if not self.waiting:
            return ProbeResult()
        record = self.waiting.pop(0)
        record.probe = ProbeResult()
        return record.probe  # type: ignore[no-any-return]
