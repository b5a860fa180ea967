"""The step query: what one row of the step table is, written once as SQL, and the views it reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from tokaudit.footers import footer_type
from tokaudit.reader import NULLABLE_COLUMNS, Shard
from tokaudit.schema import COLUMNS_BY_NAME, UNNAMED


DUCKDB_TYPES = {"int": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN", "string": "VARCHAR",
                "timestamp": "TIMESTAMPTZ"}

def sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"

# Per-record weights e are only defined for valid records (n > 0) with every value finite.
RECORDS_SQL = """
WITH rec AS (
    -- k stands for (run, grp, term) in the groupings: an integer hashes in a fraction of the time of
    -- three strings, and the per-rank grouping of a many-microbatch log holds millions of groups
    SELECT {key} AS k, {record_names}step, rank, micro, world_size, grad_divisor, grad_scale,
        valid_tokens, loss_sum, positions,
        sync, skipped, reported_loss, token_weight_sum, divisor_known, precision_bits,
        valid_tokens > 0 AND NOT (isfinite(loss_sum) AND coalesce(isfinite(backward_scalar), true)
            AND coalesce(isfinite(token_weight_sum), true) AND coalesce(isfinite(token_weight_min), true)
            AND coalesce(isfinite(token_weight_max), true) AND coalesce(isfinite(masked_weight_abs_sum), true)
            AND isfinite(grad_scale) AND isfinite(grad_divisor) AND coalesce(isfinite(eff), true)) AS nonfinite_valid,
        valid_tokens = 0 AND NOT (coalesce(isfinite(backward_scalar), true)
            AND coalesce(isfinite(token_weight_sum), true)) AS nonfinite_zero,
        token_weight_min * grad_scale / grad_divisor AS probe_low,
        token_weight_max * grad_scale / grad_divisor AS probe_high,
        -- how far apart one record's token weights are, (max − min) / |max|; how many valid tokens' weight its masked
        -- positions carry, Σ|∂b/∂ℓ| over them / |c| (c = e·D/g). Only values, no tolerance: the checks judge them
        -- (+inf where the denominator is 0: any spread or masked weight then counts)
        CASE WHEN token_weight_max - token_weight_min > 0
            THEN (token_weight_max - token_weight_min) / abs(token_weight_max) END AS probe_spread,
        CASE WHEN masked_weight_abs_sum > 0
            THEN masked_weight_abs_sum / coalesce(abs(eff * grad_divisor / grad_scale), 0) END AS masked_share,
        eff
    FROM records
),
weighted AS (
    -- w: the effective weight e, only where it is one (valid tokens, every value finite)
    SELECT *, CASE WHEN valid_tokens > 0 AND NOT nonfinite_valid THEN eff END AS w FROM rec
)
"""

UNUSABLE_WITHOUT_POSITIONS = "isnan(grad_divisor) OR isnan(grad_scale)"

UNUSABLE_RECORD = f"{UNUSABLE_WITHOUT_POSITIONS} OR (positions < valid_tokens) IS TRUE"
"""A record no audit can use that its file's statistics may not show: a NaN divisor or scale, or T < n (IS TRUE:
count_if over NULLs alone is NULL). Counted per step (`unusable_values`), then its files are named
(`Engine.unusable_files`); where no record holds a T, the footers' constants leave the comparison out."""

STEP_AGGREGATES = f"""
        count(*) AS records, max(rank) AS rank_max,
        min(world_size) AS w_low, max(world_size) AS w_high,
        min(grad_divisor) AS d_low, max(grad_divisor) AS d_high,
        min(valid_tokens) AS n_low, max(valid_tokens) AS n_high,
        sum(valid_tokens) AS tokens, fsum(loss_sum) AS loss,
        min(w) AS e_low, max(w) AS e_high,
        min(w * valid_tokens) AS en_low, max(w * valid_tokens) AS en_high,
        min(w * positions) AS et_low, max(w * positions) AS et_high,
        -- the probe's per-token extremes where recorded, else the record's mean weight
        min(coalesce(probe_low, w) + 0 * w) AS tok_low, max(coalesce(probe_high, w) + 0 * w) AS tok_high,
        count(w) AS weighted_records,
        count_if(valid_tokens > 0 AND w IS NULL AND NOT nonfinite_valid) AS unweighted_records,
        count_if(valid_tokens > 0 AND NOT divisor_known) AS unknown_divisor,
        coalesce(fsum(w * loss_sum), 0) AS objective,
        count_if(nonfinite_valid) AS nonfinite_valid,
        count_if(nonfinite_zero) AS nonfinite_zero,
        max(probe_spread) AS probe_spread,
        max(masked_share) AS masked_share,
        count(token_weight_sum) AS probed,
        count(sync) AS sync_known, count_if(sync) AS sync_true,
        count_if(skipped) AS skipped_true, count_if(NOT skipped) AS skipped_false,
        min(reported_loss) AS reported_low, max(reported_loss) AS reported_high, count(reported_loss) AS reported,
        sum(positions) AS positions, count(positions) AS positions_known,
        count_if(micro >= 64) AS wide_micro, min(precision_bits) AS bits_low,
        -- NaN never shows in a file's statistics, nor T < n where a file's T and n overlap: counted here, the
        -- files are then named (unusable_files)
        count_if({UNUSABLE_RECORD}) AS unusable_values
"""
"""Per (run, group, term) and step, over the records."""

RANK_SHAPE = """
        min(microbatches) AS m_low, max(microbatches) AS m_high,
        min(en_low * microbatches) AS enm_low, max(en_high * microbatches) AS enm_high,
        min(e_low * rank_tokens) AS er_low, max(e_high * rank_tokens) AS er_high
"""
"""Per (run, group, term) and step, over the per-rank rows: the microbatches and what a rank-local or
per-microbatch mean would weigh. With one record per rank these are constants or e·n (`ONE_RECORD_SHAPE`)."""

ONE_RECORD_SHAPE = {"enm_low": "en_low", "enm_high": "en_high", "er_low": "en_low", "er_high": "en_high"}
"""RANK_SHAPE when each rank's step is one record: M = 1 (m_low = m_high = 1), and e·n_r = e·n·M = e·n
exactly (×1 and the count's conversion to double change no bit), so no aggregate is needed, nor a column:
each of these is the same array as the column it equals (`_aggregate`; `join_columns` joins it once)."""

MEAN_WEIGHT_EXTREMES = {"tok_low": "e_low", "tok_high": "e_high"}
"""Columns that equal another bit for bit in a range whose records hold no probe value (min and max of
coalesce(probe, w) + 0·w are then those of w: w is finite where it is not NULL, and w + 0·w is w, −0.0
included): the step table then holds the one array for both (`_aggregate`, which compares the bits
rather than trust this), 16 bytes a step less."""

RANK_AGGREGATES = """
        count(*) AS ranks,
        favg(rank_loss / rank_tokens) FILTER (rank_tokens > 0) AS mean_of_local_means,
        -- ranks below 64 present in the step, as set bits (the missing-rank evidence); 0: none of them
        coalesce(bit_or(CASE WHEN rank < 64 THEN CAST(1 AS UBIGINT) << CAST(rank AS UBIGINT) END), 0) AS rank_mask,
        count_if(last_sync = false) AS unsynced_ranks,
        {repeated} AS repeated_micro
"""
"""Per (run, group, term) and step, over the per-rank rows (`per_rank`)."""

EXTREME_AGGREGATES = """
        -- the heaviest and the lightest valid record of the step, for the evidence
        arg_max(rank, {heavy}) AS heavy_rank, arg_max(heavy_micro, {heavy}) AS heavy_micro,
        arg_max(heavy_n, {heavy}) AS heavy_n, arg_max(rank_tokens, {heavy}) AS heavy_rank_tokens,
        arg_min(rank, {light}) AS light_rank, arg_min(light_micro, {light}) AS light_micro,
        arg_min(light_n, {light}) AS light_n, arg_min(rank_tokens, {light}) AS light_rank_tokens,
""".format(heavy="e_high - abs(e_high) * rank * 1e-12 - rank * 1e-300",
           light="e_low + abs(e_low) * rank * 1e-12 + rank * 1e-300")
"""Per (run, group, term) and step, over the per-rank rows: where the heaviest and the lightest token
were. Only a finding's evidence step reads them, so they are aggregated for that step alone
(`step_sql(..., extremes=True)`): over every step they cost a tenth of the query."""

EXTREME_COLUMNS = ("heavy_rank", "heavy_micro", "heavy_n", "heavy_rank_tokens",
                   "light_rank", "light_micro", "light_n", "light_rank_tokens")

INTEGER_COLUMNS = (
    "records", "rank_max", "w_low", "w_high", "weighted_records", "unweighted_records", "unknown_divisor",
    "nonfinite_valid", "nonfinite_zero", "probed", "sync_known", "sync_true",
    "skipped_true", "skipped_false", "reported", "positions_known", "wide_micro", "unusable_values", "ranks", "m_low", "bits_low",
    "m_high", "unsynced_ranks", "repeated_micro")
"""Counts of records, ranks and microbatches and their indices: 4 bytes a step each, not 8 (or the 16 of
DuckDB's HUGEINT sums), for a step table of millions of rows."""

BIGINT_COLUMNS = ("tokens", "positions")
"""Token counts: sums that could pass 2³¹ over a step of many ranks."""

def _casts(leave_out: tuple[str, ...] = ()) -> str:
    """The REPLACE list that gives the counts their narrow types, but for columns made elsewhere."""
    return ", ".join([f"CAST({c} AS INTEGER) AS {c}" for c in INTEGER_COLUMNS if c not in leave_out]
                     + [f"CAST({c} AS BIGINT) AS {c}" for c in BIGINT_COLUMNS if c not in leave_out])

CASTS = _casts()

ONE_RECORD_CASTS = _casts(leave_out=("m_low", "m_high"))  # constants of the one-record form

EXTREME_CASTS = ", ".join(f"CAST({c} AS {'BIGINT' if c.endswith('tokens') else 'INTEGER'}) AS {c}"
                          for c in EXTREME_COLUMNS)

STEP_KEYS = "k, {names}step"

KEYS = ("hash(run, grp, term)", "any_value(run) AS run, any_value(grp) AS grp, any_value(term) AS term, ",
        "run, grp, term, ")
"""{key}, {names} and {record_names} of the query: k a hash of the names, the names any row's."""

ONE_NAME_KEYS = ("CAST(0 AS UBIGINT)", "", "")
"""{key}, {names} and {record_names} when the footers show every record of the range has one (run,
group, term) (`Shard.names`): no hash of three strings per record, no string aggregate per step, and no
name at all, neither read nor kept in the records the groupings share: the names' categories are made in
Python (`_aggregate`), not a string a step handed over and hashed again."""

# By step only: sorting by the names as well costs more than the rest of the query at millions of steps;
# the rare table of several (run, group, term) is sorted as categories after (`step_table`).
STEP_SQL = f"""
{RECORDS_SQL},
step_level AS (SELECT {STEP_KEYS}, {STEP_AGGREGATES} FROM weighted GROUP BY k, step),
per_rank AS (
    -- Few aggregates per (rank, step): millions of groups at scale must stay narrow.
    SELECT k, step, rank,
        count(*) AS microbatches, CAST(sum(valid_tokens) AS BIGINT) AS rank_tokens, fsum(loss_sum) AS rank_loss,
        min(w) AS e_low, max(w) AS e_high, {{rank_extremes}}
        min(w * valid_tokens) AS en_low, max(w * valid_tokens) AS en_high,
        arg_max(sync, micro) AS last_sync,
        -- distinct microbatch indices below 64, as set bits: fewer bits than rows means a repeated key
        count_if(micro < 64)
            - coalesce(bit_count(bit_or(CASE WHEN micro < 64 THEN CAST(1 AS UBIGINT) << CAST(micro AS UBIGINT) END)), 0)
            AS repeated
    FROM weighted GROUP BY k, step, rank
),
rank_level AS (
    SELECT k, step, {{extremes}} {RANK_AGGREGATES}, {RANK_SHAPE}
    FROM per_rank GROUP BY k, step
),
per_micro AS (
    SELECT k, step, micro, sum(valid_tokens) AS micro_tokens, min(w) AS e_low, max(w) AS e_high
    FROM weighted GROUP BY k, step, micro
),
micro_level AS (
    SELECT k, step, min(e_low * micro_tokens) AS em_low, max(e_high * micro_tokens) AS em_high
    FROM per_micro GROUP BY k, step
)
SELECT * EXCLUDE (k) REPLACE ({CASTS}{{extreme_casts}}) FROM step_level
JOIN rank_level USING (k, step)
LEFT JOIN micro_level USING (k, step)
ORDER BY step
""".replace("{repeated}", "coalesce(sum(repeated), 0)")

RANK_EXTREMES = """
        -- the heaviest and lightest record; ties, rounding noise included, go to the lowest microbatch
        -- and rank: the order key moves w by 1e-12 of |w| per index, and a weight of 0 (where that moves
        -- nothing) by 1e-300 per index, so the scan or hash order never decides
        arg_max(micro, {heavy}) AS heavy_micro, arg_max(valid_tokens, {heavy}) AS heavy_n,
        arg_min(micro, {light}) AS light_micro, arg_min(valid_tokens, {light}) AS light_n,
""".format(heavy="w - abs(w) * micro * 1e-12 - micro * 1e-300", light="w + abs(w) * micro * 1e-12 + micro * 1e-300")

# One record per (rank, step) (every record microbatch 0, keys unique): each per-rank aggregate is its one
# record's value (count 1, sums and extremes the value itself, arg_max the record's own field), so per_rank
# is a projection of the records, and the per-rank aggregates run in the same grouping as the per-step ones:
# one hash table of the steps instead of one of every record and a second of the steps. The one
# microbatch's tokens are the step's, so em = e·N. A repeated key is then a repeated rank, counted exactly
# by the step's set of ranks: records − distinct ranks, what sum(repeated) counts in the general form.
ONE_RECORD_STEP_SQL = f"""
{RECORDS_SQL},
per_rank AS (
    SELECT *, 1 AS microbatches, CAST(valid_tokens AS BIGINT) AS rank_tokens, loss_sum AS rank_loss,
        w AS e_low, w AS e_high,
        -- read only through arg_max/arg_min keyed on e, which pass over a record without w
        micro AS heavy_micro, valid_tokens AS heavy_n, micro AS light_micro, valid_tokens AS light_n,
        w * valid_tokens AS en_low, w * valid_tokens AS en_high, sync AS last_sync
    FROM weighted
),
-- the per-rank names above are inputs here; the per-step aggregates' names (e_low, ...) are outputs
step_level AS (SELECT {STEP_KEYS}, {STEP_AGGREGATES}, {{extremes}} {RANK_AGGREGATES} FROM per_rank GROUP BY k, step)
SELECT * EXCLUDE (k) REPLACE ({ONE_RECORD_CASTS}{{extreme_casts}}),
    e_low * tokens AS em_low, e_high * tokens AS em_high FROM step_level
ORDER BY step
"""

RANK_BITS_LIMIT = 4096
"""Widest rank range the one-record-per-rank form counts distinct ranks over (a bitstring a step)."""

FOOTER_CONSTANTS: dict[frozenset[str], tuple[tuple[str, str], ...]] = {
    # min(coalesce(NULL, w) + 0·w) is min(w) bit for bit (see MEAN_WEIGHT_EXTREMES), an aggregate the
    # query holds already (DuckDB computes equal aggregates once); the spread of a NULL probe is NULL.
    frozenset({"token_weight_min", "token_weight_max"}): (
        ("min(coalesce(probe_low, w) + 0 * w) AS tok_low, max(coalesce(probe_high, w) + 0 * w) AS tok_high",
         "min(w) AS tok_low, max(w) AS tok_high"),
        ("max(probe_spread) AS probe_spread", "CAST(NULL AS DOUBLE) AS probe_spread")),
    frozenset({"token_weight_sum"}): (("count(token_weight_sum) AS probed", "0 AS probed"),),
    # no record holds a masked weight: the CASE is NULL on every record
    frozenset({"masked_weight_abs_sum"}): (("max(masked_share) AS masked_share", "CAST(NULL AS DOUBLE) AS masked_share"),),
    frozenset({"reported_loss"}): (
        ("min(reported_loss) AS reported_low, max(reported_loss) AS reported_high, count(reported_loss) AS reported",
         "CAST(NULL AS DOUBLE) AS reported_low, CAST(NULL AS DOUBLE) AS reported_high, 0 AS reported"),),
    frozenset({"skipped"}): (("count_if(skipped) AS skipped_true, count_if(NOT skipped) AS skipped_false",
                              "NULL AS skipped_true, NULL AS skipped_false"),),
    frozenset({"sync"}): (
        ("count(sync) AS sync_known, count_if(sync) AS sync_true", "0 AS sync_known, NULL AS sync_true"),
        ("arg_max(sync, micro) AS last_sync", "CAST(NULL AS BOOLEAN) AS last_sync"),
        ("count_if(last_sync = false) AS unsynced_ranks", "NULL AS unsynced_ranks")),
    frozenset({"positions"}): (
        ("min(w * positions) AS et_low, max(w * positions) AS et_high",
         "CAST(NULL AS DOUBLE) AS et_low, CAST(NULL AS DOUBLE) AS et_high"),
        ("sum(positions) AS positions, count(positions) AS positions_known", "NULL AS positions, 0 AS positions_known"),
        (f"count_if({UNUSABLE_RECORD}) AS unusable_values",
         f"count_if({UNUSABLE_WITHOUT_POSITIONS}) AS unusable_values")),
    # divisor_known defaults to true: valid_tokens > 0 AND NOT true is false (not NULL) on every record
    frozenset({"divisor_known"}): (("count_if(valid_tokens > 0 AND NOT divisor_known) AS unknown_divisor",
                                    "0 AS unknown_divisor"),),
    # one value on every record: its min and max on every step (each step has a record), as a parameter
    frozenset({"world_size="}): (("min(world_size) AS w_low, max(world_size) AS w_high",
                                  "CAST($world_size AS INTEGER) AS w_low, CAST($world_size AS INTEGER) AS w_high"),),
    frozenset({"grad_divisor="}): (("min(grad_divisor) AS d_low, max(grad_divisor) AS d_high",
                                    "CAST($grad_divisor AS DOUBLE) AS d_low, CAST($grad_divisor AS DOUBLE) AS d_high"),),
    frozenset({"micro<64"}): (("count_if(micro >= 64) AS wide_micro", "0 AS wide_micro"),),
    frozenset({"precision_bits"}): (("min(precision_bits) AS bits_low", "CAST(NULL AS INTEGER) AS bits_low"),),
}
"""Aggregates whose value the footers of a range's files already give, with that value, per fact
(`footer_facts`). A column named alone: no record holds a value of it (each file lacks it or holds only
nulls in it, `Shard.null_columns`), and each aggregate is what it gives over NULL on every record (count
0; count_if, sum, min and max NULL), typed as the query casts it. "world_size=" and "grad_divisor=": one
value on every record, passed as the parameter of that name. "micro<64": no microbatch index reaches 64.
A test checks the step tables with and without them are equal bit for bit."""

def footer_facts(shards: Sequence[Shard]) -> tuple[frozenset[str], dict[str, Any]]:
    """What the footers of these shards say of all their records, as FOOTER_CONSTANTS' facts, and the
    parameters those facts need: the columns no record holds a value of (absent or all null), the one
    world_size and grad_divisor when there is one, and whether every microbatch index is below 64."""
    facts = set(valueless_columns(shards))
    parameters: dict[str, Any] = {}
    worlds = {s.world_range for s in shards}
    if len(worlds) == 1 and (world := worlds.pop()) is not None and world[0] == world[1]:
        facts.add("world_size=")
        parameters["world_size"] = world[0]
    # D is grad_divisor where written (a shard without it has no divisor_range); exact as a double (a float,
    # or an integer a double holds exactly) and positive (0.0 and −0.0 compare equal in Python, but neither
    # is a valid divisor)
    divisors = {s.divisor_range for s in shards}
    if len(divisors) == 1 and (divisor := divisors.pop()) is not None and divisor[0] == divisor[1] and (
            isinstance(divisor[0], float) or abs(divisor[0]) < 2**53) and divisor[0] > 0:
        facts.add("grad_divisor=")
        parameters["grad_divisor"] = float(divisor[0])
    if shards and all(s.micro_range is not None and s.micro_range[1] < 64 for s in shards):
        facts.add("micro<64")
    return frozenset(facts), parameters

def valueless_columns(shards: Sequence[Shard]) -> frozenset[str]:
    """The optional columns no record of these shards holds a value of: each file lacks them or holds only
    nulls in them (`Shard.null_columns`)."""
    return frozenset(column for column in NULLABLE_COLUMNS
                     if all(column not in s.columns or column in s.null_columns for s in shards))

def step_sql(single_ranks: tuple[int, int] | None, extremes: bool = False, one_name: bool = False,
             facts: frozenset[str] = frozenset()) -> str:
    """The per-step query for these records. `single_ranks`: the (lowest, highest) rank when the footers
    show every record is microbatch 0, so that a (rank, step) holds one record unless a key is repeated.
    `extremes`: with EXTREME_COLUMNS, where each step's heaviest and lightest token were. `one_name`:
    every record has one (run, group, term), which the query then leaves out (`_aggregate` adds it).
    `facts`: what the footers say of every record (`footer_facts`): the aggregates it gives are constants."""
    if single_ranks is None:
        sql = STEP_SQL
    else:
        low, high = single_ranks
        # distinct ranks as set bits: below 64 (ranks are never negative) one word a step, a bitstring of the
        # rank range else, allocated a step
        bits = "bit_or(CAST(1 AS UBIGINT) << CAST(rank AS UBIGINT))" if high < 64 else f"bitstring_agg(rank, {low}, {high})"
        sql = ONE_RECORD_STEP_SQL.replace("{repeated}", f"count(*) - bit_count({bits})")
    key, names, record_names = ONE_NAME_KEYS if one_name else KEYS
    for needed, replacements in FOOTER_CONSTANTS.items():
        if needed <= facts:
            for aggregate, constant in replacements:
                sql = sql.replace(aggregate, constant)
    return (sql.replace("{rank_extremes}", RANK_EXTREMES if extremes else "")
            .replace("{extremes}", EXTREME_AGGREGATES if extremes else "")
            .replace("{extreme_casts}", ", " + EXTREME_CASTS if extremes else "")
            .replace("{key}", key).replace("{names}", names).replace("{record_names}", record_names))

def single_rank_range(shards: Sequence[Shard]) -> tuple[int, int] | None:
    """(lowest, highest) rank of these shards when their footers show every record is microbatch 0 (one
    record per rank and step, unless a key is repeated) over a rank range narrow enough to count as bits."""
    ranks = [s.rank_range for s in shards]
    if not shards or any(s.micro_range != (0, 0) for s in shards) or any(r is None for r in ranks):
        return None
    low, high = min(r[0] for r in ranks if r), max(r[1] for r in ranks if r)
    return (low, high) if high - low < RANK_BITS_LIMIT else None

def one_name_of(shards: Sequence[Shard]) -> tuple[str, str, str] | None:
    """The (run, group, term) of every record of these shards, when their footers show there is one."""
    names = {shard.names for shard in shards}
    return names.pop() if len(names) == 1 and None not in names else None

def footer_table(shards: Sequence[Shard], filenames: Sequence[str]) -> pa.Table:
    """The records of one-row shards of one schema as their footers give them (`Shard.record`), in the
    columns a scan of their files has: theirs (as `footer_type` holds them), `filename` and
    `file_row_number` (0, the one row)."""
    arrays: dict[str, pa.Array] = {}
    for position, (column, arrow_type) in enumerate(shards[0].signature):
        held = footer_type(arrow_type)
        values = [shard.record[position] for shard in shards if shard.record is not None]
        # a timestamp is its stored integer, in its unit
        arrays[column] = (pa.array(values, pa.int64()).cast(held) if pa.types.is_timestamp(held)
                          else pa.array(values, held))
    arrays["filename"] = pa.array(filenames, pa.string())
    arrays["file_row_number"] = pa.array(np.zeros(len(shards), dtype=np.int64))
    return pa.table(arrays)

def select_records(default_run: str, present: set[str], scan: str, where: str, override: bool = False) -> str:
    """One scan's records with the log format's defaults applied (docs/SCHEMA.md); columns its files lack are typed
    nulls. `override`: the run is `default_run` whatever run_id says (`Shard.run_override`)."""

    def column(name: str) -> str:
        kind = DUCKDB_TYPES[COLUMNS_BY_NAME[name].kind]
        return f'CAST(r."{name}" AS {kind})' if name in present else f"CAST(NULL AS {kind})"

    return f"""
        SELECT
            {sql_string(default_run) if override else f"coalesce({column('run_id')}, {sql_string(default_run)})"} AS run,
            coalesce({column('group')}, {sql_string(UNNAMED)}) AS grp,
            coalesce({column('term')}, {sql_string(UNNAMED)}) AS term,
            {column('step')} AS step, {column('micro')} AS micro, {column('rank')} AS rank,
            {column('world_size')} AS world_size,
            {column('loss_sum')} AS loss_sum, {column('valid_tokens')} AS valid_tokens,
            {column('backward_scalar')} AS backward_scalar,
            coalesce({column('grad_divisor')}, {column('world_size')}::DOUBLE) AS grad_divisor,
            coalesce({column('grad_scale')}, 1.0) AS grad_scale,
            coalesce({column('divisor_known')}, true) AS divisor_known,
            {column('positions')} AS positions,
            {column('token_weight_sum')} AS token_weight_sum,
            {column('token_weight_min')} AS token_weight_min,
            {column('token_weight_max')} AS token_weight_max,
            {column('masked_weight_abs_sum')} AS masked_weight_abs_sum,
            {column('reported_loss')} AS reported_loss,
            {column('sync')} AS sync, {column('skipped')} AS skipped, {column('time')} AS written,
            {column('precision_bits')} AS precision_bits,
            r.filename, r.file_row_number
        FROM {scan}
        {where}"""

# One scan: per (objective, step, rank) the rank's tokens and the extremes of its finite weights e, then
# N per step from those rows. With N > 0 (a step with a valid record has one) rounding is monotone, so
# min(e)·N is min(e·N) bit for bit: no record is joined to its step's N, only each rank's extremes are.
# A rank's step whose extreme q overflows (|e| past ~1e300/N) is left out whole.
RANK_WEIGHTS_SQL = """
WITH per_rank AS (
    SELECT hash(run, grp, CASE WHEN list_contains($pooled, run) THEN '' ELSE term END) AS k,
           any_value(run) AS run, step, rank, sum(valid_tokens) AS tokens,
           min(eff) FILTER (valid_tokens > 0 AND isfinite(eff)) AS e_low,
           max(eff) FILTER (valid_tokens > 0 AND isfinite(eff)) AS e_high
    FROM records GROUP BY k, step, rank),
counts AS (SELECT k, step, sum(tokens) AS tokens FROM per_rank GROUP BY k, step),
valid AS (
    SELECT p.run, p.rank, p.step, p.e_low * c.tokens AS q_low, p.e_high * c.tokens AS q_high
    FROM per_rank p JOIN counts c USING (k, step)
    WHERE p.e_low IS NOT NULL AND isfinite(p.e_low * c.tokens) AND isfinite(p.e_high * c.tokens)),
spans AS (SELECT run, min(step) AS low, max(step) AS high, max(rank) AS top FROM valid GROUP BY run)
SELECT v.run,
       CASE WHEN s.top < $rows THEN v.rank ELSE v.rank * $rows // (s.top + 1) END AS row,
       CASE WHEN s.high - s.low < $columns THEN v.step - s.low
            ELSE (v.step - s.low) * $columns // (s.high - s.low + 1) END AS col,
       min(v.rank) AS rank_first, max(v.rank) AS rank_last,
       min(v.step) AS step_first, max(v.step) AS step_last, min(q_low) AS q_low, max(q_high) AS q_high
FROM valid v JOIN spans s USING (run)
GROUP BY ALL ORDER BY v.run, row, col
"""
"""Per run, q = e·N in cells of rank rows and step columns (`Engine.rank_weights`; parameters $rows, $columns and
$pooled, the runs whose terms are one token mean)."""
