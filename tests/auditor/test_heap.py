"""The command line's heap keeps the blocks numpy frees (`tokaudit.heap`); a library caller's is left alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import tokaudit.heap as heap
from tests.logs import UNEVEN_GA, records, token_mean, write_by_rank

_CYCLES = """
import resource, sys
import numpy as np
if sys.argv[1] == "keep":
    from tokaudit.heap import keep_large_blocks
    assert keep_large_blocks()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(2):
    before = faults()
    for _ in range(10):
        held = [np.ones(1 << 18) for _ in range(20)]  # 20 arrays of 2 MiB alive at once, as a grid's block
        del held
    counts.append(faults() - before)
print(counts[-1])
"""


@pytest.mark.skipif(heap._glibc() is None, reason="glibc's malloc only")
def test_kept_blocks_are_not_mapped_again_at_each_allocation() -> None:
    """The mechanism: arrays of 2 MiB allocated and freed again and again each cost 512 page faults (a
    mapped page is zeroed when first written) under glibc's defaults, and none once the heap keeps them."""
    def faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", _CYCLES, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.split()[-1])

    default, kept = faults("default"), faults("keep")
    assert default > 10 * 20 * 256  # at least half the pages of every array mapped again
    assert kept < default / 20, (kept, default)


def test_the_command_line_keeps_large_blocks_and_a_library_caller_s_heap_is_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokaudit` (its own process) sets the heap up; `tokaudit.audit` in someone's training process does not;
    a MALLOC_* variable the user set is left to rule."""
    from tokaudit import audit
    from tokaudit.cli import main

    log = write_by_rank(tmp_path / "run", records(UNEVEN_GA, token_mean))
    calls: list[Any] = []
    monkeypatch.setattr(heap, "keep_large_blocks", lambda: calls.append(True) or True)
    audit([log])
    assert calls == []
    assert CliRunner().invoke(main, ["check", str(log)]).exit_code == 0
    assert calls == [True]
    monkeypatch.undo()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert heap.keep_large_blocks() is False
