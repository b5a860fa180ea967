"""Normalization recovery: which denominator and which factor explain each step's weights.

Pure functions of the per-step table (one row per run, group, term and step); no Parquet, no DuckDB.
The one entry point is `Decisions`: the run's decisions from two passes over the step table's blocks
(`Decisions.of`), then any block's diagnoses (`Decisions.diagnose`), which is how the checks read them.
"""

from tokaudit._normalization.vocabulary import DENOMINATOR_FACTS, LOCAL_DENOMINATORS, Denominator, StepKind, FactorKind
from tokaudit._normalization.vocabulary import FORMULA, PREFERENCE, RECORD_BOUNDS, FactorExplanation, KINDS
from tokaudit._normalization.vocabulary import DENOMINATORS, Diagnoses
from tokaudit._normalization.fits import close, cluster, ClusterStarts, BLOCK_STEPS, FitBlock, block_fits
from tokaudit._normalization.fits import judged_steps
from tokaudit._normalization.decisions import Decisions
from tokaudit._normalization.factors import resolvable_integer, explain_factor, one_scaler
from tokaudit._normalization.spans import Span, MAX_SPANS, segments, span_rows, name_ranks, Spans

__all__ = [
    "block_fits",
    "judged_steps",
    "BLOCK_STEPS",
    "close",
    "cluster",
    "ClusterStarts",
    "Decisions",
    "Denominator",
    "DENOMINATOR_FACTS",
    "DENOMINATORS",
    "Diagnoses",
    "explain_factor",
    "FactorExplanation",
    "FactorKind",
    "FitBlock",
    "FORMULA",
    "KINDS",
    "LOCAL_DENOMINATORS",
    "MAX_SPANS",
    "one_scaler",
    "name_ranks",
    "PREFERENCE",
    "RECORD_BOUNDS",
    "resolvable_integer",
    "segments",
    "Span",
    "span_rows",
    "Spans",
    "StepKind",
]
