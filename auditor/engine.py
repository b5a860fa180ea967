"""DuckDB over the shards: per-record weights aggregated to one row per (run, group, step).

Memory stays bounded however large the log: DuckDB streams the Parquet files, aggregates
spill to disk past `memory_limit`, and only the per-step table (one row per optimizer step and
group) comes back to Python.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import duckdb
import pandas as pd

from tokaudit.reader import Shard
from tokaudit.schema import COLUMNS_BY_NAME, REQUIRED_COLUMNS

DEFAULT_MEMORY_LIMIT = os.environ.get("TOKAUDIT_MEMORY_LIMIT", "768MB")
DUCKDB_TYPES = {"int": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN", "string": "VARCHAR",
                "timestamp": "TIMESTAMPTZ"}


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass
class Engine:
    """A DuckDB connection with the view `records`: one row per record, defaults applied, deduplicated."""

    connection: duckdb.DuckDBPyConnection
    duplicates: dict[str, tuple[int, int, int, int]]
    """Per run: (records dropped, first step, last step, steps) where a (run, group, step, micro, rank)
    key appeared more than once."""

    @classmethod
    def open(cls, shards: Sequence[Shard], memory_limit: str = DEFAULT_MEMORY_LIMIT,
             threads: int | None = None) -> Engine:
        connection = duckdb.connect(":memory:", config={"memory_limit": memory_limit,
                                                        "temp_directory": tempfile.gettempdir(),
                                                        "preserve_insertion_order": False})
        try:
            return cls._prepare(connection, shards, threads)
        except BaseException:
            connection.close()
            raise

    @classmethod
    def _prepare(cls, connection: duckdb.DuckDBPyConnection, shards: Sequence[Shard], threads: int | None
                 ) -> Engine:
        if threads:
            connection.execute(f"SET threads = {int(threads)}")
        connection.execute("CREATE TEMP TABLE shard_files (filename VARCHAR, default_run VARCHAR, file_index INTEGER)")
        connection.executemany("INSERT INTO shard_files VALUES (?, ?, ?)",
                               [(str(s.path), s.default_run, i) for i, s in enumerate(shards)])
        present = set().union(*(s.columns for s in shards)) if shards else set(REQUIRED_COLUMNS)
        file_list = "[" + ", ".join(_sql_string(str(s.path)) for s in shards) + "]"

        def column(name: str) -> str:
            kind = DUCKDB_TYPES[COLUMNS_BY_NAME[name].kind]
            return f'CAST(r."{name}" AS {kind})' if name in present else f"CAST(NULL AS {kind})"

        # c: implied weight per valid token before reduction = probe Σ∂b/∂ℓ / n, else b/S.
        # e = c·g/D: effective weight after the reduction. Correct iff e·N = 1.
        connection.execute(f"""
            CREATE TEMP VIEW raw_records AS
            SELECT
                coalesce({column('run_id')}, f.default_run) AS run,
                coalesce({column('group')}, '0') AS grp,
                {column('step')} AS step, {column('micro')} AS micro, {column('rank')} AS rank,
                {column('world_size')} AS world_size,
                {column('loss_sum')} AS loss_sum, {column('valid_tokens')} AS valid_tokens,
                {column('backward_scalar')} AS backward_scalar,
                coalesce({column('grad_divisor')}, {column('world_size')}::DOUBLE) AS grad_divisor,
                coalesce({column('grad_scale')}, 1.0) AS grad_scale,
                {column('positions')} AS positions,
                {column('token_weight_sum')} AS token_weight_sum,
                {column('token_weight_min')} AS token_weight_min,
                {column('token_weight_max')} AS token_weight_max,
                {column('masked_weight_abs_sum')} AS masked_weight_abs_sum,
                {column('reported_loss')} AS reported_loss,
                {column('sync')} AS sync, {column('skipped')} AS skipped, {column('time')} AS written,
                f.file_index, r.file_row_number
            FROM read_parquet({file_list}, union_by_name = true, filename = true, file_row_number = true) r
            JOIN shard_files f ON r.filename = f.filename
        """ if shards else "CREATE TEMP VIEW raw_records AS SELECT 1 WHERE false")
        duplicates: dict[str, tuple[int, int, int, int]] = {}
        if shards:
            for run, copies, first, last, steps in connection.execute("""
                SELECT run, sum(copies - 1), min(step), max(step), count(DISTINCT step) FROM (
                    SELECT run, step, count(*) AS copies FROM raw_records
                    GROUP BY run, grp, step, rank, micro HAVING count(*) > 1)
                GROUP BY run
            """).fetchall():
                duplicates[run] = (int(copies), int(first), int(last), int(steps))
        # Of two records with one key, the later `time` wins, then the later file and row.
        dedup = ("QUALIFY row_number() OVER (PARTITION BY run, grp, step, rank, micro "
                 "ORDER BY written DESC NULLS LAST, file_index DESC, file_row_number DESC) = 1") if duplicates else ""
        connection.execute(f"""
            CREATE TEMP VIEW records AS
            SELECT *,
                CASE WHEN valid_tokens > 0 THEN
                    CASE WHEN token_weight_sum IS NOT NULL THEN token_weight_sum / valid_tokens
                         WHEN loss_sum <> 0 THEN backward_scalar / loss_sum END
                END * grad_scale / grad_divisor AS eff
            FROM raw_records {dedup}
        """)
        return cls(connection=connection, duplicates=duplicates)

    def step_table(self, rtol: float) -> pd.DataFrame:
        """One row per (run, grp, step) with everything the checks need (see columns below)."""
        return self.connection.execute(STEP_SQL, {"rtol": rtol}).df()

    def records_at(self, run: str, step: int) -> pd.DataFrame:
        """Every record of one step of one run, with c, e and q = e·N."""
        return self.connection.execute("""
            SELECT grp, rank, micro, world_size, valid_tokens, loss_sum, backward_scalar, grad_divisor,
                   grad_scale, eff * grad_divisor / grad_scale AS implied_weight, eff,
                   eff * sum(valid_tokens) OVER (PARTITION BY grp) AS q,
                   token_weight_min * grad_scale / grad_divisor AS eff_min,
                   token_weight_max * grad_scale / grad_divisor AS eff_max,
                   sync, reported_loss
            FROM records WHERE run = ? AND step = ? ORDER BY grp, rank, micro
        """, [run, step]).df()

    def ranks_at(self, run: str, group: str, step: int) -> list[int]:
        """Ranks that recorded one step of one group."""
        rows = self.connection.execute(
            "SELECT DISTINCT rank FROM records WHERE run = ? AND grp = ? AND step = ? ORDER BY rank",
            [run, group, step]).fetchall()
        return [int(row[0]) for row in rows]

    def close(self) -> None:
        self.connection.close()


# Per-record weights e are only defined for valid records (n > 0) with a finite value.
STEP_SQL = """
WITH flagged AS (
    SELECT *,
        valid_tokens > 0 AND NOT (isfinite(loss_sum) AND coalesce(isfinite(backward_scalar), true)
            AND coalesce(isfinite(token_weight_sum), true) AND coalesce(isfinite(token_weight_min), true)
            AND coalesce(isfinite(token_weight_max), true)) AS nonfinite_valid,
        valid_tokens = 0 AND NOT (coalesce(isfinite(backward_scalar), true)
            AND coalesce(isfinite(token_weight_sum), true)) AS nonfinite_zero
    FROM records
),
rec AS (
    SELECT *,
        valid_tokens > 0 AND isfinite(eff) AND NOT nonfinite_valid AS weighted,
        coalesce(token_weight_min * grad_scale / grad_divisor, eff) AS eff_low,
        coalesce(token_weight_max * grad_scale / grad_divisor, eff) AS eff_high,
        token_weight_max - token_weight_min > $rtol * abs(token_weight_max) AS probe_nonuniform,
        masked_weight_abs_sum > 0 AND masked_weight_abs_sum > $rtol * coalesce(abs(eff * grad_divisor / grad_scale), 0)
            AS masked_weighted
    FROM flagged
),
per_rank AS (
    SELECT run, grp, step, rank,
        count(*) AS microbatches,
        sum(valid_tokens) AS rank_tokens,
        sum(loss_sum) AS rank_loss,
        min(world_size) AS w_low, max(world_size) AS w_high,
        min(grad_divisor) AS d_low, max(grad_divisor) AS d_high,
        min(valid_tokens) AS n_low, max(valid_tokens) AS n_high,
        min(eff) FILTER (weighted) AS e_low, max(eff) FILTER (weighted) AS e_high,
        min(eff * valid_tokens) FILTER (weighted) AS en_low, max(eff * valid_tokens) FILTER (weighted) AS en_high,
        min(eff * positions) FILTER (weighted) AS et_low, max(eff * positions) FILTER (weighted) AS et_high,
        min(eff_low) FILTER (weighted) AS tok_low, max(eff_high) FILTER (weighted) AS tok_high,
        arg_min({'micro': micro, 'n': valid_tokens, 'e': eff}, eff) FILTER (weighted) AS lightest,
        arg_max({'micro': micro, 'n': valid_tokens, 'e': eff}, eff) FILTER (weighted) AS heaviest,
        count(*) FILTER (weighted) AS weighted_records,
        sum(CASE WHEN weighted THEN eff * loss_sum ELSE 0 END) AS objective,
        count(*) FILTER (nonfinite_valid) AS nonfinite_valid,
        count(*) FILTER (nonfinite_zero) AS nonfinite_zero,
        count(*) FILTER (probe_nonuniform) AS probe_nonuniform,
        count(*) FILTER (masked_weighted) AS masked_weighted,
        count(token_weight_sum) AS probed,
        arg_max(sync, micro) AS last_sync,
        count(sync) AS sync_known,
        count(*) FILTER (sync) AS sync_true,
        count(*) FILTER (skipped) AS skipped_true,
        count(*) FILTER (NOT skipped) AS skipped_false,
        min(reported_loss) AS reported_low, max(reported_loss) AS reported_high, count(reported_loss) AS reported,
        sum(positions) AS rank_positions, count(positions) AS positions_known
    FROM rec GROUP BY run, grp, step, rank
),
per_micro AS (
    SELECT run, grp, step, micro,
        sum(valid_tokens) AS micro_tokens,
        min(eff) FILTER (weighted) AS e_low, max(eff) FILTER (weighted) AS e_high
    FROM rec GROUP BY run, grp, step, micro
),
micro_step AS (
    SELECT run, grp, step,
        min(e_low * micro_tokens) AS em_low, max(e_high * micro_tokens) AS em_high
    FROM per_micro GROUP BY run, grp, step
)
SELECT s.*, m.em_low, m.em_high FROM (
    SELECT run, grp, step,
        count(*) AS ranks, max(rank) AS rank_max,
        sum(microbatches) AS records,
        min(microbatches) AS m_low, max(microbatches) AS m_high,
        min(w_low) AS w_low, max(w_high) AS w_high,
        min(d_low) AS d_low, max(d_high) AS d_high,
        min(n_low) AS n_low, max(n_high) AS n_high,
        sum(rank_tokens) AS tokens, sum(rank_loss) AS loss,
        avg(rank_loss / rank_tokens) FILTER (rank_tokens > 0) AS mean_of_local_means,
        min(e_low) AS e_low, max(e_high) AS e_high,
        min(en_low) AS en_low, max(en_high) AS en_high,
        min(en_low * microbatches) AS enm_low, max(en_high * microbatches) AS enm_high,
        min(e_low * rank_tokens) AS er_low, max(e_high * rank_tokens) AS er_high,
        min(et_low) AS et_low, max(et_high) AS et_high,
        min(tok_low) AS tok_low, max(tok_high) AS tok_high,
        arg_min({'rank': rank, 'micro': lightest.micro, 'n': lightest.n, 'e': lightest.e, 'rank_tokens': rank_tokens,
                 'microbatches': microbatches}, e_low) AS lightest,
        arg_max({'rank': rank, 'micro': heaviest.micro, 'n': heaviest.n, 'e': heaviest.e, 'rank_tokens': rank_tokens,
                 'microbatches': microbatches}, e_high) AS heaviest,
        sum(weighted_records) AS weighted_records,
        sum(objective) AS objective,
        sum(nonfinite_valid) AS nonfinite_valid, sum(nonfinite_zero) AS nonfinite_zero,
        sum(probe_nonuniform) AS probe_nonuniform, sum(masked_weighted) AS masked_weighted,
        sum(probed) AS probed,
        count(*) FILTER (last_sync = false) AS unsynced_ranks,
        sum(sync_known) AS sync_known, sum(sync_true) AS sync_true,
        sum(skipped_true) AS skipped_true, sum(skipped_false) AS skipped_false,
        min(reported_low) AS reported_low, max(reported_high) AS reported_high, sum(reported) AS reported,
        sum(rank_positions) AS positions, sum(positions_known) AS positions_known
    FROM per_rank GROUP BY run, grp, step
) s LEFT JOIN micro_step m USING (run, grp, step)
ORDER BY run, grp, step
"""
