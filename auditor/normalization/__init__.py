"""Normalization recovery: which denominator and which factor explain each step's weights.

Pure functions of the per-step table (one row per run, group, term and step); no Parquet, no DuckDB.
The one entry point is `Decisions`: the run's decisions from two passes over the step table's blocks
(`Decisions.of`), then any block's diagnoses (`Decisions.diagnose`), which is how the checks read them.
"""

from tokaudit.normalization.vocabulary import DENOMINATOR_FACTS, DenominatorFacts, LOCAL_DENOMINATORS, Floats, Denominator, StepKind, FactorKind, FORMULA, PREFERENCE, RECORD_BOUNDS, APPROXIMATE_SPREAD, APPROXIMATE_MARGIN, RESOLVABLE, MAX_WORLD_SIZE, LOSS_SCALE_MIN_EXPONENT, StepDiagnosis, FactorExplanation, KINDS, DENOMINATORS, Diagnoses
from tokaudit.normalization.fits import spread, close, cluster, ClusterStarts, float_column, candidate_bounds, BLOCK_STEPS, FitBlock, clusters_of, block_fits, Confusion, nearest_fit
from tokaudit.normalization.decisions import Decisions
from tokaudit.normalization.factors import resolvable_integer, power_of_two, explain_factor
from tokaudit.normalization.spans import Span, MAX_SPANS, SPAN_BLOCK, segments, span_rows, name_ranks, Spans

__all__ = ["APPROXIMATE_MARGIN", "APPROXIMATE_SPREAD", "BLOCK_STEPS", "ClusterStarts", "Confusion", "DENOMINATORS", "DENOMINATOR_FACTS", "DenominatorFacts", "Decisions", "Denominator", "Diagnoses", "FORMULA", "FactorExplanation", "FactorKind", "FitBlock", "Floats", "KINDS", "LOCAL_DENOMINATORS", "LOSS_SCALE_MIN_EXPONENT", "MAX_SPANS", "MAX_WORLD_SIZE", "PREFERENCE", "RECORD_BOUNDS", "RESOLVABLE", "SPAN_BLOCK", "Span", "Spans", "StepDiagnosis", "StepKind", "block_fits", "candidate_bounds", "close", "cluster", "clusters_of", "explain_factor", "float_column", "name_ranks", "nearest_fit", "power_of_two", "resolvable_integer", "segments", "span_rows", "spread"]
