"""The aggregation: the shards' records as one row per (run, group, term, step), by DuckDB (`Engine`).

`columns` declares what a step row is; `sql` writes the query of each log shape from it; `ranges` cuts a large
log into step ranges; `stream` reads a segment no range may cut in windows of whole steps; `tables` joins the
ranges' arrays; `evidence` aggregates one step again for a finding's evidence; `watch` says how far it is.
"""

from tokaudit._engine.columns import EVIDENCE, STEP_COLUMNS
from tokaudit._engine.evidence import extremes_at
from tokaudit._engine.database import Engine, aggregate_range
from tokaudit._engine.ranges import CHUNK_ROWS, RangeTask, step_ranges
from tokaudit._engine.sql import step_sql
from tokaudit._engine.tables import FILES_NAMED, Duplicates, Spilled, one_value, rounded_precision, sweep_scratch
from tokaudit._engine.watch import Aggregating

__all__ = [
    "Aggregating",
    "aggregate_range",
    "CHUNK_ROWS",
    "Duplicates",
    "Engine",
    "EVIDENCE",
    "extremes_at",
    "FILES_NAMED",
    "one_value",
    "RangeTask",
    "rounded_precision",
    "Spilled",
    "STEP_COLUMNS",
    "step_ranges",
    "step_sql",
    "sweep_scratch",
]
