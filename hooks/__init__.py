"""Recording hooks for PyTorch training loops (needs torch)."""

from __future__ import annotations

from tokaudit.hooks.recorder import Recorder

__all__ = ["Recorder"]
