"""Skip markers for optional packages, found without importing them: `pytest.importorskip` imports at
collection, in every xdist worker, which costs seconds for a trainer package (lightning, accelerate)."""

from __future__ import annotations

import importlib.util

import pytest


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip where any of `modules` is not installed."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")
