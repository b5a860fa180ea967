"""DuckDB over the shards: per-record weights aggregated to one row per (run, group, term, step).

Memory stays bounded however large the log: DuckDB streams the Parquet files, aggregates
spill to disk past `memory_limit`, and only the per-step table (one row per optimizer step and
group) comes back to Python.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
from pandas.api.types import union_categoricals

from tokaudit.errors import UsageError
from tokaudit.grid import Grid, grid_table, grids_of
from tokaudit.heap import trim_heap
from tokaudit.reader import NULLABLE_COLUMNS, Shard, footer_type
from tokaudit.schema import COLUMNS_BY_NAME, UNNAMED

DEFAULT_MEMORY_LIMIT = "768MB"
CHUNK_ROWS = 1_000_000
CHUNK_STEPS = 62_500
"""Steps aggregated at a time at most: a range's share of the step table and of DuckDB's groups."""
GRID_BLOCK_ROWS = 1 << 18
"""Records of a grid reduced at a time (`tokaudit.grid`): its temporaries, about 25 arrays of them, stay small."""
WHOLE_SEGMENT_ROWS = 5
"""Files that overlap in steps are aggregated together, never read twice, up to this many times the
chunk's rows (1,024 ranks' recorder shards, 4·10⁶ records, are one such segment)."""
_PLAIN_PATH = re.compile(r"^[A-Za-z0-9._/+=,@%:-]+$")
"""Paths DuckDB reads literally (no pattern, no escape): others are given to it through a link."""
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB|%)\s*$", re.IGNORECASE)
"""A size DuckDB reads: a number and a unit (it refuses a number alone), or a share of the memory."""


def settings_from_environment() -> tuple[str, int]:
    """(memory limit, chunk rows) from TOKAUDIT_MEMORY_LIMIT and TOKAUDIT_CHUNK_ROWS, checked."""
    memory = os.environ.get("TOKAUDIT_MEMORY_LIMIT", DEFAULT_MEMORY_LIMIT)
    if not _MEMORY.match(memory):
        raise UsageError(f"TOKAUDIT_MEMORY_LIMIT={memory!r} is not a size (examples: 768MB, 2GiB)")
    chunk = os.environ.get("TOKAUDIT_CHUNK_ROWS", str(CHUNK_ROWS))
    if not chunk.strip().isdigit() or int(chunk) < 1:
        raise UsageError(f"TOKAUDIT_CHUNK_ROWS={chunk!r} is not a positive whole number of rows")
    return memory.strip(), int(chunk)
DUCKDB_TYPES = {"int": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN", "string": "VARCHAR",
                "timestamp": "TIMESTAMPTZ"}


_QUIET_IO = {"async_threads": 0}
"""Settings a DuckDB that knows them takes. DuckDB 2 starts 8 threads of its own for asynchronous I/O in every
database, whatever `threads` says; on local files they only wake and sleep, taking CPU from the query."""


_NAN_SAFE = "SET parquet_can_have_nan = true"
"""DuckDB 2 takes a float column's footer statistics for the truth unless told otherwise: on a file whose
statistics say min = max = 1.0 (pyarrow leaves NaN out of them and writes no NaN count), `WHERE isnan(x)`
skips the row group and finds nothing, and max(x) is 1.0. A NaN is what the audit looks for."""


def _connect(config: dict[str, Any]) -> duckdb.DuckDBPyConnection:
    """An in-memory database with `config`, and `_QUIET_IO` and `_NAN_SAFE` where this DuckDB has them."""
    try:
        connection = duckdb.connect(":memory:", config={**config, **_QUIET_IO})
    except duckdb.Error:  # a DuckDB before them: an unknown setting
        connection = duckdb.connect(":memory:", config=config)
    try:
        connection.execute(_NAN_SAFE)
    except duckdb.Error:  # a DuckDB without the setting
        pass
    return connection


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass
class Engine:
    """A DuckDB connection with the view `records`: one row per record, defaults applied, deduplicated."""

    connection: duckdb.DuckDBPyConnection
    shards: list[Shard]
    """The validated shards this engine reads."""
    duplicates: dict[str, tuple[int, int, int, int]]
    """Filled by `step_table`. Per run: (records dropped, first step, last step, steps) where a
    (run, group, term, step, micro, rank) key appeared more than once."""
    chunk_rows: int = CHUNK_ROWS
    """Rows aggregated at a time: bounds memory whatever the size of the log."""
    only_steps: tuple[int, int] | None = None
    """When set, every view holds only these steps (first, last): a one-step view of a large log."""
    extremes: bool = False
    """The step table holds EXTREME_COLUMNS (the evidence of one step, see `extremes_at`)."""
    prune: bool = True
    """Aggregates whose value the files' footers give are constants (FOOTER_CONSTANTS); off only to check
    that this changes nothing."""
    footer_rows: bool = True
    """One-row shards whose footer gives their record (`Shard.record`) are read from it, not from the file;
    off only to check that this changes nothing."""
    grid: bool = True
    """A range whose records form a dense grid is reduced by numpy (`tokaudit.grid`), not by the query; off
    only to check that this changes nothing."""
    threads: int = 1
    """DuckDB's threads."""
    memory_limit: str = DEFAULT_MEMORY_LIMIT
    """DuckDB's memory limit."""

    link_names: dict[int, str] = field(default_factory=dict)
    """Per shard (by id): its link's name, or for a remote shard the name it goes by in dedup order."""
    remote_views: dict[int, str] = field(default_factory=dict)
    """Per remote shard (by id): the DuckDB view over its Arrow dataset."""
    defined: tuple[tuple[int, ...], tuple[int, int] | None, bool] | None = None
    """What the views hold now: (the shards' ids, the step range, deduplicated)."""
    footer_tables: list[str] = field(default_factory=list)
    """The temporary tables of footer records (`footer_table`) the views read now."""
    footer_count: int = 0
    """Footer-record tables made so far (each is named by its number)."""
    links: Path | None = None
    """A private folder of plainly named links to the shards whose paths hold a character DuckDB could
    read as a pattern ([ ] * ? { } and others): it is only given plain names and reads exactly the
    files it was given."""

    @classmethod
    def open(cls, shards: Sequence[Shard], memory_limit: str | None = None,
             threads: int | None = None, chunk_rows: int | None = None,
             only_steps: tuple[int, int] | None = None, extremes: bool = False) -> Engine:
        environment_memory, environment_chunk = settings_from_environment()
        memory_limit = memory_limit or environment_memory
        links: Path | None = None
        connection = _connect({"memory_limit": memory_limit, "temp_directory": tempfile.gettempdir(),
                               "preserve_insertion_order": False})
        try:
            connection.execute("SET enable_progress_bar = false")
            if threads:
                connection.execute(f"SET threads = {int(threads)}")
            count = int(threads) if threads else int(connection.execute(
                "SELECT current_setting('threads')").fetchall()[0][0])
            engine = cls(connection=connection, shards=list(shards), duplicates={},
                         chunk_rows=chunk_rows or environment_chunk, only_steps=only_steps, extremes=extremes,
                         threads=count,
                         memory_limit=memory_limit)
            here = os.getcwd()
            for index, shard in enumerate(engine.shards):
                # Path.absolute() without pathlib's parsing (a third of a second at 10,000 shards).
                name = os.path.join(here, shard.path) if shard.store is None else f"remote/{index:08d}.parquet"
                if shard.store is None and not _PLAIN_PATH.match(name):
                    if engine.links is None:
                        engine.links = links = Path(tempfile.mkdtemp(prefix="tokaudit-shards-"))
                    link = engine.links / f"{index:08d}.parquet"
                    os.symlink(name, link)
                    name = str(link)
                elif shard.store is not None and shard.record is None:
                    # On object storage DuckDB scans the file through pyarrow (no httpfs extension, no
                    # local copy): one Arrow dataset per shard, streamed with the columns and steps asked.
                    dataset = pads.dataset(str(shard.path), filesystem=shard.store.filesystem, format="parquet")
                    connection.register(f"remote_{index}", dataset)
                    engine.remote_views[id(shard)] = f"remote_{index}"
                engine.link_names[id(shard)] = name
            # "The later file wins" among duplicates: the shards' order, whatever their names.
            order = pa.table({"filename": [engine.link_names[id(s)] for s in engine.shards],
                              "file_index": pa.array(range(len(engine.shards)), pa.int64())})
            connection.register("file_order_source", order)
            connection.execute("CREATE TEMP TABLE file_order AS SELECT * FROM file_order_source")
            connection.unregister("file_order_source")
            # The views are defined when first read (`_whole`, the ranges of `step_table`): a view of
            # 24,576 files costs 0.35 s to write and bind, and the ranges replace it at once.
            return engine
        except BaseException:
            connection.close()
            if links is not None:
                shutil.rmtree(links, ignore_errors=True)
            raise

    def _whole(self) -> None:
        """The views over every shard (deduplicated when `step_table` found repeated keys): what the
        per-step queries read."""
        self._define(self.shards, self.only_steps, deduplicate=bool(self.duplicates))

    def _link(self, shard: Shard) -> str:
        return self.link_names[id(shard)]

    def _scans(self, members: list[Shard]) -> list[tuple[list[Shard], str]]:
        """FROM clauses (as `r`) with `filename` and `file_row_number`, each with the shards it reads:
        a table of footer records per schema of the one-row shards whose footers give their record
        (`footer_table`), one read_parquet per schema of the other local shards, one view per other
        remote shard (its row number unknown: a remote duplicate inside one file keeps an arbitrary
        copy; across files the later file still wins)."""
        by_schema: dict[tuple[tuple[str, str], ...], list[Shard]] = {}
        from_footers: dict[tuple[tuple[str, str], ...], list[Shard]] = {}
        for shard in members:
            # (a remote one always: `open` made no view of its file)
            if shard.record is not None and (self.footer_rows or shard.store is not None):
                from_footers.setdefault(shard.signature, []).append(shard)
            elif shard.store is None:
                by_schema.setdefault(shard.signature, []).append(shard)
        scans: list[tuple[list[Shard], str]] = []
        for held in from_footers.values():
            # One-row shards whose footers gave their record: a table of those records, not a file read.
            name = f"footer_records_{self.footer_count}"
            self.footer_count += 1
            self.connection.register(f"{name}_source", footer_table(held, [self._link(s) for s in held]))
            self.connection.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS SELECT * FROM {name}_source")
            self.connection.unregister(f"{name}_source")
            self.footer_tables.append(name)
            scans.append((held, f"{name} r"))
        for signature, local in by_schema.items():
            # Shards with one schema (all a recorder writes) need no union_by_name, which would read
            # every file's footer when the query is bound, at every (re)definition of the view.
            union = "true" if not signature else "false"
            files = "[" + ", ".join(_sql_string(self._link(s)) for s in local) + "]"
            scans.append((local, f"read_parquet({files}, union_by_name = {union}, filename = true, "
                                 "file_row_number = true) r"))
        for shard in members:
            if shard.store is not None and shard.record is None:
                scans.append(([shard], f"(SELECT *, {_sql_string(self._link(shard))} AS filename, "
                                       f"CAST(NULL AS BIGINT) AS file_row_number FROM {self.remote_views[id(shard)]}) r"))
        return scans

    def _source(self, shards: Sequence[Shard], steps: tuple[int, int] | None) -> str:
        """SQL for the raw records of these shards: scans per default run id (the parent folder
        name), so filling a missing run_id costs no per-row string work, and per schema."""
        by_run: dict[str, list[Shard]] = {}
        for shard in shards:
            by_run.setdefault(shard.default_run, []).append(shard)
        where = f"WHERE r.step BETWEEN {steps[0]} AND {steps[1]}" if steps else ""
        return " UNION ALL ".join(_select(default_run, self._present(scanned), scan, where)
                                  for default_run, members in by_run.items()
                                  for scanned, scan in self._scans(members))

    def _present(self, shards: Sequence[Shard]) -> set[str]:
        """The columns a scan of these shards reads: a column none of them holds a value of is a typed
        NULL, as for a file that lacks it (no column read, and the checks of its finiteness fold away)."""
        present = set().union(*(s.columns for s in shards))
        return present - _valueless(shards) if self.prune else present

    def _define(self, shards: Sequence[Shard], steps: tuple[int, int] | None, deduplicate: bool) -> None:
        # The views of thousands of files take a while to write and bind: a definition that is already
        # in place (one range, no duplicates: the usual log) is not written again.
        definition = (tuple(id(s) for s in shards), steps, deduplicate)
        if definition == self.defined:
            return
        self.defined = definition
        replaced, self.footer_tables = self.footer_tables, []
        self.connection.execute(f"CREATE OR REPLACE TEMP VIEW raw_records AS {self._source(shards, steps)}")
        for name in replaced:
            self.connection.execute(f"DROP TABLE {name}")
        # Of two records with one key, the later `time` wins, then the later file and row.
        dedup = ("LEFT JOIN file_order USING (filename) QUALIFY row_number() OVER (PARTITION BY run, grp, term, "
                 "step, rank, micro ORDER BY written DESC NULLS LAST, file_index DESC, file_row_number DESC) = 1"
                 ) if deduplicate else ""
        # c: implied weight per valid token before reduction = probe Σ∂b/∂ℓ / n, else b/S.
        # e = c·g/D: effective weight after the reduction. Correct iff e·N = 1.
        self.connection.execute(f"""
            CREATE OR REPLACE TEMP VIEW records AS
            SELECT *,
                CASE WHEN valid_tokens > 0 THEN
                    CASE WHEN token_weight_sum IS NOT NULL THEN token_weight_sum / valid_tokens
                         WHEN loss_sum <> 0 THEN backward_scalar / loss_sum END
                END * grad_scale / grad_divisor AS eff
            FROM raw_records {dedup}
        """)

    def _find_duplicates(self) -> dict[str, tuple[int, int, int, int]]:
        found = {}
        for run, copies, first, last, steps in self.connection.execute("""
            SELECT run, sum(copies - 1), min(step), max(step), count(DISTINCT step) FROM (
                SELECT run, step, count(*) AS copies FROM raw_records
                GROUP BY run, grp, term, step, rank, micro HAVING count(*) > 1)
            GROUP BY run
        """).fetchall():
            found[str(run)] = (int(copies), int(first), int(last), int(steps))
        return found

    def _chunks(self) -> list[tuple[tuple[int, int] | None, list[Shard]]]:
        """Step ranges of at most about `chunk_rows` rows and CHUNK_STEPS steps each, with the shards
        that overlap them. Rows bound DuckDB's aggregation; steps bound it too, and the range's share
        of the step table, which is what grows when each step has few records (few ranks, one
        microbatch).

        Ranges end between files whenever they can: DuckDB decodes a file whole for each range that
        overlaps it, so a file cut into k ranges is read k times. Files that overlap in steps form a
        segment (the shards of 1,024 ranks' recorders that cover the same 1,024 steps hold 4·10⁶
        records); segments are packed into ranges, a segment of up to WHOLE_SEGMENT_ROWS times
        `chunk_rows` is never cut, and only a larger one is cut into equal step ranges. With `only_steps`,
        the same ranges clipped to those steps (one step: one range)."""
        if self.only_steps is None:
            return self._ranges()
        first, last = self.only_steps
        clipped: list[tuple[tuple[int, int] | None, list[Shard]]] = []
        for steps, shards in self._ranges():
            low, high = steps if steps is not None else self.only_steps
            if max(low, first) <= min(high, last):
                clipped.append(((max(low, first), min(high, last)), shards))
        return clipped or [(self.only_steps, self.shards)]

    def _ranges(self) -> list[tuple[tuple[int, int] | None, list[Shard]]]:
        """`_chunks` over every step of the shards."""
        if any(s.step_range is None for s in self.shards):
            return [(None, self.shards)]
        ordered = sorted(self.shards, key=lambda s: s.step_range or (0, 0))
        segments: list[tuple[int, int, int, list[Shard]]] = []  # (first step, last step, rows, shards)
        for shard in ordered:
            first, last = shard.step_range or (0, 0)
            if segments and first <= segments[-1][1]:
                low, high, rows, members = segments[-1]
                segments[-1] = (low, max(high, last), rows + shard.rows, members + [shard])
            else:
                segments.append((first, last, shard.rows, [shard]))
        total = sum(segment[2] for segment in segments)
        if total <= self.chunk_rows and _steps(segments[0][0], segments[-1][1], total) <= CHUNK_STEPS:
            return [(None, self.shards)]
        chunks: list[tuple[tuple[int, int] | None, list[Shard]]] = []
        packed: tuple[int, int, int, list[Shard]] | None = None
        for first, last, rows, members in segments:
            if packed is not None:
                low, high, held, shards = packed
                if held + rows <= self.chunk_rows and _steps(low, last, held + rows) <= CHUNK_STEPS:
                    packed = (low, last, held + rows, shards + members)
                    continue
                chunks.append(((low, high), shards))
                packed = None
            if rows <= self.chunk_rows * WHOLE_SEGMENT_ROWS and _steps(first, last, rows) <= CHUNK_STEPS:
                packed = (first, last, rows, members)
                continue
            count = min(max(math.ceil(rows / self.chunk_rows), math.ceil(_steps(first, last, rows) / CHUNK_STEPS)),
                        last - first + 1)
            edges = [first + (last - first + 1) * i // count for i in range(count + 1)]
            for low, stop in zip(edges, edges[1:]):
                inside = [s for s in members if s.step_range and s.step_range[0] < stop and s.step_range[1] >= low]
                if inside:
                    chunks.append(((low, stop - 1), inside))
        if packed is not None:
            low, high, _, shards = packed
            chunks.append(((low, high), shards))
        return chunks

    def step_table(self, rtol: float, progress: Callable[[str], None] | None = None) -> pd.DataFrame:
        """One row per (run, grp, term, step) with everything the checks need (see `step_sql`).

        Large logs are aggregated a step range at a time, so that one range's aggregation is in DuckDB at
        once. Duplicates are looked for only where the cheap per-rank count says there may be some; those
        records are then deduplicated. Memory: the table is never held twice (see `_join`).
        """
        table = self.step_parts(rtol, progress)
        assert isinstance(table, pd.DataFrame)
        return table

    def step_parts(self, rtol: float, progress: Callable[[str], None] | None = None,
                   spill: bool = False) -> pd.DataFrame | Spilled:
        """`step_table`, or with `spill` and more than SPILL_STEPS steps, the table kept on disk a range at
        a time (`Spilled`, which the caller closes): what is held is then one range, whatever the number
        of steps."""
        columns: dict[str, list[Any]] = {}
        spilled: Spilled | None = None
        held = 0
        chunks = self._chunks()
        tables: Generator[dict[str, Any], None, None] = (
            self._range_table(rtol, steps, shards, self._grids(steps, shards)) for steps, shards in chunks)
        try:
            for index, (steps, _) in enumerate(chunks):
                if progress and len(chunks) > 1 and steps:
                    progress(f"aggregating steps {steps[0]}–{steps[1]} ({index + 1}/{len(chunks)})")
                table = next(tables)
                held += len(table["step"])
                if spill and spilled is None and held > SPILL_STEPS:
                    # Past SPILL_STEPS: the ranges held so far go to disk, and every one after.
                    spilled = Spilled()
                    for part in range(len(columns.get("step", []))):
                        spilled.add({name: parts[part] for name, parts in columns.items()})
                    columns = {}
                if spilled is not None:
                    spilled.add(table)
                else:
                    for name, values in table.items():
                        columns.setdefault(name, []).append(values)
                del table
        except BaseException:
            if spilled is not None:
                spilled.close()
            raise
        finally:
            tables.close()
        if spilled is not None:
            return spilled
        joined = _join(columns)
        # Each chunk comes sorted by step and chunks follow each other in step order: with one (run,
        # group, term) the whole table is in order already; only several need sorting.
        if any(len(joined[c].categories) > 1 for c in ("run", "grp", "term")):
            _reorder(joined, np.lexsort((joined["step"], joined["term"].codes, joined["grp"].codes,
                                         joined["run"].codes)))
        return pd.DataFrame(joined, copy=False)

    def _range_table(self, rtol: float, steps: tuple[int, int] | None, shards: list[Shard],
                     grids: list[Grid] | None) -> dict[str, Any]:
        """One range's step table: reduced as a grid where its records form one (`grids`, its `_grids`;
        `tokaudit.grid`), else by the query (`_aggregate`), its repeated keys found and left out first if it
        has any (`duplicates` counts them)."""
        if grids is not None and (table := self._grid_table(rtol, grids, shards)):
            return table
        self._define(shards, steps, deduplicate=False)
        table = self._aggregate(rtol, shards)
        if np.nansum(table["repeated_micro"]) > 0 or np.nansum(table["wide_micro"]) > 0:
            found = self._find_duplicates()
            if found:
                _add_duplicates(self.duplicates, found)
                self._define(shards, steps, deduplicate=True)
                table = self._aggregate(rtol, shards)
        return table

    def _grids(self, steps: tuple[int, int] | None, shards: Sequence[Shard]) -> list[Grid] | None:
        """The grids this range's files form (one per (run, group, term)), by their footers, where the engine
        reduces grids."""
        return grids_of(shards, steps) if self.grid and not self.extremes else None

    def _grid_table(self, rtol: float, grids: list[Grid], shards: Sequence[Shard]) -> dict[str, Any] | None:
        """The range's step table reduced grid by grid (`tokaudit.grid`), as the query gives it; None when the
        records of one are no grid after all (the range then takes the query)."""
        _, known = footer_facts(shards) if self.prune else (frozenset(), {})
        reduced: list[tuple[tuple[str, str, str], dict[str, np.ndarray]]] = []
        self.connection.execute("SET preserve_insertion_order = true")  # the records in file order
        try:
            for grid in grids:
                tables = grid_table(self.connection, grid, self._link, known, rtol, GRID_BLOCK_ROWS)
                if tables is None:
                    return None
                reduced.extend(tables)
        finally:
            self.connection.execute("SET preserve_insertion_order = false")
        if len(reduced) == 1:
            finished = self._finish(reduced[0][1], reduced[0][0], one_record=False)
        else:
            # Several (run, group, term): the query's rows, named and in step order (a count NULL in one
            # grid's steps only is float64 in all, as DuckDB hands it over)
            order = np.argsort(np.concatenate([table["step"] for _, table in reduced]), kind="stable")
            named: dict[str, Any] = {
                column: np.concatenate([np.full(len(table["step"]), names[index], dtype=object)
                                        for names, table in reduced])[order]
                for index, column in enumerate(("run", "grp", "term"))}
            for column in reduced[0][1]:
                named[column] = np.concatenate([table[column] for _, table in reduced])[order]
            del reduced
            finished = self._finish(named, None, one_record=False)
        if all(grid.micro == 1 for grid in grids):
            # e·n_r = e·n·M = e·n bit for bit: the same arrays as the query's one-record form hands over
            for name, same in ONE_RECORD_SHAPE.items():
                finished[name] = finished[same]
        return finished

    def _aggregate(self, rtol: float, shards: Sequence[Shard]) -> dict[str, Any]:
        """One range's step table as arrays, by column: numpy's, as DuckDB hands them over (a pandas
        frame of each range cost a copy of every column into pandas' blocks, and the names' strings a
        conversion to Arrow strings before they became categories: 1.5 s at 1.25M steps)."""
        single_ranks = _single_ranks(shards)
        names = _one_name(shards)
        facts, known = footer_facts(shards) if self.prune else (frozenset(), {})
        table: dict[str, Any] = self.connection.execute(
            step_sql(single_ranks, self.extremes, names is not None, facts), {"rtol": rtol, **known}).fetchnumpy()
        return self._finish(table, names, one_record=single_ranks is not None)

    def _finish(self, table: dict[str, Any], names: tuple[str, str, str] | None, one_record: bool) -> dict[str, Any]:
        """A range's fetched columns as the step table holds them: the names as categories (the one name of
        `names` when the query left them out), NULLs as NaN, constants as one value, and the one-record
        form's columns where the general form has them (`one_record`)."""
        if names is not None:
            # The one name of each column, as the categories `_categorical` makes of it, first as in the query.
            rows = len(table["step"])
            table = {**{column: pd.Categorical.from_codes(np.zeros(rows, dtype=np.int8), categories=pd.Index([name]))
                        for column, name in zip(("run", "grp", "term"), names)}, **table}
        for name, values in table.items():
            if name in ("run", "grp", "term"):
                if names is None:
                    table[name] = _categorical(values)
                continue
            if isinstance(values, np.ma.MaskedArray):
                # A column with NULLs (no record of the step said): NaN, which compares and sums as the
                # checks expect; a count becomes float64 for it.
                values = np.ma.filled(values.astype(np.float64), np.nan) if values.mask.any() else np.asarray(values.data)
            if values.dtype == np.float64:
                # −0.0 + 0.0 is 0.0: which zero the extreme of tied 0.0 and −0.0 is depends on the order the
                # records came in (DuckDB keeps the last of equals, in its scan's or its hash table's order;
                # numpy's grid in its own), and so would the report's; the table holds 0.0 for both.
                values = np.add(values, 0.0, out=values if values.flags.writeable else None)
            # A constant column is held as its one value from here on: the ranges wait for `_join` with
            # about half their columns taking no memory.
            constant = _constant([values])
            table[name] = values if constant is None else constant
        for name, same in MEAN_WEIGHT_EXTREMES.items():
            # Without a probe value the token extremes are the records' mean weights: one array, not two.
            if _same_bits(table[name], table[same]):
                table[name] = table[same]
        if one_record:
            # The one-record form's RANK_SHAPE, where the general form has it (before em_low).
            ones = np.broadcast_to(np.ones(1, dtype=np.int32), (len(table["step"]),))
            shape = {"m_low": ones, "m_high": ones, **{name: table[same] for name, same in ONE_RECORD_SHAPE.items()}}
            ordered: dict[str, Any] = {}
            for name, values in table.items():
                if name == "em_low":
                    ordered.update(shape)
                ordered[name] = values
            table = ordered
        return table

    def unusable_files(self) -> list[Shard]:
        """The shards holding a NaN grad_divisor or grad_scale, or fewer positions than valid tokens (after
        `step_table`, which counts them)."""
        self._whole()
        names = {name for (name,) in self.connection.execute(
            f"SELECT DISTINCT filename FROM raw_records WHERE {UNUSABLE_RECORD}").fetchall()}
        return [s for s in self.shards if self._link(s) in names]

    def records_at(self, run: str, step: int) -> pd.DataFrame:
        """Every record of one step of one run, with c, e and q = e·N."""
        self._whole()
        return self.connection.execute("""
            SELECT grp, term, rank, micro, world_size, valid_tokens, loss_sum, backward_scalar, grad_divisor,
                   grad_scale, eff * grad_divisor / grad_scale AS implied_weight, eff,
                   eff * sum(valid_tokens) OVER (PARTITION BY grp, term) AS q,
                   token_weight_min * grad_scale / grad_divisor AS eff_min,
                   token_weight_max * grad_scale / grad_divisor AS eff_max,
                   sync, reported_loss
            FROM records WHERE run = ? AND step = ? ORDER BY grp, term, rank, micro
        """, [run, step]).df()

    def complete_through(self) -> dict[tuple[str, str], int]:
        """Per (run, group): the last step that every rank has recorded. Steps after it are still
        being written when the log is read during training (ranks flush at different times)."""
        self._whole()
        rows = self.connection.execute("""
            SELECT run, grp, min(last_step) FROM (
                SELECT run, grp, rank, max(step) AS last_step FROM raw_records GROUP BY run, grp, rank)
            GROUP BY run, grp
        """).fetchall()
        return {(str(run), str(group)): int(step) for run, group, step in rows}

    def close(self) -> None:
        self.connection.close()
        trim_heap()
        if self.links is not None:
            shutil.rmtree(self.links, ignore_errors=True)


# Per-record weights e are only defined for valid records (n > 0) with every value finite.
RECORDS_SQL = """
WITH rec AS (
    -- k stands for (run, grp, term) in the groupings: an integer hashes in a fraction of the time of
    -- three strings, and the per-rank grouping of a many-microbatch log holds millions of groups
    SELECT {key} AS k, {record_names}step, rank, micro, world_size, grad_divisor, grad_scale,
        valid_tokens, loss_sum, positions,
        sync, skipped, reported_loss, token_weight_sum, divisor_known,
        valid_tokens > 0 AND NOT (isfinite(loss_sum) AND coalesce(isfinite(backward_scalar), true)
            AND coalesce(isfinite(token_weight_sum), true) AND coalesce(isfinite(token_weight_min), true)
            AND coalesce(isfinite(token_weight_max), true) AND coalesce(isfinite(masked_weight_abs_sum), true)
            AND isfinite(grad_scale) AND isfinite(grad_divisor) AND coalesce(isfinite(eff), true)) AS nonfinite_valid,
        valid_tokens = 0 AND NOT (coalesce(isfinite(backward_scalar), true)
            AND coalesce(isfinite(token_weight_sum), true)) AS nonfinite_zero,
        token_weight_min * grad_scale / grad_divisor AS probe_low,
        token_weight_max * grad_scale / grad_divisor AS probe_high,
        token_weight_max - token_weight_min > $rtol * abs(token_weight_max) AS probe_nonuniform,
        masked_weight_abs_sum > 0 AND masked_weight_abs_sum > $rtol * coalesce(abs(eff * grad_divisor / grad_scale), 0)
            AS masked_weighted,
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
        count_if(probe_nonuniform) AS probe_nonuniform,
        count_if(masked_weighted) AS masked_weighted,
        count(token_weight_sum) AS probed,
        count(sync) AS sync_known, count_if(sync) AS sync_true,
        count_if(skipped) AS skipped_true, count_if(NOT skipped) AS skipped_false,
        min(reported_loss) AS reported_low, max(reported_loss) AS reported_high, count(reported_loss) AS reported,
        sum(positions) AS positions, count(positions) AS positions_known,
        count_if(micro >= 64) AS wide_micro,
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
each of these is the same array as the column it equals (`_aggregate`; `_join` joins it once)."""
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
    "nonfinite_valid", "nonfinite_zero", "probe_nonuniform", "masked_weighted", "probed", "sync_known", "sync_true",
    "skipped_true", "skipped_false", "reported", "positions_known", "wide_micro", "unusable_values", "ranks", "m_low",
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
group, term) (`Shard.names`): no hash of three strings per record, no string aggregate per step (the
query's CPU 15% less), and no name at all, neither read nor kept in the records the groupings share (6%
of the query with microbatches): the names' categories are made in Python (`_aggregate`), not a string a
step handed over and hashed again (0.25 s at 1.25M steps)."""
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
        ("count_if(probe_nonuniform) AS probe_nonuniform", "NULL AS probe_nonuniform")),
    frozenset({"token_weight_sum"}): (("count(token_weight_sum) AS probed", "0 AS probed"),),
    # NULL > 0 AND NULL > x is NULL on every record
    frozenset({"masked_weight_abs_sum"}): (("count_if(masked_weighted) AS masked_weighted", "NULL AS masked_weighted"),),
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
}
"""Aggregates whose value the footers of a range's files already give, with that value, per fact
(`footer_facts`). A column named alone: no record holds a value of it (each file lacks it or holds only
nulls in it, `Shard.null_columns`), and each aggregate is what it gives over NULL on every record (count
0; count_if, sum, min and max NULL), typed as the query casts it. "world_size=" and "grad_divisor=": one
value on every record, passed as the parameter of that name. "micro<64": no microbatch index reaches 64.
The range query at 1.25M steps (no probe, reported loss or skip flags; one W and D) 0.20 → 0.16 s; a test
checks the step tables with and without them are equal bit for bit."""


def footer_facts(shards: Sequence[Shard]) -> tuple[frozenset[str], dict[str, Any]]:
    """What the footers of these shards say of all their records, as FOOTER_CONSTANTS' facts, and the
    parameters those facts need: the columns no record holds a value of (absent or all null), the one
    world_size and grad_divisor when there is one, and whether every microbatch index is below 64."""
    facts = set(_valueless(shards))
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


def _valueless(shards: Sequence[Shard]) -> frozenset[str]:
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
        sql = ONE_RECORD_STEP_SQL.replace("{repeated}", f"count(*) - bit_count(bitstring_agg(rank, {low}, {high}))")
    key, names, record_names = ONE_NAME_KEYS if one_name else KEYS
    for needed, replacements in FOOTER_CONSTANTS.items():
        if needed <= facts:
            for aggregate, constant in replacements:
                sql = sql.replace(aggregate, constant)
    return (sql.replace("{rank_extremes}", RANK_EXTREMES if extremes else "")
            .replace("{extremes}", EXTREME_AGGREGATES if extremes else "")
            .replace("{extreme_casts}", ", " + EXTREME_CASTS if extremes else "")
            .replace("{key}", key).replace("{names}", names).replace("{record_names}", record_names))


def extremes_at(shards: Sequence[Shard], step: int, rtol: float, threads: int | None = None) -> pd.DataFrame:
    """EXTREME_COLUMNS of one step, a row per (run, grp, term): the step aggregated again, alone, from the
    files whose footers say they can hold it, with the evidence aggregates the full query leaves out.
    The same records (deduplicated the same way) in the same aggregation as the full query's."""
    engine = Engine.open([s for s in shards if s.may_hold(step, step)], threads=threads, only_steps=(step, step),
                         extremes=True)
    try:
        table = engine.step_table(rtol)
    finally:
        engine.close()
    return table[["run", "grp", "term", "step", *EXTREME_COLUMNS]]


def _steps(first: int, last: int, rows: int) -> int:
    """Steps a range can hold: its span, and at most one a row whatever the numbering."""
    return min(last - first + 1, rows)


def _single_ranks(shards: Sequence[Shard]) -> tuple[int, int] | None:
    """(lowest, highest) rank of these shards when their footers show every record is microbatch 0 (one
    record per rank and step, unless a key is repeated) over a rank range narrow enough to count as bits."""
    ranks = [s.rank_range for s in shards]
    if not shards or any(s.micro_range != (0, 0) for s in shards) or any(r is None for r in ranks):
        return None
    low, high = min(r[0] for r in ranks if r), max(r[1] for r in ranks if r)
    return (low, high) if high - low < RANK_BITS_LIMIT else None


def _one_name(shards: Sequence[Shard]) -> tuple[str, str, str] | None:
    """The (run, group, term) of every record of these shards, when their footers show there is one."""
    names = {shard.names for shard in shards}
    return names.pop() if len(names) == 1 and None not in names else None


def _categorical(names: np.ndarray) -> pd.Categorical:
    """A handful of names repeated on every step, as categories (one byte a step) in sorted order, as
    pd.Categorical makes them: from a hash of the Python strings themselves, where pd.Categorical would
    first turn every row into an Arrow string (three times as long)."""
    codes, names_found = pd.factorize(names)
    order = np.argsort(names_found)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return pd.Categorical.from_codes(rank[codes], categories=pd.Index(list(names_found[order])))


SPILL_STEPS = 2_000_000
"""Steps past which the audit keeps the step table on disk a range at a time (`Engine.step_parts`): whole,
it costs about 127 bytes a step (1.6 GB at 12.5M steps) and the checks would add their own."""


class Spilled:
    """A step table kept on disk, one file per step range in step order (each range's rows in step order
    within every (run, group, term)): read back one range at a time (`parts`). The names each range holds
    are noted as it is written. A column held as one value stays one value (`_constant`). The folder is
    made under TMPDIR with the first range and removed by `close`."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.paths: list[Path] = []
        self.names: set[tuple[str, str, str]] = set()
        """Every (run, group, term) of the table."""
        self.unusable = 0
        """Steps with a NaN divisor or scale or T < n (`unusable_values`), counted as the ranges are written: the
        caller need not read them back to know."""

    def add(self, table: dict[str, Any]) -> None:
        rows = len(table["step"])
        if not rows:
            return
        self.names.update(_names(table))
        packed = {name: ("one value", values[:1].copy(), len(values)) if one_value(values) else values
                  for name, values in table.items()}
        try:
            if self.folder is None:
                self.folder = Path(tempfile.mkdtemp(prefix="tokaudit-steps-"))
            path = self.folder / f"steps-{len(self.paths):06d}.pickle"
            with open(path, "wb") as out:
                pickle.dump(packed, out, protocol=5)
        except OSError as error:
            raise UsageError(f"cannot keep the step table of this log on disk ({error.strerror or error}: "
                             f"{error.filename or tempfile.gettempdir()}); it needs about 130 bytes a step: "
                             "free space there or set TMPDIR to a folder that has it") from None
        self.paths.append(path)
        self.unusable += int(np.count_nonzero(np.nan_to_num(table["unusable_values"]) > 0))

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def parts(self) -> Iterator[pd.DataFrame]:
        assert self.folder is not None or not self.paths
        for path in self.paths:
            with open(path, "rb") as source:
                packed = pickle.load(source)
            yield pd.DataFrame({name: np.broadcast_to(values[1], (values[2],)) if isinstance(values, tuple) else values
                                for name, values in packed.items()}, copy=False)


def _names(table: dict[str, Any]) -> set[tuple[str, str, str]]:
    """The (run, group, term) a range's table holds: its names' codes, each distinct combination once."""
    columns = [pd.Categorical(table[c]) for c in ("run", "grp", "term")]
    sizes = [len(column.categories) + 1 for column in columns]  # + 1: a missing name's code, −1
    # the three codes as one number, in mixed radix: a sort of integers, not of rows
    key = ((columns[0].codes.astype(np.int64) + 1) * sizes[1] + columns[1].codes + 1) * sizes[2] + columns[2].codes + 1
    found = []
    for value in np.unique(key).tolist():
        value, term = divmod(value, sizes[2])
        run, group = divmod(value, sizes[1])
        found.append(tuple(str(column.categories[code - 1]) if code else "nan"  # as a missing name reads as text
                           for column, code in zip(columns, (run, group, term))))
    return set(found)  # type: ignore[arg-type]


TRIM_BYTES = 64 << 20
"""Freed parts `_join` lets the heap keep before it hands them back: the most it adds to the peak."""


def _join(columns: dict[str, list[Any]]) -> dict[str, Any]:
    """One table from the ranges' columns, a column at a time: each column's parts are let go as soon
    as they are joined, and the C heap's free pages are handed back to the system (glibc keeps the
    freed parts otherwise, and the peak would be the table twice, as with a concat of frames). The
    frame is then made around the joined arrays, not copied into pandas' blocks (assigning a column
    copies it; so does a frame of one block per type)."""
    order = list(columns)
    joined: dict[str, Any] = {}
    # A column made of the very arrays of another (ONE_RECORD_SHAPE, MEAN_WEIGHT_EXTREMES) is that column
    # again, joined with it: grouped by the parts' identities, taken while every part is alive. Its parts
    # are then let go at once, not held until its own turn (at 12.5M steps four such pairs held 400 MB).
    same_parts: dict[tuple[int, ...], list[str]] = {}
    for name, parts in columns.items():
        same_parts.setdefault(tuple(id(part) for part in parts), []).append(name)
    freed = 0
    for names in same_parts.values():
        parts = columns.pop(names[0])
        for alias in names[1:]:
            del columns[alias]
        freed += sum(part.nbytes for part in parts if not one_value(part))
        value = _constant(parts)
        if value is None:
            if len(parts) == 1:
                value = parts[0]
            elif isinstance(parts[0], pd.Categorical):
                value = union_categoricals(parts, sort_categories=True)
            else:
                # A count with NULLs in some range only is float64 there: the joined column then is too.
                value = np.concatenate(parts)
        for name in names:
            joined[name] = value
        del parts, value
        # A trim walks the whole heap (55 of them cost a second at 1.25M steps): one per TRIM_BYTES let go.
        if freed >= TRIM_BYTES:
            trim_heap()
            freed = 0
    return {name: joined[name] for name in order}


def _constant(parts: list[Any]) -> np.ndarray | None:
    """A numeric column whose every row holds one value, bit for bit (W, D, a count that is always 0 or
    always the ranks, a column no record has: about half the columns of a run that never changed its
    set-up), as that value repeated without memory (a read-only array of stride 0); else None."""
    dtype = parts[0].dtype if isinstance(parts[0], np.ndarray) else None
    if dtype is None or dtype.kind not in "iuf" or any(part.dtype != dtype for part in parts):
        return None
    rows = sum(len(part) for part in parts)
    if rows < 2:
        return None
    first = next(part[:1] for part in parts if len(part))
    # Compared as bits (0.0 and -0.0 differ, and NaN equals NaN when it is the same NaN); a part that is
    # one value already is compared by that value.
    for part in parts:
        values = part[:1] if one_value(part) else part
        if not _same_bits(values, np.broadcast_to(first, values.shape)):
            return None
    return np.broadcast_to(first.copy(), (rows,))


def _same_bits(one: Any, other: Any) -> bool:
    """Two numeric arrays of one dtype and length that hold the same bits in every row (NaN included)."""
    if not (isinstance(one, np.ndarray) and isinstance(other, np.ndarray)) or one.dtype != other.dtype \
            or one.dtype.kind not in "iuf" or one.shape != other.shape:
        return False
    as_bits = np.dtype(f"u{one.dtype.itemsize}")
    return bool((one.view(as_bits) == other.view(as_bits)).all())


def one_value(values: Any) -> bool:
    """An array that is one value repeated without memory (`_constant`'s, stride 0)."""
    return isinstance(values, np.ndarray) and values.strides == (0,) and len(values) > 0


def _reorder(joined: dict[str, Any], order: np.ndarray) -> None:
    """Every column put in this order, in place, one at a time, each old column let go before the next
    is taken (a frame's sort_values holds the table twice), and an array shared by several columns
    (ONE_RECORD_SHAPE) taken once and still shared."""
    taken: dict[int, Any] = {}
    for name in list(joined):
        values = joined[name]
        if one_value(values):
            continue  # one value in every row (`_constant`): in any order
        if id(values) not in taken:
            taken[id(values)] = values.take(order)
        joined[name] = taken[id(values)]
        del values
    trim_heap()


def _add_duplicates(target: dict[str, tuple[int, int, int, int]], found: dict[str, tuple[int, int, int, int]]) -> None:
    """Count repeated keys found in another range (ranges hold different steps): per run, (records
    dropped, first step, last step, steps), as `Engine.duplicates`."""
    for run, (copies, first, last, count) in found.items():
        old = target.get(run, (0, first, last, 0))
        target[run] = (old[0] + copies, min(old[1], first), max(old[2], last), old[3] + count)


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


def _select(default_run: str, present: set[str], scan: str, where: str) -> str:
    """One scan's records with SPEC §2's defaults applied; columns its files lack are typed nulls."""

    def column(name: str) -> str:
        kind = DUCKDB_TYPES[COLUMNS_BY_NAME[name].kind]
        return f'CAST(r."{name}" AS {kind})' if name in present else f"CAST(NULL AS {kind})"

    return f"""
        SELECT
            coalesce({column('run_id')}, {_sql_string(default_run)}) AS run,
            coalesce({column('group')}, {_sql_string(UNNAMED)}) AS grp,
            coalesce({column('term')}, {_sql_string(UNNAMED)}) AS term,
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
            r.filename, r.file_row_number
        FROM {scan}
        {where}"""
