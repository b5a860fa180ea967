"""Test-session wiring: the tests under tests/distributed/ (real DDP jobs, trainers, a local S3 server) run one
after the other on one pytest-xdist worker, so that two multi-process jobs never share the two cores and their
session fixtures are made once; every other test goes to whichever worker is free."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

import pytest

# Recorders stay quiet in the suite (their start and close lines, and the close's audit, cost hundreds of audits);
# tests/hooks/test_trackers.py turns them on where it checks them. Worker processes inherit it.
os.environ.setdefault("TOKAUDIT_QUIET", "1")
# One OpenMP thread a process: two xdist workers and their jobs already fill the cores, and an idle OpenMP team
# spins, taking CPU from the other worker. The DDP jobs set the same (scenarios/harness.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# What a recorder cannot write goes to a spool of the session's own, not the user's ~/.cache/tokaudit/spool (the
# tests of unwritable folders spool shards there); worker processes and jobs inherit it.
if "TOKAUDIT_SPOOL" not in os.environ:
    os.environ["TOKAUDIT_SPOOL"] = tempfile.mkdtemp(prefix="tokaudit-test-spool-")
    atexit.register(shutil.rmtree, os.environ["TOKAUDIT_SPOOL"], True)

SERIAL = "tests/distributed/"

pytest_plugins = ["tests.needs"]  # skips for a missing package fail `make test` (tests/needs.py)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The serial tests first (the longest scope starts at once, while the other worker takes the rest); a test
    that starts processes belongs under tests/distributed/, where the scheduler keeps them apart."""
    for item in items:
        if item.get_closest_marker("distributed") and not item.nodeid.startswith(SERIAL):
            raise pytest.UsageError(f"{item.nodeid} is marked distributed: move it under {SERIAL}")
    items.sort(key=lambda item: not item.nodeid.startswith(SERIAL))  # stable: each part keeps its order


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class SerialDistributed(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's load scheduling, with every test under tests/distributed/ one scope (one worker, in order)."""

        def _split_scope(self, nodeid: str) -> str:
            return SERIAL if nodeid.startswith(SERIAL) else nodeid

    return SerialDistributed(config, log)
