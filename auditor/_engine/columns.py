"""The step table declared once, as data: each column's name, meaning, record expression, reduction, level and
type. `engine.sql.step_sql` writes the SQL of every log shape from these declarations, and nothing else does."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tokaudit._schema import COLUMNS, HALF_PRECISION_BITS


class Level(Enum):
    """What a step column reduces: the step's records, or the per-rank or per-microbatch rows (`Partial`)."""

    STEP = "records"
    RANK = "per_rank"
    MICRO = "per_micro"


@dataclass(frozen=True)
class Term:
    """A per-record value the step's aggregates read (the CTE `rec`, then `weighted` for `w`)."""

    name: str
    meaning: str
    expression: str = ""
    """SQL over one record of the view `records`; empty: the record's column of that name."""


@dataclass(frozen=True)
class Partial:
    """A per-(rank, step) or per-(microbatch, step) value that a RANK or MICRO column reduces."""

    name: str
    meaning: str
    level: Level
    aggregate: str
    """Over the records of one (rank, step) or (microbatch, step)."""
    one_record: str = ""
    """RANK only: the same value where a (rank, step) holds one record, as an expression of that record."""
    evidence: bool = False
    """Only in the evidence form (`EVIDENCE`)."""
    reads: tuple[str, ...] = ()
    absent: str = ""
    """Its value where no record of the range holds a value of any of the optional columns it `reads` (the footers
    say so: `sql.absent_values`), which the query then does not compute."""


@dataclass(frozen=True)
class StepColumn:
    """One column of the step table: one row per (run, group, term, step)."""

    name: str
    meaning: str
    level: Level
    aggregate: str
    """The reduction over the level's rows of one step."""
    type: str = ""
    """DuckDB's type the table holds it in, where not the aggregate's own (counts as INTEGER: 4 bytes a step, not
    the 16 of DuckDB's sums)."""
    one_record: str = ""
    """Where every (rank, step) holds one record: the value as an expression of the step's other columns, not
    aggregated (one other column's name: that column's array, held once)."""
    evidence: bool = False
    """Only in the evidence form: where a step's heaviest and lightest token were (`EVIDENCE`)."""
    reads: tuple[str, ...] = ()
    absent: str = ""
    """Its value where no record of the range holds a value of any of the optional columns it `reads` (or WIDE_MICRO)
    (the footers say so: `sql.absent_values`), which the query then does not compute: a constant (what the
    reduction gives over NULL alone: count 0, the others NULL), or another column's name (that column's array)."""


WIDE_MICRO = "micro >= 64"
"""What `reads` names for a microbatch index of 64 or more: where the footers show none, a one-microbatch log's
query reads no microbatch index at all."""

# (the required columns' least values: an optional column may be absent, and then no query reads it; a negative T is
# below n all the same)
UNUSABLE_RECORD = (
    "isnan(grad_divisor) OR isnan(grad_scale) OR isnan(term_weight) OR (positions < valid_tokens) IS TRUE"
    + "".join(
        f" OR {column.name} < {column.low[0]}" for column in COLUMNS if column.low is not None and column.required
    )
)
"""A record no audit can use that its file's statistics may not show: a NaN divisor, scale or term weight, or T < n (IS
TRUE: count_if over NULLs alone is NULL); or one below a column's least value (a negative count) in a file whose
statistics say otherwise (a damaged page, a writer's bug). Counted per step (`unusable_values`), then its files are
named (`Engine.unusable_files`)."""

FINITE_VALID = """isfinite(loss_sum) AND coalesce(isfinite(backward_scalar), true)
            AND coalesce(isfinite(token_weight_sum), true) AND coalesce(isfinite(token_weight_min), true)
            AND coalesce(isfinite(token_weight_max), true) AND coalesce(isfinite(masked_weight_abs_sum), true)
            AND isfinite(grad_scale) AND isfinite(grad_divisor) AND coalesce(isfinite(eff), true)"""

ROUNDED_BITS = tuple(sorted(HALF_PRECISION_BITS.values()))
"""The significant bits of bfloat16 and of float16, the fewest first: a run whose every backward scalar holds one of
them exactly, and says no precision, may have computed b in it (`tables.rounded_precision`)."""


def _held(bits: int) -> str:
    """b holds `bits` significant bits exactly: b rounded to them by Veltkamp's split, c = b·(2^(53−bits) + 1),
    c − (c − b), is b (a multiply and two subtractions, where log2 and pow took a fifth of the query)."""
    split = f"backward_scalar * {2 ** (53 - bits) + 1}.0"
    return f"{split} - ({split} - backward_scalar) = backward_scalar"


# (the split is exact for normal doubles: below 1e-300, b counts as holding every bit). Rank 0's records alone: what
# the run computed in, at a W-th of the cost (a CASE computes a branch only for the records that reach it).
SCALAR_BITS = Term(
    "scalar_bits",
    "rank 0's: the fewest of 8, 11 or 53 significant bits that hold b exactly (NULL: another rank, b 0 or not finite)",
    # the widest first: most b (float32's) fail it, and the CASE then computes no other
    "CASE WHEN rank <> 0 OR NOT isfinite(backward_scalar) OR backward_scalar = 0 THEN NULL "
    "WHEN abs(backward_scalar) < 1e-300 "
    f"THEN 53 WHEN NOT ({_held(ROUNDED_BITS[-1])}) THEN 53 "
    f"{' '.join(f'WHEN {_held(bits)} THEN {bits}' for bits in ROUNDED_BITS[:-1])} ELSE {ROUNDED_BITS[-1]} END",
)

# The declarations are tables, a row a line: the formatter leaves them as written.
# fmt: off
# Per-record weights e are only defined for valid records (n > 0) with every value finite.
TERMS = (
    *(Term(name, "the record's own") for name in (
        "step", "rank", "micro", "world_size", "grad_divisor", "grad_scale", "term_weight", "valid_tokens", "loss_sum", "positions",
        "sync", "skipped", "reported_loss", "token_weight_sum", "divisor_known", "precision_bits")),
    Term("nonfinite_valid", "a record of valid tokens with a value that is not finite",
         f"valid_tokens > 0 AND NOT ({FINITE_VALID})"),
    Term("nonfinite_zero", "a record of no valid token whose backward scalar or probe is not finite",
         "valid_tokens = 0 AND NOT (coalesce(isfinite(backward_scalar), true) "
         "AND coalesce(isfinite(token_weight_sum), true))"),
    Term("probe_low", "the probe's lightest token weight after the reduction",
         "token_weight_min * grad_scale / grad_divisor / nullif(term_weight, 0)"),
    Term("probe_high", "the probe's heaviest token weight after the reduction",
         "token_weight_max * grad_scale / grad_divisor / nullif(term_weight, 0)"),
    # how far apart one record's token weights are, (max − min) / |max|: only values, no tolerance (the checks
    # judge them; +inf where the denominator is 0: any spread then counts)
    Term("probe_spread", "how far apart the record's token weights are",
         "CASE WHEN token_weight_max - token_weight_min > 0 "
         "THEN (token_weight_max - token_weight_min) / abs(token_weight_max) END"),
    # how many valid tokens' weight its masked positions carry: Σ|∂b/∂ℓ| over them / |c|, c = e·D/g
    Term("masked_share", "the weight the record's masked positions carry, in valid tokens",
         "CASE WHEN masked_weight_abs_sum > 0 "
         "THEN masked_weight_abs_sum / coalesce(abs(eff * grad_divisor / grad_scale * term_weight), 0) END"),
    Term("eff", "the effective weight e = c·g/(D·λ) of each of the record's valid tokens"),
    SCALAR_BITS,
)

WEIGHT = Term("w", "e where it is one: valid tokens and every value finite",
              "CASE WHEN valid_tokens > 0 AND NOT nonfinite_valid THEN eff END")

# ties, rounding noise included, go to the lowest microbatch and rank: the order key moves w by 1e-12 of |w| per
# index, and a weight of 0 (where that moves nothing) by 1e-300 per index, so the scan or hash order never decides
_HEAVY_MICRO, _LIGHT_MICRO = "w - abs(w) * micro * 1e-12 - micro * 1e-300", "w + abs(w) * micro * 1e-12 + micro * 1e-300"
_HEAVY_RANK = "rank_e_high - abs(rank_e_high) * rank * 1e-12 - rank * 1e-300"
_LIGHT_RANK = "rank_e_low + abs(rank_e_low) * rank * 1e-12 + rank * 1e-300"

# Few values per (rank, step): millions of groups at scale must stay narrow.
PARTIALS = (
    Partial("microbatches", "records of the rank's step", Level.RANK, "count(*)", "1"),
    Partial("rank_tokens", "n_r, the rank's valid tokens", Level.RANK, "CAST(sum(valid_tokens) AS BIGINT)",
            "CAST(valid_tokens AS BIGINT)"),
    Partial("rank_loss", "S_r, the rank's loss sum", Level.RANK, "fsum(loss_sum)", "loss_sum"),
    Partial("rank_e_low", "the rank's lightest e", Level.RANK, "min(w)", "w"),
    Partial("rank_e_high", "the rank's heaviest e", Level.RANK, "max(w)", "w"),
    Partial("rank_heavy_micro", "the microbatch of the rank's heaviest e", Level.RANK,
            f"arg_max(micro, {_HEAVY_MICRO})", "micro", evidence=True),
    Partial("rank_heavy_n", "its valid tokens", Level.RANK, f"arg_max(valid_tokens, {_HEAVY_MICRO})", "valid_tokens",
            evidence=True),
    Partial("rank_light_micro", "the microbatch of the rank's lightest e", Level.RANK,
            f"arg_min(micro, {_LIGHT_MICRO})", "micro", evidence=True),
    Partial("rank_light_n", "its valid tokens", Level.RANK, f"arg_min(valid_tokens, {_LIGHT_MICRO})", "valid_tokens",
            evidence=True),
    Partial("rank_en_low", "the rank's least e·n", Level.RANK, "min(w * valid_tokens)", "w * valid_tokens"),
    Partial("rank_en_high", "the rank's greatest e·n", Level.RANK, "max(w * valid_tokens)", "w * valid_tokens"),
    Partial("last_sync", "sync of the rank's last microbatch", Level.RANK, "arg_max_null(sync, micro)", "sync",
            reads=("sync",), absent="CAST(NULL AS BOOLEAN)"),
    Partial("rank_synced", "records of the rank's step that said they synchronized", Level.RANK,
            "count_if(sync IS TRUE)", "CAST(sync IS TRUE AS INTEGER)", reads=("sync",), absent="CAST(0 AS BIGINT)"),
    # distinct microbatch indices below 64, as set bits: fewer bits than rows means a repeated key
    Partial("repeated", "records of the rank's step that repeat a microbatch index below 64", Level.RANK,
            "count_if(micro < 64) - coalesce(bit_count(bit_or("
            "CASE WHEN micro < 64 THEN CAST(1 AS UBIGINT) << CAST(micro AS UBIGINT) END)), 0)"),
    Partial("micro_tokens", "N_m, the microbatch's valid tokens over the ranks", Level.MICRO, "sum(valid_tokens)"),
    Partial("micro_e_low", "the microbatch's lightest e", Level.MICRO, "min(w)"),
    Partial("micro_e_high", "the microbatch's heaviest e", Level.MICRO, "max(w)"),
)

S, R, M = Level.STEP, Level.RANK, Level.MICRO
_PROBE = ("token_weight_min", "token_weight_max")
I, B = "INTEGER", "BIGINT"

STEP_COLUMNS = (
    StepColumn("records", "records of the step", S, "count(*)", I),
    StepColumn("rank_max", "the highest rank", S, "max(rank)", I),
    StepColumn("world_low", "the least world size W recorded", S, "min(world_size)", I),
    StepColumn("world_high", "the greatest W", S, "max(world_size)", I),
    StepColumn("divisor_low", "the least divisor D of the reduction", S, "min(grad_divisor)"),
    StepColumn("divisor_high", "the greatest D", S, "max(grad_divisor)"),
    StepColumn("record_tokens_low", "the fewest valid tokens of a record", S, "min(valid_tokens)"),
    StepColumn("record_tokens_high", "the most valid tokens of a record", S, "max(valid_tokens)"),
    StepColumn("tokens", "N, the step's valid tokens", S, "sum(valid_tokens)", B),
    StepColumn("loss", "ΣS, the step's loss sum", S, "fsum(loss_sum)"),
    StepColumn("weight_low", "the lightest effective weight e of a valid token (a record's mean)", S, "min(w)"),
    StepColumn("weight_high", "the heaviest e", S, "max(w)"),
    StepColumn("weight_by_record_low", "the least e·n (what n as the denominator would make 1)", S, "min(w * valid_tokens)"),
    StepColumn("weight_by_record_high", "the greatest e·n", S, "max(w * valid_tokens)"),
    StepColumn("weight_by_positions_low", "the least e·T (T the record's positions)", S, "min(w * positions)",
               reads=("positions",), absent="CAST(NULL AS DOUBLE)"),
    StepColumn("weight_by_positions_high", "the greatest e·T", S, "max(w * positions)", reads=("positions",), absent="CAST(NULL AS DOUBLE)"),
    # the probe's per-token extremes where recorded, else the record's mean weight
    # without a probe value, min and max of coalesce(probe, w) + 0·w are those of w (w is finite where it is not
    # NULL, and w + 0·w is w, −0.0 included)
    StepColumn("token_weight_low", "the lightest token weight: the probe's where recorded, else e", S,
               "min(coalesce(probe_low, w) + 0 * w)", reads=_PROBE, absent="weight_low"),
    StepColumn("token_weight_high", "the heaviest token weight", S, "max(coalesce(probe_high, w) + 0 * w)",
               reads=_PROBE, absent="weight_high"),
    StepColumn("weighted_records", "records with a weight e", S, "count(w)", I),
    StepColumn("unweighted_records", "valid, finite records without one (S = 0 and no probe), of a λ other than 0", S,
               "count_if(valid_tokens > 0 AND w IS NULL AND NOT nonfinite_valid AND term_weight <> 0)", I),
    StepColumn("unknown_divisor", "valid records whose D the recorder could not know", S,
               "count_if(valid_tokens > 0 AND NOT divisor_known)", I, reads=("divisor_known",), absent="0"),
    StepColumn("objective", "Σe·S, the loss the update optimized", S, "coalesce(fsum(w * loss_sum), 0)"),
    StepColumn("nonfinite_valid", "valid records with a value that is not finite", S, "count_if(nonfinite_valid)", I),
    StepColumn("nonfinite_zero", "records of no token with a b or probe that is not finite", S,
               "count_if(nonfinite_zero)", I),
    StepColumn("probe_spread", "the widest spread of one record's token weights", S, "max(probe_spread)",
               reads=_PROBE, absent="CAST(NULL AS DOUBLE)"),
    StepColumn("masked_share", "the most weight masked positions carry", S, "max(masked_share)",
               reads=("masked_weight_abs_sum",), absent="CAST(NULL AS DOUBLE)"),
    StepColumn("probed", "records with a probe", S, "count(token_weight_sum)", I, reads=("token_weight_sum",), absent="0"),
    StepColumn("sync_known", "records that say whether they synchronized", S, "count(sync)", I, reads=("sync",),
               absent="0"),
    StepColumn("sync_true", "records that synchronized", S, "count_if(sync)", I, reads=("sync",), absent="NULL"),
    StepColumn("skipped_true", "records of an update said skipped", S, "count_if(skipped)", I, reads=("skipped",),
               absent="NULL"),
    StepColumn("skipped_false", "records of an update said taken", S, "count_if(NOT skipped)", I, reads=("skipped",),
               absent="NULL"),
    StepColumn("reported_low", "the least loss the run reported", S, "min(reported_loss)", reads=("reported_loss",),
               absent="CAST(NULL AS DOUBLE)"),
    StepColumn("reported_high", "the greatest reported loss", S, "max(reported_loss)", reads=("reported_loss",),
               absent="CAST(NULL AS DOUBLE)"),
    StepColumn("reported", "records with a reported loss", S, "count(reported_loss)", I, reads=("reported_loss",),
               absent="0"),
    StepColumn("positions", "ΣT, the positions of the step's records", S, "sum(positions)", B, reads=("positions",),
               absent="NULL"),
    StepColumn("positions_known", "records with T", S, "count(positions)", I, reads=("positions",), absent="0"),
    StepColumn("wide_micro", "records of a microbatch index of 64 or more", S, "count_if(micro >= 64)", I,
               reads=(WIDE_MICRO,), absent="0"),
    StepColumn("scalar_bits_high", "the most significant bits a b of rank 0 holds: 8 (bfloat16's), 11 (float16's) or 53",
               S, "max(scalar_bits)", I),
    # (a record of no valid token weighs nothing whatever its precision: it does not make the step's tolerance coarser)
    StepColumn("precision_bits_low", "the fewest significant bits of S and b of a record of valid tokens", S,
               "min(precision_bits) FILTER (valid_tokens > 0)", I, reads=("precision_bits",), absent="NULL"),
    StepColumn("declared_weights", "records that declare their term's weight λ (≠ 1)", S, "count_if(term_weight <> 1)",
               I, reads=("term_weight",), absent="0"),
    StepColumn("declared_low", "the least λ a record of valid tokens declares (1: none)", S,
               "min(term_weight) FILTER (valid_tokens > 0)", reads=("term_weight",), absent="1"),
    StepColumn("declared_high", "the greatest λ", S, "max(term_weight) FILTER (valid_tokens > 0)",
               reads=("term_weight",), absent="1"),
    # NaN never shows in a file's statistics, nor T < n where a file's T and n overlap: counted here, the
    # files are then named (Engine.unusable_files)
    StepColumn("unusable_values", "records no audit can use (a NaN D or g, T < n)", S,
               f"count_if({UNUSABLE_RECORD})", I),
    # the heaviest and the lightest valid record of the step, for a finding's evidence
    StepColumn("heavy_rank", "the rank of the heaviest token", R, f"arg_max(rank, {_HEAVY_RANK})", I, evidence=True),
    StepColumn("heavy_micro", "its microbatch", R, f"arg_max(rank_heavy_micro, {_HEAVY_RANK})", I, evidence=True),
    StepColumn("heavy_n", "its record's valid tokens", R, f"arg_max(rank_heavy_n, {_HEAVY_RANK})", I, evidence=True),
    StepColumn("heavy_rank_tokens", "its rank's valid tokens", R, f"arg_max(rank_tokens, {_HEAVY_RANK})", B,
               evidence=True),
    StepColumn("light_rank", "the rank of the lightest token", R, f"arg_min(rank, {_LIGHT_RANK})", I, evidence=True),
    StepColumn("light_micro", "its microbatch", R, f"arg_min(rank_light_micro, {_LIGHT_RANK})", I, evidence=True),
    StepColumn("light_n", "its record's valid tokens", R, f"arg_min(rank_light_n, {_LIGHT_RANK})", I, evidence=True),
    StepColumn("light_rank_tokens", "its rank's valid tokens", R, f"arg_min(rank_tokens, {_LIGHT_RANK})", B,
               evidence=True),
    StepColumn("ranks", "ranks that recorded the step", R, "count(*)", I, one_record="records"),
    StepColumn("mean_of_local_means", "the mean over ranks of S_r/n_r", R,
               "favg(rank_loss / rank_tokens) FILTER (rank_tokens > 0)"),
    # ranks below 64 present in the step, as set bits (the missing-rank evidence); 0: none of them
    StepColumn("rank_mask", "ranks below 64 present, as set bits", R,
               "coalesce(bit_or(CASE WHEN rank < 64 THEN CAST(1 AS UBIGINT) << CAST(rank AS UBIGINT) END), 0)"),
    # one record a rank: its last microbatch is its record, so the ranks that did not are the records of sync false
    StepColumn("unsynced_ranks", "ranks whose last microbatch did not synchronize", R, "count_if(last_sync = false)", I,
               one_record="sync_known - sync_true", reads=("sync",), absent="NULL"),
    # how often each rank synchronized: equal counts on every rank match DDP's all-reduces one for one, whatever
    # number of microbatches each ran (one record a rank: 1 where every record synchronized, else 0, and so on)
    StepColumn("rank_synced_low", "the fewest synchronized records of a rank", R, "min(rank_synced)", I,
               one_record="CASE WHEN sync_true = records THEN 1 ELSE 0 END", reads=("sync",), absent="0"),
    StepColumn("rank_synced_high", "the most synchronized records of a rank", R, "max(rank_synced)", I,
               one_record="CASE WHEN sync_true > 0 THEN 1 ELSE 0 END", reads=("sync",), absent="0"),
    # one record a (rank, step), ranks below 64: a repeated key is a repeated rank, records − distinct ranks (the
    # rank mask's set bits: a tenth of the time of count(DISTINCT rank))
    StepColumn("repeated_micro", "records that repeat a (rank, microbatch) key", R, "coalesce(sum(repeated), 0)", I,
               one_record="records - bit_count(rank_mask)"),
    StepColumn("microbatches_low", "the fewest microbatches of a rank", R, "min(microbatches)", I, one_record="1"),
    StepColumn("microbatches_high", "the most microbatches of a rank", R, "max(microbatches)", I, one_record="microbatches_low"),
    StepColumn("weight_by_record_m_low", "the least e·n·M (a per-microbatch mean's weight)", R, "min(rank_en_low * microbatches)",
               one_record="weight_by_record_low"),
    StepColumn("weight_by_record_m_high", "the greatest e·n·M", R, "max(rank_en_high * microbatches)", one_record="weight_by_record_high"),
    StepColumn("weight_by_rank_low", "the least e·n_r (a rank-local mean's weight)", R, "min(rank_e_low * rank_tokens)",
               one_record="weight_by_record_low"),
    StepColumn("weight_by_rank_high", "the greatest e·n_r", R, "max(rank_e_high * rank_tokens)", one_record="weight_by_record_high"),
    StepColumn("weight_by_micro_low", "the least e·N_m (a mean over the microbatch's tokens of every rank)", M,
               "min(micro_e_low * micro_tokens)", one_record="weight_low * tokens"),
    StepColumn("weight_by_micro_high", "the greatest e·N_m", M, "max(micro_e_high * micro_tokens)", one_record="weight_high * tokens"),
)
"""In the table's order. M = 1 where a (rank, step) holds one record, so e·n_r = e·n·M = e·n exactly (×1 and the
count's conversion to double change no bit) and e·N_m = e·N."""
# fmt: on

EVIDENCE = tuple(column.name for column in STEP_COLUMNS if column.evidence)
"""Where each step's heaviest and lightest token were: only a finding's evidence step reads them, so they are
aggregated for that step alone (`engine.extremes_at`): over every step they cost a tenth of the query."""

STEP_COLUMN_BY_NAME = {column.name: column for column in STEP_COLUMNS}
