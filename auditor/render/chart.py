"""A plain-text line chart for the terminal (no dependency), several series on shared axes."""

from __future__ import annotations

import math
from collections.abc import Sequence

MARKS = "●○◆▲"
SHARED = "✱"


def line_chart(x: Sequence[float], series: dict[str, Sequence[float | None]], width: int = 64,
               height: int = 14) -> str:
    """Plot each series with its own mark; where several fall on one cell, the shared mark ✱."""
    values = [v for ys in series.values() for v in ys if v is not None and math.isfinite(v)]
    if not x or not values:
        return "(nothing to plot)"
    low, high = min(values), max(values)
    if high == low:
        low, high = low - 0.5, high + 0.5
    x_low, x_high = min(x), max(x)
    grid = [[" "] * width for _ in range(height)]
    owners: dict[tuple[int, int], set[int]] = {}
    for index, ys in enumerate(series.values()):
        for xv, yv in zip(x, ys):
            if yv is None or not math.isfinite(yv):
                continue
            column = 0 if x_high == x_low else round((xv - x_low) / (x_high - x_low) * (width - 1))
            line = height - 1 - round((yv - low) / (high - low) * (height - 1))
            owners.setdefault((line, column), set()).add(index)
    for (line, column), indices in owners.items():
        # Where series coincide every one of them is there: a shared mark says so.
        grid[line][column] = MARKS[min(indices) % len(MARKS)] if len(indices) == 1 else SHARED
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
