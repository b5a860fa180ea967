"""A plain-text line chart for the terminal (no dependency), several series on shared axes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

MARKS = "●○◆▲"
SHARED = "✱"


class LineChart:
    """A chart drawn from its points a batch at a time, in two passes over the same batches: `extent`
    (the axes' ranges) over every batch, then `place` (the cell of each point) over every batch again.
    What it holds is the cells, whatever the number of points: a curve of millions of steps is drawn
    from a step table read a part at a time (`tokaudit curve`)."""

    def __init__(self, names: Sequence[str], width: int = 64, height: int = 14) -> None:
        self.names = list(names)
        self.width, self.height = width, height
        self.x_low, self.x_high = np.inf, -np.inf
        self.low, self.high = np.inf, -np.inf
        self.owners: dict[tuple[int, int], set[int]] = {}

    def extent(self, x: npt.NDArray[np.float64], columns: Sequence[npt.NDArray[np.float64]]) -> None:
        """The ranges, over every x and every finite point of a series (None or NaN: no point)."""
        if len(x):
            self.x_low, self.x_high = min(self.x_low, float(x.min())), max(self.x_high, float(x.max()))
        for ys in columns:
            finite = ys[np.isfinite(ys)]
            if len(finite):
                self.low, self.high = min(self.low, float(finite.min())), max(self.high, float(finite.max()))

    def _axes(self) -> tuple[float, float]:
        return (self.low - 0.5, self.high + 0.5) if self.high == self.low else (self.low, self.high)

    def place(self, x: npt.NDArray[np.float64], columns: Sequence[npt.NDArray[np.float64]]) -> None:
        """The cells of these points, under the ranges `extent` found over every batch: a whole series at
        a time, a few array operations, not a Python step per point."""
        if self.low > self.high:
            return
        low, high = self._axes()
        width, height = self.width, self.height
        for index, ys in enumerate(columns):
            mask = np.isfinite(ys)
            # the cell of each point, rounded half to even as Python's round()
            column = (
                np.zeros(int(mask.sum()), dtype=np.int64)
                if self.x_high == self.x_low
                else np.round((x[mask] - self.x_low) / (self.x_high - self.x_low) * (width - 1)).astype(np.int64)
            )
            line = height - 1 - np.round((ys[mask] - low) / (high - low) * (height - 1)).astype(np.int64)
            for cell in np.unique(line * width + column).tolist():
                self.owners.setdefault(divmod(cell, width), set()).add(index)

    def render(self) -> str:
        if self.low > self.high or self.x_low > self.x_high:
            return "(nothing to plot)"
        low, high = self._axes()
        width, height = self.width, self.height
        grid = [[" "] * width for _ in range(height)]
        for (line_index, column_index), indices in self.owners.items():
            # Where series coincide every one of them is there: a shared mark says so.
            grid[line_index][column_index] = MARKS[min(indices) % len(MARKS)] if len(indices) == 1 else SHARED
        label_width = max(len(f"{high:.4g}"), len(f"{low:.4g}"))
        lines = []
        for row_index, cells in enumerate(grid):
            label = f"{high:.4g}" if row_index == 0 else f"{low:.4g}" if row_index == height - 1 else ""
            lines.append(f"{label:>{label_width}} ┤{''.join(cells)}")
        lines.append(" " * label_width + " └" + "─" * width)
        x_labels = f"{self.x_low:g}".ljust(width - len(f"{self.x_high:g}")) + f"{self.x_high:g}"
        lines.append(" " * (label_width + 2) + x_labels + "  (step)")
        legend = "   ".join(f"{MARKS[i % len(MARKS)]} {name}" for i, name in enumerate(self.names))
        if any(len(indices) > 1 for indices in self.owners.values()):
            legend += "\n" + " " * (label_width + 2) + f"{SHARED} several series at one point"
        lines.append(" " * (label_width + 2) + legend)
        return "\n".join(lines)


def line_chart(
    x: Sequence[float] | npt.ArrayLike,
    series: dict[str, Sequence[float | None] | npt.ArrayLike],
    width: int = 64,
    height: int = 14,
) -> str:
    """Plot each series with its own mark; where several fall on one cell, the shared mark ✱. Columns
    of numbers (None or NaN: no point): `LineChart` over one batch."""
    xs = np.asarray(x, dtype=np.float64)
    columns = [np.asarray(ys, dtype=np.float64) for ys in series.values()]
    chart = LineChart(list(series), width, height)
    chart.extent(xs, columns)
    chart.place(xs, columns)
    return chart.render()
