"""Checks over the per-step table: each problem becomes one finding with its numbers and its fix.

Pure functions of the step table (one row per run, group, term and step): no Parquet, no DuckDB. How the
normalization is recovered lives in `tokaudit.normalization`; each concern here is a module of its own.
"""

from tokaudit.checks.base import DENOMINATOR_WORDS, RunContext, RunSteps, distinct, loss_terms, main_term_first, weight_ratio, world_sizes
from tokaudit.checks.miscount import Miscounted, miscounted_rows, outside_probe_range, without_miscounted
from tokaudit.checks.objective import OneObjective, one_objective
from tokaudit.checks.reported import decimals
from tokaudit.checks.run import check_run

__all__ = ["DENOMINATOR_WORDS", "Miscounted", "RunContext", "RunSteps", "check_run", "decimals", "distinct",
           "loss_terms", "main_term_first", "miscounted_rows", "one_objective", "OneObjective", "outside_probe_range", "weight_ratio", "without_miscounted", "world_sizes"]
