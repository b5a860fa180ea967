"""The SQL: the step query written from the declarations (`engine.columns`), and the views it reads."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import re
from dataclasses import replace

import numpy as np
import pyarrow as pa

from tokaudit._engine.columns import PARTIALS, STEP_COLUMN_BY_NAME, STEP_COLUMNS, TERMS, WEIGHT, WIDE_MICRO, Level
from tokaudit._engine.columns import Partial, StepColumn
from tokaudit._footers import footer_type
from tokaudit._reader import NULLABLE_COLUMNS, Shard
from tokaudit._storage import modified_ns
from tokaudit._schema import COLUMNS_BY_NAME, UNNAMED


DUCKDB_TYPES = {"int": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN", "string": "VARCHAR", "timestamp": "TIMESTAMPTZ"}


def sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def step_sql(
    one_record: bool,
    evidence: bool = False,
    one_name: bool = False,
    absent: frozenset[str] = frozenset(),
    declared: Sequence[StepColumn] = STEP_COLUMNS,
) -> str:
    """The per-step query, written from the declarations (`engine.columns`). `one_record`: the footers show every
    record is microbatch 0 of a rank below 64 (`one_record_form`), so a (rank, step) holds one record (unless a key
    is repeated): the per-rank values are then a projection of the records, aggregated in the one grouping by
    step, instead of a hash table of every (rank, step). `evidence`: with the EVIDENCE columns. `one_name`: every record has one (run, group, term),
    which the query then leaves out (`tables.finished` adds it). `absent`: what no record holds (`absent_values`):
    a column that reads only that is its declared `absent` value, not computed. `declared`: the columns (all but to
    time a query without some, `bench/columns.py`), with the per-rank and per-microbatch values they read.

    By step only: sorting by the names as well costs more than the rest of the query at millions of steps; the
    rare table of several (run, group, term) is sorted as categories after (`Engine.step_parts`)."""
    columns = [c for c in declared if evidence or not c.evidence]
    read = " ".join(c.aggregate for c in columns)
    partials = [
        replace(p, aggregate=p.absent, one_record=p.absent) if _gone(p, absent) else p
        for p in PARTIALS
        if (evidence or not p.evidence) and re.search(rf"\b{p.name}\b", read)
    ]
    # k stands for (run, grp, term) in the groupings: an integer hashes in a fraction of the time of three strings.
    # With one name there is no k: a constant key column still costs each grouping its hashing and its width.
    key, names = ("", "") if one_name else ("hash(run, grp, term) AS k, ", "run, grp, term, ")
    kept = "" if one_name else " any_value(run) AS run, any_value(grp) AS grp, any_value(term) AS term,"
    terms = _listed((t.expression or t.name, t.name) for t in TERMS)
    ctes = [
        f"rec AS (\n    SELECT {(key + names).rstrip()}\n        {terms}\n    FROM records)",
        f"weighted AS (\n    SELECT *, {WEIGHT.expression} AS {WEIGHT.name}\n    FROM rec)",
    ]
    by = "step" if one_name else "k, step"
    more, joined = (
        _projected(columns, partials, absent, kept, by) if one_record else _grouped(columns, partials, absent, kept, by)
    )
    return (
        "WITH " + ",\n".join(ctes + more) + f"\nSELECT {names}step,\n    {_selected(columns, one_record, absent)}\n"
        f"FROM {joined}\nORDER BY step\n"
    )


def _projected(
    columns: list[StepColumn], partials: list[Partial], absent: frozenset[str], kept: str, by: str
) -> tuple[list[str], str]:
    """The one-record form's CTEs after `weighted`, and what the final SELECT reads: the per-rank values a projection
    of each record, every column aggregated in the one grouping by step."""
    projected = [p for p in partials if p.level is Level.RANK and p.one_record]
    aggregated = [c for c in columns if not c.one_record and not _gone(c, absent)]
    return [
        f"per_rank AS (\n    SELECT *, {_listed((p.one_record, p.name) for p in projected)}\n    FROM weighted)",
        f"step_level AS (\n    SELECT {by},{kept}\n        "
        f"{_listed((c.aggregate, c.name) for c in aggregated)}\n"
        f"    FROM per_rank GROUP BY {by})",
    ], "step_level"


def _grouped(
    columns: list[StepColumn], partials: list[Partial], absent: frozenset[str], kept: str, by: str
) -> tuple[list[str], str]:
    """The general form's CTEs after `weighted`, and what the final SELECT reads: a grouping `by` step, and one by
    (step, rank) and by (step, microbatch) reduced again by step, joined."""

    def level(name: str, rows: str, of: Level) -> str:
        aggregates = [(c.aggregate, c.name) for c in columns if c.level is of and not _gone(c, absent)]
        return (
            f"{name} AS (\n    SELECT {by},{kept if of is Level.STEP else ''}\n        "
            f"{_listed(aggregates)}\n    FROM {rows} GROUP BY {by})"
        )

    def partial(name: str, of: Level, within: str) -> str:
        return (
            f"{name} AS (\n    SELECT {by}, {within},\n        "
            f"{_listed((p.aggregate, p.name) for p in partials if p.level is of)}\n"
            f"    FROM weighted GROUP BY {by}, {within})"
        )

    ctes, joined = [level("step_level", "weighted", Level.STEP)], "step_level"
    for of, within, join in ((Level.RANK, "rank", "JOIN"), (Level.MICRO, "micro", "LEFT JOIN")):
        if any(c.level is of and not _gone(c, absent) for c in columns):  # (bench/columns.py drops levels)
            ctes += [partial(of.value, of, within), level(f"{within}_level", of.value, of)]
            joined += f" {join} {within}_level USING ({by})"
    return ctes, joined


def _selected(columns: list[StepColumn], one_record: bool, absent: frozenset[str]) -> str:
    """The final SELECT's columns: each computed one (its declared type where it has one), its `absent` value or
    its one-record expression; not those held beside the query (`aliases`, `constants`)."""
    held = {**aliases(one_record, absent), **constants(one_record, absent)}
    outputs = [
        (c.absent if _gone(c, absent) else c.one_record if one_record and c.one_record else c.name, c)
        for c in columns
        if c.name not in held
    ]
    return ",\n    ".join(
        f"CAST({value} AS {c.type}) AS {c.name}" if c.type else (c.name if value == c.name else f"{value} AS {c.name}")
        for value, c in outputs
    )


def _listed(pairs: Iterable[tuple[str, str]]) -> str:
    """`expression AS name`, one a line (a record's own column by its name alone)."""
    return ",\n        ".join(name if expression == name else f"{expression} AS {name}" for expression, name in pairs)


_NULLS = ("NULL", "CAST(NULL AS DOUBLE)")
FETCHED_TYPES: dict[str | None, type[np.generic]] = {"INTEGER": np.int32, "BIGINT": np.int64, None: np.float64}
"""The numpy type DuckDB fetches a column of each declared type as (without NULLs; with them, float64)."""


def constants(one_record: bool, absent: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
    """Columns whose value in this form is a literal (an `absent` 0 or NULL, a `one_record` 1): the query leaves
    them out and `tables.finished` holds the value, as one element of the type a fetched column of it would have
    (a NULL as float64's NaN, as a fetched column of NULLs becomes; a count as its declared integer)."""
    found = {}
    for c in STEP_COLUMNS:
        value = c.absent if _gone(c, absent) else c.one_record if one_record and c.one_record else None
        if value in _NULLS:
            found[c.name] = np.array([np.nan])
        elif value is not None and value.isdigit():
            found[c.name] = np.array([int(value)], dtype=FETCHED_TYPES[c.type or None])
    return found


def aliases(one_record: bool, absent: frozenset[str] = frozenset()) -> dict[str, str]:
    """Columns that are another column's very array in this form (a `one_record` or `absent` value that names a
    column): the query leaves them out and `tables.finished` holds the one array for both."""
    found = {c.name: c.absent for c in STEP_COLUMNS if _gone(c, absent) and c.absent in STEP_COLUMN_BY_NAME}
    if one_record:
        found.update({c.name: c.one_record for c in STEP_COLUMNS if c.one_record in STEP_COLUMN_BY_NAME})
    return found


def _gone(declared: StepColumn | Partial, absent: frozenset[str]) -> bool:
    """No record holds a value of what this column reads: it is its `absent` value."""
    return bool(declared.reads) and absent.issuperset(declared.reads)


def one_record_form(shards: Sequence[Shard]) -> bool:
    """The footers of these shards show every record is microbatch 0, of a rank below 64: a (rank, step) holds one
    record unless a key is repeated, and the step's ranks fit the bits of one word (`step_sql`'s `one_record`)."""
    return bool(shards) and all(
        s.micro_range == (0, 0) and s.rank_range is not None and s.rank_range[1] < 64 for s in shards
    )


def valueless_columns(shards: Sequence[Shard]) -> frozenset[str]:
    """The optional columns no record of these shards holds a value of: each file lacks them or holds only
    nulls in them (`Shard.null_columns`)."""
    return frozenset(
        column
        for column in NULLABLE_COLUMNS
        if all(column not in s.columns or column in s.null_columns for s in shards)
    )


def absent_values(shards: Sequence[Shard]) -> frozenset[str]:
    """What no record of these shards holds, by their footers (`StepColumn.reads`): the valueless optional columns,
    `term_weight` where no file has the column (every λ its default, 1), and WIDE_MICRO where no microbatch index
    reaches 64."""
    narrow = bool(shards) and all(s.micro_range is not None and s.micro_range[1] < 64 for s in shards)
    undeclared = bool(shards) and all("term_weight" not in s.columns for s in shards)
    return (
        valueless_columns(shards)
        | (frozenset({WIDE_MICRO}) if narrow else frozenset())
        | (frozenset({"term_weight"}) if undeclared else frozenset())
    )


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
        arrays[column] = (
            pa.array(values, pa.int64()).cast(held) if pa.types.is_timestamp(held) else pa.array(values, held)
        )
    arrays["filename"] = pa.array(filenames, pa.string())
    arrays["file_row_number"] = pa.array(np.zeros(len(shards), dtype=np.int64))
    return pa.table(arrays)


def parquet_scan(files: list[str], one_schema: bool) -> str:
    """DuckDB's scan of these files as `r`, with each record's `filename` and `file_row_number`. Files of one schema
    (all a recorder writes) need no union_by_name, which would read every file's footer when the query is bound, at
    every (re)definition of the view. Hive partitioning off: DuckDB would otherwise take a `rank=0` folder's value
    over the file's own column, and add one the file lacks without the checks of `partitions` (`file_order_table`
    gives those)."""
    listed = "[" + ", ".join(sql_string(file) for file in files) + "]"
    return (
        f"read_parquet({listed}, union_by_name = {str(not one_schema).lower()}, filename = true, "
        "file_row_number = true, hive_partitioning = false) r"
    )


def file_order_table(shards: Sequence[Shard], names: dict[int, str]) -> pa.Table:
    """Each file (by its name for DuckDB, `names` by shard id) with its place in the order of publication and the
    values its folders give (`Shard.partition`, as columns named GIVEN + the column), which its scan joins. Among
    duplicates the later published wins (`publication_order`)."""
    order = publication_order(shards)
    launches = [-1 if s.provenance.launch is None else s.provenance.launch for s in shards]
    published = [shards[i] for i in order]
    given = {column: COLUMNS_BY_NAME[column].arrow_type for s in shards for column, _ in s.partition}
    return pa.table(
        {
            "filename": [names[id(shard)] for shard in published],
            "file_index": pa.array(range(len(published)), pa.int64()),
            "launch": pa.array([launches[i] for i in order], pa.int64()),
            # each file's default run, and whether it stands over run_id (`select_records`' joined form)
            f"{GIVEN}run": pa.array([shard.default_run for shard in published], pa.string()),
            f"{GIVEN}override": pa.array([shard.run_override for shard in published], pa.bool_()),
            **{
                f"{GIVEN}{column}": pa.array([dict(shard.partition).get(column) for shard in published], kind)
                for column, kind in given.items()
            },
        }
    )


def publication_order(shards: Sequence[Shard]) -> list[int]:
    """The shards' indices in the order of publication; of two copies of a record, the later published is kept. The
    later launch (the one whose first shard came after the other's; -1 for a file that does not say), then the later
    file of it; of files that do not say (other writers', whose names need not follow the order they were written
    in: pyarrow's UUIDs), the one modified last."""
    launches = [-1 if s.provenance.launch is None else s.provenance.launch for s in shards]
    written = [modified_ns(s.path, s.store) if launches[i] < 0 else 0 for i, s in enumerate(shards)]
    return sorted(range(len(shards)), key=lambda i: (launches[i], written[i], i))


def select_records(default_run: str | None, present: set[str], scan: str, where: str, override: bool = False) -> str:
    """One scan's records with the log format's defaults applied (docs/SCHEMA.md); columns its files lack are typed
    nulls. `override`: the run is `default_run` whatever run_id says (`Shard.run_override`). `default_run` None: each
    file's own, joined from `file_order` (`given(..., runs=True)`), for a scan of the files of many runs."""

    def column(name: str) -> str:
        kind = DUCKDB_TYPES[COLUMNS_BY_NAME[name].kind]
        return f'CAST(r."{name}" AS {kind})' if name in present else f"CAST(NULL AS {kind})"

    if default_run is None:
        run = f'CASE WHEN r."{GIVEN}override" THEN r."{GIVEN}run" ELSE coalesce({column("run_id")}, r."{GIVEN}run") END'
    elif override:
        run = sql_string(default_run)
    else:
        run = f"coalesce({column('run_id')}, {sql_string(default_run)})"
    return f"""
        SELECT
            {run} AS run,
            coalesce({column("group")}, {sql_string(UNNAMED)}) AS grp,
            coalesce({column("term")}, {sql_string(UNNAMED)}) AS term,
            {column("step")} AS step, {column("micro")} AS micro, {column("rank")} AS rank,
            {column("world_size")} AS world_size,
            {column("loss_sum")} AS loss_sum, {column("valid_tokens")} AS valid_tokens,
            {column("backward_scalar")} AS backward_scalar,
            coalesce({column("grad_divisor")}, {column("world_size")}::DOUBLE) AS grad_divisor,
            coalesce({column("grad_scale")}, 1.0) AS grad_scale,
            coalesce({column("term_weight")}, 1.0) AS term_weight,
            coalesce({column("divisor_known")}, true) AS divisor_known,
            {column("positions")} AS positions,
            {column("token_weight_sum")} AS token_weight_sum,
            {column("token_weight_min")} AS token_weight_min,
            {column("token_weight_max")} AS token_weight_max,
            {column("masked_weight_abs_sum")} AS masked_weight_abs_sum,
            {column("reported_loss")} AS reported_loss,
            {column("sync")} AS sync, {column("skipped")} AS skipped, {column("time")} AS written,
            {column("precision_bits")} AS precision_bits,
            r.filename, r.file_row_number
        FROM {scan}
        {where}"""


def records_view(dedup: str, source: str = "raw_records") -> str:
    """The view `records`: `source`'s records (each key once, by `dedup`'s clause) with each record's c and e.

    c: implied weight per valid token before reduction = probe Σ∂b/∂ℓ / n, else b/S. e = c·g/(D·λ): effective
    weight after the reduction, relative to the term's declared weight λ (1 unless declared). Correct iff e·N = 1.
    λ = 0, a term switched off on purpose (a warm-up), weighs its tokens 0 whatever the normalization: no e where
    c = 0; where c ≠ 0 the term was not off, and its weight is judged as a token mean's (λ = 1)."""
    c = """CASE WHEN valid_tokens > 0 THEN
                CASE WHEN token_weight_sum IS NOT NULL THEN token_weight_sum / valid_tokens
                     WHEN loss_sum <> 0 THEN backward_scalar / loss_sum END
            END"""
    return f"""
        CREATE OR REPLACE TEMP VIEW records AS
        SELECT *, {c} AS c,
            {c} * grad_scale / grad_divisor / CASE WHEN term_weight <> 0 THEN term_weight WHEN {c} <> 0 THEN 1 END AS eff
        FROM {source} {dedup}"""


RUN_SCANS = 16
"""The most scans of one default run each (`Engine._source`) a query unions: each holds buffers of its own in the
records' materialized CTE, so memory would grow with the runs of a folder, not its records; past it a scan reads
every run's files of a schema, each file's run joined from `file_order`."""

GIVEN = "given_"
"""`file_order`'s columns of the values files' folders give are named so: apart from the records' own."""


def given(scan: str, shard: Shard, runs: bool = False) -> str:
    """A scan (as `r`) of files whose folders give columns (`Shard.partition`; every shard of a scan has the same),
    each record given their values from `file_order` (`file_order_table`): one scan of every folder's files. `runs`:
    each record given its file's default run as well (`select_records`' joined form)."""
    columns = [f'o."{GIVEN}{column}" AS "{column}"' for column, _ in shard.partition]
    columns += [f'o."{GIVEN}run"', f'o."{GIVEN}override"'] if runs else []
    if not columns:
        return scan
    return f"(SELECT r.*, {', '.join(columns)} FROM {scan} JOIN file_order o USING (filename)) r"


# One scan: per (objective, step, rank) the rank's tokens and the extremes of its finite weights e, then
# N per step from those rows. With N > 0 (a step with a valid record has one) rounding is monotone, so
# min(e)·N is min(e·N) bit for bit: no record is joined to its step's N, only each rank's extremes are.
# A rank's step whose extreme q overflows (|e| past ~1e300/N) is left out whole.
RANK_WEIGHTS_SQL = """
WITH per_rank AS (
    SELECT hash(run, grp, CASE WHEN list_contains($pooled, run) THEN '' ELSE term END) AS k,
           any_value(run) AS run, step, rank, sum(valid_tokens) AS tokens,
           min(eff) FILTER (valid_tokens > 0 AND isfinite(eff) AND divisor_known) AS weight_low,
           max(eff) FILTER (valid_tokens > 0 AND isfinite(eff) AND divisor_known) AS weight_high
    FROM records GROUP BY k, step, rank),
counts AS (SELECT k, step, sum(tokens) AS tokens FROM per_rank GROUP BY k, step),
valid AS (
    SELECT p.run, p.rank, p.step, p.weight_low * c.tokens AS q_low, p.weight_high * c.tokens AS q_high
    FROM per_rank p JOIN counts c USING (k, step)
    WHERE p.weight_low IS NOT NULL AND isfinite(p.weight_low * c.tokens) AND isfinite(p.weight_high * c.tokens)),
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
$pooled, the runs whose terms are one token mean); a record whose D the recorder could not see has no q."""

RECORDS_AT_SQL = """
SELECT grp, term, rank, micro, world_size, valid_tokens, loss_sum, backward_scalar,
       CASE WHEN divisor_known THEN grad_divisor END AS grad_divisor,
       grad_scale, term_weight, c AS implied_weight,
       CASE WHEN divisor_known THEN eff END AS eff,
       CASE WHEN divisor_known THEN eff * sum(valid_tokens) OVER (PARTITION BY grp, term) END AS q,
       CASE WHEN divisor_known THEN token_weight_min * grad_scale / grad_divisor / nullif(term_weight, 0) END AS eff_min,
       CASE WHEN divisor_known THEN token_weight_max * grad_scale / grad_divisor / nullif(term_weight, 0) END AS eff_max,
       sync, reported_loss
FROM records WHERE run = ? AND step = ? ORDER BY grp, term, rank, micro
"""
"""Every record of one step of one run (parameters: run, step), with c, e and q = e·N (`Engine.records_at`); D, e
and q NULL where the recorder could not see D (`divisor_known`): the default W it stands for is no measurement."""

COMPLETE_THROUGH_SQL = """
SELECT run, grp, min(last_step) FROM (
    SELECT run, grp, rank, max(step) AS last_step FROM raw_records GROUP BY run, grp, rank)
JOIN (SELECT run, grp, arg_max(world_size, step) AS world_now FROM raw_records GROUP BY run, grp) USING (run, grp)
WHERE rank < world_now
GROUP BY run, grp
"""
"""Per (run, group): the last step every rank of its latest W has recorded (`Engine.complete_through`); a rank a
resize left (rank ≥ the W of the newest step) is waited for no more."""


KEPT = "PARTITION BY run, grp, term, step, rank, micro ORDER BY file_index DESC, file_row_number DESC"
"""Of two records with one key, the later published is kept: the later file (a rank's shards are numbered in the order
they were written, a resumed launch's after the earlier's), then the later row; the first in this window. Never `time`:
a node whose clock runs ahead would win over the launch that replaced it."""

LAUNCHED_VIEW = """
CREATE OR REPLACE TEMP VIEW launched AS
SELECT *, NOT latest OR rank >= min(CASE WHEN replayed AND latest THEN world_size END)
                                OVER (PARTITION BY run, grp, step) IS TRUE AS superseded
FROM (
    SELECT *, launch = max(launch) OVER rank_step AS latest,
              min(launch) OVER rank_step < max(launch) OVER rank_step
              AND min(world_size) OVER rank_step < max(world_size) OVER rank_step AS replayed
    FROM raw_records LEFT JOIN file_order USING (filename)
    WINDOW rank_step AS (PARTITION BY run, grp, step, rank))
"""
"""`raw_records` with their files' order and whether a later launch superseded each: a rank's step that two launches
recorded is the later one's alone (the earlier's other microbatches are no part of it), and where a later launch of
W' recorded a step again, the step's records of ranks ≥ W' are an earlier launch's (a run resumed on fewer ranks). A
rank is recorded again with another W by a later launch (a copy of its records, a pandas backup, says the same W and
drops nothing; an earlier launch's files may say no launch). W' is the least W of the latest records of the ranks
recorded again: a rank below the latest launch's W has that launch as its latest, one past it an earlier launch of a
W above its rank (4 → 3 → 2: rank 2's latest says 3)."""

# per run: the copies, where, whether every copy holds the kept record's values, and its time, and whether a copy lies
# in a file that does not say which launch wrote it; and the records of
# an earlier launch's (step, rank) that a later launch recorded again, their own key repeated by none (the dedup of
# `Engine._define` leaves them out with the copies)
DUPLICATES_SQL = f"""
WITH superseded AS (
    SELECT run, count(*) FILTER (kept AND superseded) AS superseded,
           list(DISTINCT filename) FILTER (superseded) AS superseded_files
    FROM (SELECT run, superseded, filename, row_number() OVER ({KEPT}) = 1 AS kept FROM launched)
    GROUP BY run)
SELECT run, sum(copies - 1), min(step), max(step), count(DISTINCT step),
       list_distinct(flatten(list(files))),
       bool_and(values_seen = 1), bool_and(times_seen = 1), bool_or(len(files) = 1),
       coalesce(any_value(superseded), 0), bool_or(unlaunched),
       list_sort(list_distinct(list_concat(flatten(list(list_filter(files, lambda f: f <> kept))),
                                           coalesce(any_value(superseded_files), [])))) FROM (
    SELECT run, step, count(*) AS copies, list(DISTINCT filename) AS files, arg_max(filename, file_index) AS kept,
           count(DISTINCT (loss_sum, valid_tokens, backward_scalar, token_weight_sum, token_weight_min,
                           token_weight_max, masked_weight_abs_sum, grad_scale, grad_divisor, term_weight,
                           world_size, sync, skipped)) AS values_seen,
           count(DISTINCT coalesce(written, TIMESTAMP '1970-01-01')) AS times_seen,
           bool_or(coalesce(launch, -1) < 0) AS unlaunched
    FROM raw_records LEFT JOIN file_order USING (filename)
    GROUP BY run, grp, term, step, rank, micro HAVING count(*) > 1)
LEFT JOIN superseded USING (run)
GROUP BY run
"""
"""Per run, the repeated (run, group, term, step, rank, micro) keys of `raw_records` (`Engine._find_duplicates`), every
file that holds a copy, and every file that holds a record left out (a copy: the later published is kept; or one a later
launch superseded, `LAUNCHED_VIEW`)."""
