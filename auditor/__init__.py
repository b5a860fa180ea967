"""tokaudit: audit how distributed training normalized its token losses."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
