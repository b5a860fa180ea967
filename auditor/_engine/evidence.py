"""One step's evidence, by an engine of its own (`extremes_at`)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from tokaudit._engine.columns import EVIDENCE
from tokaudit._engine.database import Engine
from tokaudit._reader import Shard


def extremes_at(shards: Sequence[Shard], step: int, threads: int | None = None) -> pd.DataFrame:
    """The EVIDENCE columns of one step, a row per (run, grp, term): the step aggregated again, alone, from the
    files whose footers say they can hold it, with the evidence aggregates the full query leaves out.
    The same records (deduplicated the same way) in the same aggregation as the full query's."""
    engine = Engine.open(
        [s for s in shards if s.may_hold(step, step)], threads=threads, only_steps=(step, step), extremes=True
    )
    try:
        table = engine.step_table()
    finally:
        engine.close()
    return table[["run", "grp", "term", "step", *EVIDENCE]]
