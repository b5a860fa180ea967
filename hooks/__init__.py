"""Recording hooks for PyTorch training loops (needs torch)."""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as error:  # the auditor needs no torch; recording does
    raise ImportError(
        "tokaudit.hooks records training runs and needs torch: install the torch build you train "
        "with (or pip install '.[hooks]' from a clone of tokaudit)"
    ) from error

from tokaudit.hooks._fix import global_valid_tokens, is_empty_update, reported_token_mean, token_mean_loss
from tokaudit.hooks._recorder import Recorder

__all__ = ["Recorder", "global_valid_tokens", "is_empty_update", "reported_token_mean", "token_mean_loss"]
