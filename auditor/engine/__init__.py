"""The aggregation: the shards' records as one row per (run, group, term, step), by DuckDB (`Engine`).

`columns` declares what a step row is; `sql` writes the query of each log shape from it; `ranges` cuts a large
log into step ranges; `tables` joins the ranges' arrays.
"""

from tokaudit.engine.columns import EVIDENCE, STEP_COLUMNS
from tokaudit.engine.connection import DEFAULT_MEMORY_LIMIT, settings_from_environment
from tokaudit.engine.database import Engine, aggregate_range, extremes_at
from tokaudit.engine.ranges import CHUNK_ROWS, CHUNK_STEPS, RangesMap, RangeTask, step_ranges
from tokaudit.engine.sql import step_sql
from tokaudit.engine.tables import SPILL_STEPS, Duplicates, Spilled, one_value, sweep_scratch

__all__ = ["CHUNK_ROWS", "CHUNK_STEPS", "DEFAULT_MEMORY_LIMIT", "Duplicates", "EVIDENCE", "Engine", "RangeTask", "RangesMap",
           "SPILL_STEPS", "STEP_COLUMNS", "Spilled", "aggregate_range", "extremes_at", "one_value",
           "settings_from_environment", "step_ranges", "step_sql", "sweep_scratch"]
