"""A column of numbers read back in ascending order without holding it whole: exact medians and clusters
of a column of any length (the vote's α of a candidate, the uniform factors q, the q of steps whose
divisor is unknown).

Values are kept in memory up to RUN_VALUES; past that, each RUN_VALUES of them are sorted and written to a
temporary file as a sorted run, and reading back merges the runs a bounded buffer at a time.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from tokaudit.errors import UsageError

Floats = npt.NDArray[np.float64]
Keys = npt.NDArray[np.int64]

RUN_VALUES = 1 << 20
"""Values sorted in memory at a time (8 MB, as many again for their keys)."""
MERGE_VALUES = 1 << 21
"""Values the merge reads ahead, all runs together."""


class SortedColumn:
    """Values, each with an integer key, added in order (NaN counted apart and not kept); read back sorted
    by value (`chunks`), equal values in the order they came but for equal values that meet at a merge's
    frontier (only the sign of a zero could tell them apart)."""

    def __init__(self) -> None:
        self.held: list[tuple[Floats, Keys]] = []
        self.held_count = 0
        self.runs: list[tuple[int, int]] = []
        """(first value, values) of each sorted run in the files."""
        self.files: tuple[Any, Any] | None = None
        self.keyed: bool | None = None
        """Whether values come with keys (set by the first `add`)."""
        self.count = 0
        self.nan = 0
        self.low = math.inf
        self.high = -math.inf

    def add(self, values: Floats, keys: Keys | None = None) -> None:
        nan = np.isnan(values)
        self.nan += int(nan.sum())
        finite = np.ascontiguousarray(values[~nan], dtype=np.float64)
        if not len(finite):
            return
        # a column without keys holds none: they read back as zeros
        if self.keyed is None:
            self.keyed = keys is not None
        if self.keyed != (keys is not None):
            raise ValueError("a column's values come with keys every time or never")
        kept = _NO_KEYS if keys is None else np.ascontiguousarray(np.asarray(keys, dtype=np.int64)[~nan])
        self.held.append((finite, kept))
        self.held_count += len(finite)
        self.count += len(finite)
        self.low, self.high = min(self.low, float(finite.min())), max(self.high, float(finite.max()))
        if self.held_count >= RUN_VALUES:
            self._write_run()

    @property
    def spilled(self) -> bool:
        return bool(self.runs)

    def in_order(self) -> tuple[Floats, Keys]:
        """Every value held (never written to a run) with its key, in the order they came."""
        assert not self.runs
        if not self.held:
            return np.zeros(0), np.zeros(0, dtype=np.int64)
        values = np.concatenate([v for v, _ in self.held]) if len(self.held) > 1 else self.held[0][0].copy()
        return values, self._keys(len(values))

    def _keys(self, count: int) -> Keys:
        if not self.keyed:
            return np.zeros(count, dtype=np.int64)
        return np.concatenate([k for _, k in self.held]) if len(self.held) > 1 else self.held[0][1].copy()

    def _write_run(self) -> None:
        values = np.concatenate([v for v, _ in self.held])
        keys = self._keys(len(values))
        self.held, self.held_count = [], 0
        order = np.argsort(values, kind="stable")
        try:
            if self.files is None:
                self.files = (
                    tempfile.TemporaryFile(prefix="tokaudit-sorted-"),
                    tempfile.TemporaryFile(prefix="tokaudit-sorted-"),
                )
            first = sum(length for _, length in self.runs)
            values[order].tofile(self.files[0])
            keys[order].tofile(self.files[1])
        except OSError as error:
            raise UsageError(
                f"cannot sort this log's columns on disk ({error.strerror or error}: "
                f"{tempfile.gettempdir()}): free space there or set TMPDIR to a folder that has it"
            ) from None
        self.runs.append((first, len(values)))

    def chunks(self) -> Iterator[tuple[Floats, Keys]]:
        """Every value and its key, ascending by value, a bounded chunk at a time."""
        if not self.runs:
            values, keys = self.in_order()
            order = np.argsort(values, kind="stable")
            yield values[order], keys[order]
            return
        if self.held:
            self._write_run()
        assert self.files is not None
        for file in self.files:
            file.flush()
        ahead = max(1, MERGE_VALUES // len(self.runs))
        position = [first for first, _ in self.runs]
        end = [first + length for first, length in self.runs]
        buffers: list[tuple[Floats, Keys]] = [(np.zeros(0), np.zeros(0, dtype=np.int64)) for _ in self.runs]
        while True:
            for run, (values, _) in enumerate(buffers):
                if not len(values) and position[run] < end[run]:
                    count = min(ahead, end[run] - position[run])
                    buffers[run] = (
                        _read(self.files[0], np.float64, position[run], count),
                        _read(self.files[1], np.int64, position[run], count),
                    )
                    position[run] += count
            live = [run for run, (values, _) in enumerate(buffers) if len(values)]
            if not live:
                return
            # Every value up to the smallest last value of a run that has more to read is final.
            pending = [float(buffers[run][0][-1]) for run in live if position[run] < end[run]]
            frontier = min(pending) if pending else math.inf
            taken_values, taken_keys = [], []
            for run in live:
                values, keys = buffers[run]
                cut = int(np.searchsorted(values, frontier, side="right"))
                taken_values.append(values[:cut])
                taken_keys.append(keys[:cut])
                buffers[run] = (values[cut:], keys[cut:])
            values, keys = np.concatenate(taken_values), np.concatenate(taken_keys)
            order = np.argsort(values, kind="stable")  # runs in the order they came: equal values stay so
            yield values[order], keys[order]

    def close(self) -> None:
        if self.files is not None:
            for file in self.files:
                file.close()
        self.files, self.held, self.runs = None, [], []


_NO_KEYS: Keys = np.zeros(0, dtype=np.int64)
"""What a column added without keys holds in their place."""


def _read(file: Any, dtype: Any, first: int, count: int) -> Any:
    file.seek(first * np.dtype(dtype).itemsize)
    return np.fromfile(file, dtype=dtype, count=count)


def at_positions(column: SortedColumn, positions: list[int]) -> list[float]:
    """The values at these positions of the column in ascending order (positions ascending)."""
    found: list[float] = []
    seen = 0
    wanted = iter(positions)
    target = next(wanted, None)
    for values, _ in column.chunks():
        while target is not None and target < seen + len(values):
            found.append(float(values[target - seen]))
            target = next(wanted, None)
        seen += len(values)
        if target is None:
            break
    return found


def middle(values: list[float]) -> float:
    """The median from the middle value, or the middle two (their mean, as np.median computes it)."""
    return values[0] if len(values) == 1 else float((values[0] + values[1]) / 2)


def middle_positions(start: int, count: int) -> list[int]:
    """Where the median of `count` sorted values starting at `start` is read: the middle one, or two."""
    half = start + count // 2
    return [half] if count % 2 else [half - 1, half]
