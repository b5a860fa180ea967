"""What `tokaudit curve` shows of a run's loss curve: the terminal's chart, its table's rows and `--plot`'s points."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit.errors import UsageError
from tokaudit._postmortem import CURVE_KEYS, CURVE_LABELS, Curve, envelope
from tokaudit._render.chart import LineChart


TABLE_STEPS = 40
"""Steps the terminal's table shows at most, about: every k-th step of the curve, k = steps // 40."""
PLOT_STEPS = 100_000
"""Steps up to which `--plot` draws every point; a longer curve draws each series' envelope (`envelope`)."""


@dataclass
class CurveViews:
    """What `tokaudit curve` shows of a curve, made in two passes over its parts (`curve_views`): each
    bounded, whatever the number of steps."""

    steps: int
    """The curve's steps."""
    chart: LineChart
    """The terminal's chart of the series that have a value."""
    shown: pd.DataFrame
    """The table's rows: every step of a curve of at most TABLE_STEPS (about), else every k-th."""
    points: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]]
    """Per series that has a value, by key: the (step, value) points `--plot` draws (none without it)."""


def curve_views(
    curve: Curve, labels: Sequence[tuple[str, str]], csv_path: Path | None = None, width: int = 64, plot: bool = False
) -> CurveViews:
    """The curve's views, its parts read twice: first the CSV (every step, a part at a time), the steps,
    the axes' ranges and which series have a value; then the chart's cells, the table's rows and the
    plot's points. `labels`: (key, label) of each series, in the chart's order."""
    keys = [key for key, _ in labels]
    chart = LineChart([], width)
    steps = 0
    present: set[str] = set()
    try:
        out = open(csv_path, "w", encoding="utf-8", newline="") if csv_path is not None else None
    except OSError as error:
        raise UsageError(f"{csv_path}: cannot write the CSV ({error.strerror or error})") from None
    try:
        for part in curve.parts():
            if out is not None:
                part.to_csv(out, index=False, header=steps == 0)
            steps += len(part)
            present.update(key for key in keys if part[key].notna().any())
            chart.extent(part.step.to_numpy(dtype=np.float64), [_values(part, key) for key in keys])
        if out is not None and steps == 0:
            pd.DataFrame({key: [] for key in (*CURVE_KEYS, *keys[len(CURVE_LABELS) :])}).to_csv(out, index=False)
        if out is not None:
            out.close()  # the last of the CSV is written here: a full disk says so here
    except OSError as error:
        raise UsageError(f"{csv_path}: cannot write the CSV ({error.strerror or error})") from None
    finally:
        if out is not None:
            with contextlib.suppress(OSError):  # (closed already, or failing: said above)
                out.close()
    drawn = [key for key in keys if key in present]
    chart.names = [label for key, label in labels if key in present]
    stride = max(1, steps // TABLE_STEPS) if steps > TABLE_STEPS else 1
    every = steps <= PLOT_STEPS
    shown: list[pd.DataFrame] = []
    points: dict[str, list[tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]]] = {key: [] for key in drawn}
    offset = 0
    for part in curve.parts():
        x = part.step.to_numpy(dtype=np.float64)
        columns = [_values(part, key) for key in drawn]
        chart.place(x, columns)
        # the table's rows: the curve's positions 0, k, 2k, …
        shown.append(part[(np.arange(offset, offset + len(part)) % stride) == 0])
        offset += len(part)
        if plot:
            for key, ys in zip(drawn, columns):
                points[key].append((x, ys) if every else envelope(x, ys, (chart.x_low, chart.x_high)))
    return CurveViews(
        steps=steps,
        chart=chart,
        shown=pd.concat(shown, ignore_index=True) if shown else pd.DataFrame({k: [] for k in CURVE_KEYS}),
        points={
            key: (np.concatenate([x for x, _ in held]), np.concatenate([y for _, y in held]))
            for key, held in points.items()
            if held
        },
    )


def _values(part: pd.DataFrame, key: str) -> npt.NDArray[np.float64]:
    values: npt.NDArray[np.float64] = part[key].to_numpy(dtype=np.float64, na_value=np.nan)
    return values
