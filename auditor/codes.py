"""Stable finding codes and severities (docs/CODES.md). Tests and JSON match on these, never on text."""

from __future__ import annotations

from enum import Enum

DEFAULT_RTOL = 1e-4
"""Relative tolerance on weights: float32 sums of a few thousand tokens agree to ~1e-6; 1e-4 leaves room.
Here, with the vocabulary every module shares, so that the command line's options need no heavy import."""


class Severity(str, Enum):
    """How bad a finding is; ordered info < warning < error."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return {"info": 0, "warning": 1, "error": 2}[self.value]


class Code(str, Enum):
    """What a finding says."""

    LOCAL_MEAN = "local_mean"
    PER_MICRO_DENOMINATOR = "per_micro_denominator"
    WORLD_SIZE_MISMATCH = "world_size_mismatch"
    SCALE_MISMATCH = "scale_mismatch"
    PADDED_DENOMINATOR = "padded_denominator"
    UNEXPLAINED_WEIGHTING = "unexplained_weighting"
    NONUNIFORM_IN_MICROBATCH = "nonuniform_in_microbatch"
    MASKED_TOKENS_WEIGHTED = "masked_tokens_weighted"
    MISSING_RANK = "missing_rank"
    UNEVEN_MICROBATCHES = "uneven_microbatches"
    WORLD_SIZE_INCONSISTENT = "world_size_inconsistent"
    WORLD_SIZE_CHANGED = "world_size_changed"
    DUPLICATE_RECORDS = "duplicate_records"
    EMPTY_UPDATE = "empty_update"
    ZERO_TOKEN_NONFINITE = "zero_token_nonfinite"
    NONFINITE_VALUES = "nonfinite_values"
    REPORTED_LOSS_MISMATCH = "reported_loss_mismatch"
    REPORTED_LOSS_SHIFTED = "reported_loss_shifted"
    MISSING_SYNC = "missing_sync"
    SYNC_EVERY_MICRO = "sync_every_micro"
    BALANCED_COUNTS = "balanced_counts"
    LOSS_SCALE = "loss_scale"
    UNKNOWN_DIVISOR = "unknown_divisor"
    NO_WEIGHTS = "no_weights"
    RECORDS_DROPPED = "records_dropped"
    COUNT_MISMATCH = "count_mismatch"


DEFAULT_SEVERITY: dict[Code, Severity] = {
    Code.LOCAL_MEAN: Severity.ERROR,
    Code.PER_MICRO_DENOMINATOR: Severity.ERROR,
    Code.WORLD_SIZE_MISMATCH: Severity.ERROR,
    Code.SCALE_MISMATCH: Severity.WARNING,
    Code.PADDED_DENOMINATOR: Severity.ERROR,
    Code.UNEXPLAINED_WEIGHTING: Severity.ERROR,
    Code.NONUNIFORM_IN_MICROBATCH: Severity.WARNING,
    Code.MASKED_TOKENS_WEIGHTED: Severity.WARNING,
    Code.MISSING_RANK: Severity.ERROR,
    Code.UNEVEN_MICROBATCHES: Severity.WARNING,
    Code.WORLD_SIZE_INCONSISTENT: Severity.ERROR,
    Code.WORLD_SIZE_CHANGED: Severity.INFO,
    Code.DUPLICATE_RECORDS: Severity.WARNING,
    Code.EMPTY_UPDATE: Severity.INFO,  # error when a record is non-finite or ranks disagree on `skipped`
    Code.ZERO_TOKEN_NONFINITE: Severity.ERROR,
    Code.NONFINITE_VALUES: Severity.ERROR,
    Code.REPORTED_LOSS_MISMATCH: Severity.WARNING,
    Code.REPORTED_LOSS_SHIFTED: Severity.INFO,
    Code.MISSING_SYNC: Severity.ERROR,
    Code.SYNC_EVERY_MICRO: Severity.INFO,
    Code.BALANCED_COUNTS: Severity.INFO,
    Code.LOSS_SCALE: Severity.WARNING,
    Code.UNKNOWN_DIVISOR: Severity.WARNING,
    Code.NO_WEIGHTS: Severity.WARNING,
    Code.RECORDS_DROPPED: Severity.WARNING,
    Code.COUNT_MISMATCH: Severity.WARNING,
}

UNDECIDABLE: frozenset[Code] = frozenset({Code.LOSS_SCALE, Code.UNKNOWN_DIVISOR, Code.NO_WEIGHTS,
                                          Code.RECORDS_DROPPED, Code.COUNT_MISMATCH})
"""Warnings that say the logs cannot tell: alone, they make a run `inconclusive`, not `incorrect`."""
