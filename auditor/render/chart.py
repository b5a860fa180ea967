"""A plain-text line chart for the terminal (no dependency), several series on shared axes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

MARKS = "●○◆▲"
SHARED = "✱"


def line_chart(x: Sequence[float] | npt.ArrayLike, series: dict[str, Sequence[float | None] | npt.ArrayLike],
               width: int = 64, height: int = 14) -> str:
    """Plot each series with its own mark; where several fall on one cell, the shared mark ✱. Columns
    of numbers (None or NaN: no point), placed a whole series at a time: a curve of millions of steps
    costs a few array operations, not a Python step per point."""
    xs = np.asarray(x, dtype=np.float64)
    columns = [np.asarray(ys, dtype=np.float64) for ys in series.values()]
    finite = [np.isfinite(ys) for ys in columns]
    if not len(xs) or not any(mask.any() for mask in finite):
        return "(nothing to plot)"
    low = float(min(ys[mask].min() for ys, mask in zip(columns, finite) if mask.any()))
    high = float(max(ys[mask].max() for ys, mask in zip(columns, finite) if mask.any()))
    if high == low:
        low, high = low - 0.5, high + 0.5
    x_low, x_high = float(xs.min()), float(xs.max())
    grid = [[" "] * width for _ in range(height)]
    owners: dict[tuple[int, int], set[int]] = {}
    for index, (ys, mask) in enumerate(zip(columns, finite)):
        # the cell of each point, rounded half to even as Python's round()
        column = np.zeros(int(mask.sum()), dtype=np.int64) if x_high == x_low else \
            np.round((xs[mask] - x_low) / (x_high - x_low) * (width - 1)).astype(np.int64)
        line = height - 1 - np.round((ys[mask] - low) / (high - low) * (height - 1)).astype(np.int64)
        for cell in np.unique(line * width + column).tolist():
            owners.setdefault(divmod(cell, width), set()).add(index)
    for (line_index, column_index), indices in owners.items():
        # Where series coincide every one of them is there: a shared mark says so.
        grid[line_index][column_index] = MARKS[min(indices) % len(MARKS)] if len(indices) == 1 else SHARED
    label_width = max(len(f"{high:.4g}"), len(f"{low:.4g}"))
    lines = []
    for row_index, cells in enumerate(grid):
        label = f"{high:.4g}" if row_index == 0 else f"{low:.4g}" if row_index == height - 1 else ""
        lines.append(f"{label:>{label_width}} ┤{''.join(cells)}")
    lines.append(" " * label_width + " └" + "─" * width)
    x_labels = f"{x_low:g}".ljust(width - len(f"{x_high:g}")) + f"{x_high:g}"
    lines.append(" " * (label_width + 2) + x_labels + "  (step)")
    legend = "   ".join(f"{MARKS[i % len(MARKS)]} {name}" for i, name in enumerate(series))
    if any(len(indices) > 1 for indices in owners.values()):
        legend += "\n" + " " * (label_width + 2) + f"{SHARED} several series at one point"
    lines.append(" " * (label_width + 2) + legend)
    return "\n".join(lines)
