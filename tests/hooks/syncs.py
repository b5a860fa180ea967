"""Count the tensor methods that copy a device value to the host (a sync on a GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

HOST_COPIES = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


def count_host_syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patch every host copy to note its name in the returned list (until monkeypatch.undo())."""
    calls: list[str] = []
    for name in HOST_COPIES:
        original = getattr(torch.Tensor, name)

        def counting(self: torch.Tensor, *args: Any, _name: str = name, _original: Any = original) -> Any:
            calls.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return calls
