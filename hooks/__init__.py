"""Recording hooks for PyTorch training loops (needs torch)."""

from __future__ import annotations

from tokaudit.hooks.fix import global_valid_tokens, is_empty_update, reported_token_mean, token_mean_loss
from tokaudit.hooks.recorder import Recorder

__all__ = ["Recorder", "global_valid_tokens", "is_empty_update", "reported_token_mean", "token_mean_loss"]
