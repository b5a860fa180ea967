"""The C heap of the auditing process (glibc's malloc): its free pages handed back, and its large blocks kept."""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameters (malloc.h)."""
MMAP_BYTES = 16 << 20
"""Blocks of at least this size are mapped from the system each time (glibc's default: 128 KiB, raised
as blocks are freed)."""
TRIM_BYTES = 64 << 20
"""Free memory at the top of the heap past which it is handed back to the system."""


def trim_heap() -> None:
    """glibc's malloc_trim(0): give the heap's free pages back to the system. Nothing elsewhere."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def keep_large_blocks() -> bool:
    """For the command line's own process: blocks of up to MMAP_BYTES (a grid's arrays of 2¹⁸ values, 2 MiB)
    come from the heap and go back to it, not mapped from the system and unmapped at each free, and the
    heap keeps up to TRIM_BYTES free at its top. A freshly mapped page costs a fault and zeroing when first
    written: a grid's block of 2¹⁸ records took 22 ms, 5,820 page faults, and takes 8.6 ms with none; the
    10⁸-row audit 20.5 → 15.3 s (808,000 → 121,000 faults), its peak unchanged, 12.5M steps 669 → 687 MiB.
    Left as they are where a MALLOC_* variable tunes them, off glibc, and in a library caller's process
    (`tokaudit.audit` in a training process: its heap is its own). True where set."""
    libc = _glibc()
    if libc is None or "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))


@functools.cache
def _glibc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None
