"""Checks over the per-step table: each problem becomes one finding with its numbers and its fix.

Pure functions of the step table (one row per run, group, term and step): no Parquet, no DuckDB. How the
normalization is recovered lives in `tokaudit._normalization`; each concern here is a module of its own.
"""

from tokaudit._checks.base import RunSteps, cannot_tell, distinct, grouped, rank_masks
from tokaudit._checks.base import PARTIAL_UPDATE_FACTORS, run_finding, weight_ratio, world_sizes
from tokaudit._checks.duplicates import WEIGHED_WRONG, Replaced, with_replaced
from tokaudit._checks.miscount import miscounted_rows, outside_probe_range, without_miscounted
from tokaudit._checks.objective import one_objective, pooled_steps, pooled_sums
from tokaudit._checks.run import check_run
from tokaudit._checks.terms import Held, group_records, loss_terms, main_term_first, main_term_known, over_groups
from tokaudit._checks.terms import term_records, terms_of, whole_run
from tokaudit._checks.split_runs import with_other_ranks
from tokaudit._checks.sync import Ending
from tokaudit._checks.unread import with_unread_files

__all__ = [
    "Ending",
    "PARTIAL_UPDATE_FACTORS",
    "cannot_tell",
    "check_run",
    "distinct",
    "group_records",
    "Held",
    "grouped",
    "loss_terms",
    "main_term_first",
    "main_term_known",
    "miscounted_rows",
    "one_objective",
    "outside_probe_range",
    "over_groups",
    "pooled_steps",
    "pooled_sums",
    "rank_masks",
    "Replaced",
    "WEIGHED_WRONG",
    "run_finding",
    "term_records",
    "terms_of",
    "RunSteps",
    "weight_ratio",
    "with_other_ranks",
    "with_replaced",
    "whole_run",
    "with_unread_files",
    "without_miscounted",
    "world_sizes",
]
