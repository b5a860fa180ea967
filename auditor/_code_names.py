"""The vocabulary of findings every module shares: severities, the stable codes, and what one code's documentation
holds (`codes.CODE_DOCS` is the table). Light, so that the command line's options need no heavy import."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

DEFAULT_RTOL = 1e-4
"""Relative tolerance on weights: float32 sums of a few thousand tokens agree to ~1e-6; 1e-4 leaves room. Here, with
the vocabulary every module shares: the command line's options need no heavy import."""


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
    SCHEDULE_RESCALED = "schedule_rescaled"
    SCALE_MISMATCH = "scale_mismatch"
    UNDECLARED_TERM_WEIGHT = "undeclared_term_weight"
    TERM_WEIGHT_INCONSISTENT = "term_weight_inconsistent"
    PADDED_DENOMINATOR = "padded_denominator"
    UNEXPLAINED_WEIGHTING = "unexplained_weighting"
    NONUNIFORM_IN_MICROBATCH = "nonuniform_in_microbatch"
    MASKED_TOKENS_WEIGHTED = "masked_tokens_weighted"
    MISSING_RANK = "missing_rank"
    UNEVEN_MICROBATCHES = "uneven_microbatches"
    UNEQUAL_SYNCS = "unequal_syncs"
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
    RANKS_NOT_RECORDED = "ranks_not_recorded"
    UNREADABLE_FILES = "unreadable_files"
    UPDATE_ENDS_GUESSED = "update_ends_guessed"
    TERMS_ONE_OBJECTIVE = "terms_one_objective"
    UNFINISHED_UPDATE = "unfinished_update"
    SKIP_MISMATCH = "skip_mismatch"


Family = Literal["weighting", "reporting", ""]


@dataclass(frozen=True)
class CodeDoc:
    """What one code says. Plain text with `backticks` around code: the terminal prints it as is and
    docs/CODES.md renders it as Markdown."""

    severity: Severity
    title: str
    """What the finding says, in one line: `tokaudit explain` lists it, docs/CODES.md's table shows it."""
    why: str
    """The derivation: what the code did and what it does to each token's weight."""
    fix: str
    example: str
    """A worked example on EXAMPLE_SETUP (or on a set-up it states)."""
    detail: str = ""
    """What the title leaves out that the table in docs/CODES.md states after it (`title: detail`)."""
    severity_note: str = ""
    """When a finding can carry another severity than `severity`: docs/CODES.md shows `severity, or NOTE`."""
    undecidable: bool = False
    """A warning that says the logs cannot tell: alone, it makes a run `inconclusive`, not `incorrect`."""
    family: Family = ""
    """weighting: the tokens of a step weighed differently (what --min-ratio gates); reporting: the logged loss,
    never the verdict; "": neither."""


EXAMPLE_SETUP = (
    "W = 2 ranks under DDP's average (D = 2); rank 0 has n0 = 1 valid token, rank 1 has n1 = 3, so "
    "N = 4 and every token should weigh 1/N = 0.25."
)
"""The set-up the worked examples share (unless they state another), so that they can be compared."""
