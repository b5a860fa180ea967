"""What the HTML report draws beside its findings: per run, a rank × step heat-map of q = e·N and the loss
curves (`tokaudit._postmortem.Curve`), each bounded in size whatever the log's: a cell is a span of ranks and
steps, a curve keeps the envelope of its steps (`postmortem.envelope`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._auditing import AuditedLog
from tokaudit._engine import Engine, Spilled
from tokaudit._postmortem import envelope, run_curve

HEAT_ROWS = 64
"""Rank rows of a heat-map at most: a larger group's ranks share rows."""
HEAT_COLUMNS = 160
"""Step columns at most: a longer run's steps share columns."""
CURVE_BUCKETS = 300
"""Step buckets of a drawn curve: each keeps its first, last, lowest and highest point."""


@dataclass
class RunFigures:
    """One run's figures."""

    heat: pd.DataFrame
    """Per cell: row, col, rank_first, rank_last, step_first, step_last, q_low, q_high (`Engine.rank_weights`)."""
    curves: list[tuple[str, npt.NDArray[np.float64], npt.NDArray[np.float64]]] = field(default_factory=list)
    """(label, steps, values) of each series that has a value."""


def run_figures(log: AuditedLog, runs: Sequence[str], pooled: Sequence[str] = ()) -> dict[str, RunFigures]:
    """The figures of `runs` (as the audit named them) from what the audit read (`auditing.audit_started`'s `then`): the curves
    from its step table, the heat-map from the records, read once more (what it draws is per rank, which the step
    table does not hold), with the repeated keys the audit left out left out again. `pooled`: the runs whose
    terms are one token mean (`RunSummary.terms_pooled`), whose q counts N over every term."""
    # the repeated keys as the audit's own engine found them: the same records left out
    engine = Engine.open(log.shards, duplicates=log.duplicates)
    try:
        heat = engine.rank_weights(HEAT_ROWS, HEAT_COLUMNS, pooled)
    finally:
        engine.close()
    names = heat.run.astype(str)
    return {
        run: RunFigures(heat[(names == run).to_numpy()].reset_index(drop=True), _curves(log.steps, run, run in pooled))
        for run in runs
    }


def _curves(
    steps: pd.DataFrame | Spilled, run: str, pooled: bool
) -> list[tuple[str, npt.NDArray[np.float64], npt.NDArray[np.float64]]]:
    curve = run_curve(steps, run, pooled)
    parts = list(curve.parts())
    if not parts:
        return []
    rows = pd.concat(parts, ignore_index=True)
    x = rows.step.to_numpy(dtype=np.float64)
    span = (float(x.min()), float(x.max()))
    drawn = []
    for key, label in curve.labels():
        ys = rows[key].to_numpy(dtype=np.float64, na_value=np.nan)
        if np.isfinite(ys).any():
            drawn.append((label, *envelope(x, ys, span, CURVE_BUCKETS)))
    return drawn
