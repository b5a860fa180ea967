"""Mixed precision: read a GradScaler's scale and its skipped updates without a host sync."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


class ScalerWatch:
    """Wraps one `torch.amp.GradScaler` instance (its `scale` and `update`), never its class.

    The probe measures ∂(scale·loss)/∂ℓᵢ: the scale must be divided out of the weights, so each
    record keeps a device copy of the scale it was made under (`update()` changes it in place).
    `update()` runs once per optimizer update, after `step()`: that is where a skipped update shows
    (no optimizer step since the last one, or `found_inf` > 0 for fused optimizers that step anyway).
    """

    def __init__(self, scaler: Any, on_update: Callable[[torch.Tensor | None], None]) -> None:
        self.scaler = scaler
        self._on_update = on_update
        self._awaiting: list[Any] = []
        """Records made before the scaler's first `scale()`: their loss scale is the one it then has."""
        self._original_scale = scaler.scale
        self._original_update = scaler.update
        self._last_scaled: weakref.ref[torch.Tensor] | None = None
        scaler.scale = self._scale
        scaler.update = self._update

    def enabled(self) -> bool:
        return bool(self.scaler.is_enabled())

    def current(self) -> torch.Tensor | None:
        """A device copy of the scale now (no sync); None before the scaler's first `scale()`."""
        scale = getattr(self.scaler, "_scale", None)
        return scale.detach().clone() if isinstance(scale, torch.Tensor) else None

    def await_scale(self, record: Any) -> None:
        """`record.loss_scale` set at the next `scale()` (a record made before the scaler's first one)."""
        self._awaiting.append(record)

    def is_scaled(self, value: object) -> bool:
        """Whether `value` is the tensor the scaler's last `scale()` returned (already scaled)."""
        return self._last_scaled is not None and self._last_scaled() is value

    def found_inf(self) -> torch.Tensor | None:
        """Σ found_inf over the devices of this update's `step()` (0 when it stepped), on the device."""
        states = getattr(self.scaler, "_per_optimizer_states", {})
        tensors = [
            t
            for state in states.values()
            for t in state.get("found_inf_per_device", {}).values()
            if isinstance(t, torch.Tensor)
        ]
        if not tensors:
            return None
        total = tensors[0].detach().to(torch.float32).clone()
        for tensor in tensors[1:]:
            total = total + tensor.detach().to(device=total.device, dtype=torch.float32)
        return total

    def close(self) -> None:
        """Give the scaler back its own methods."""
        for name, mine in (("scale", self._scale), ("update", self._update)):
            if self.scaler.__dict__.get(name) == mine:
                del self.scaler.__dict__[name]

    def _scale(self, outputs: Any) -> Any:
        scaled = self._original_scale(outputs)
        if isinstance(scaled, torch.Tensor):
            self._last_scaled = weakref.ref(scaled)
        if self._awaiting:
            scale = self.current()
            for record in self._awaiting:
                record.loss_scale = scale
            self._awaiting = []
        return scaled

    def _update(self, new_scale: Any = None) -> Any:
        self._on_update(self.found_inf())
        return self._original_update(new_scale)
