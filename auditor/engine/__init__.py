"""The aggregation: the shards' records as one row per (run, group, term, step), by DuckDB (`Engine`).

`sql` writes what a step row is; `ranges` cuts a large log into step ranges; `tables` joins the ranges'
arrays.
"""

from tokaudit.engine.database import DEFAULT_MEMORY_LIMIT, Engine, extremes_at, settings_from_environment
from tokaudit.engine.ranges import CHUNK_ROWS, CHUNK_STEPS, step_ranges
from tokaudit.engine.sql import EXTREME_COLUMNS, INTEGER_COLUMNS, RANK_BITS_LIMIT, footer_facts, step_sql
from tokaudit.engine.tables import SPILL_STEPS, Duplicates, Spilled, one_value, sweep_scratch

__all__ = ["CHUNK_ROWS", "CHUNK_STEPS", "DEFAULT_MEMORY_LIMIT", "Duplicates", "EXTREME_COLUMNS", "Engine", "INTEGER_COLUMNS",
           "RANK_BITS_LIMIT", "SPILL_STEPS", "Spilled", "extremes_at", "footer_facts", "one_value",
           "settings_from_environment", "step_ranges", "step_sql", "sweep_scratch"]
