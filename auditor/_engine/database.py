"""DuckDB over the shards: per-record weights aggregated to one row per (run, group, term, step).

Memory stays bounded however large the log: DuckDB streams the Parquet files, aggregates spill to disk past
`memory_limit`, and only the per-step table (one row per optimizer step and group) comes back to Python."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa

from tokaudit._engine.connection import DEFAULT_MEMORY_LIMIT, connect, half_limit, settings_from_environment
from tokaudit._engine.ranges import CHUNK_ROWS, RangesMap, RangeTask, range_rows, step_ranges
from tokaudit._engine.columns import UNUSABLE_RECORD
from tokaudit._engine.sql import COMPLETE_THROUGH_SQL, DUPLICATES_SQL, LAUNCHED_VIEW, RANK_WEIGHTS_SQL, RECORDS_AT_SQL
from tokaudit._engine.sql import KEPT, RUN_SCANS
from tokaudit._engine.sql import absent_values, aliases, given, parquet_scan
from tokaudit._engine.sql import constants, file_order_table, footer_table, one_name_of, records_view
from tokaudit._engine.sql import one_record_form, select_records, sql_string, step_sql, valueless_columns
from tokaudit._engine.stream import Undecodable, Unsorted, row_groups, streamable, windowed
from tokaudit._engine.tables import FILES_NAMED, SPILL_STEPS, Duplicates, Spilled, add_duplicates, finished
from tokaudit._engine.tables import note_precision, scratch_folder, join_columns, reorder
from tokaudit._engine.watch import Aggregating, Told, Watch, shares, watching
from tokaudit._reader import Shard
from tokaudit._storage import object_dataset


_PLAIN_PATH = re.compile(r"^[A-Za-z0-9._/+=,@%:-]+$")
"""Paths DuckDB reads literally (no pattern, no escape): others are given to it through a link."""


@dataclass
class Engine:
    """A DuckDB connection with the view `records`: one row per record, defaults applied, deduplicated."""

    connection: duckdb.DuckDBPyConnection
    shards: list[Shard]
    """The validated shards this engine reads."""
    duplicates: dict[str, Duplicates]
    """Filled by `step_table`. Per run: (records dropped, first step, last step, steps) where a
    (run, group, term, step, micro, rank) key appeared more than once."""
    precision: dict[str, int] = field(default_factory=dict)
    rounded: dict[str, list[int]] = field(default_factory=dict)
    """Both filled by `step_table` (`tables.note_precision`): per run whose records say it (`precision_bits`), the
    fewest significant bits; per run, the most bits a backward scalar of rank 0 held, and in how many steps."""
    chunk_rows: int = CHUNK_ROWS
    """Rows aggregated at a time: bounds memory whatever the size of the log."""
    only_steps: tuple[int, int] | None = None
    """When set, every view holds only these steps (first, last): a one-step view of a large log."""
    extremes: bool = False
    """The step table holds the EVIDENCE columns (the evidence of one step, see `extremes_at`)."""
    prune: bool = True
    """A column no record of a scan holds a value of (by the footers) is a typed NULL, not read; off only to
    check that this changes nothing."""
    footer_rows: bool = True
    """One-row shards whose footer gives their record (`Shard.record`) are read from it, not from the file;
    off only to check that this changes nothing."""
    threads: int = 1
    """DuckDB's threads."""
    memory_limit: str = DEFAULT_MEMORY_LIMIT
    """DuckDB's memory limit."""

    link_names: dict[int, str] = field(default_factory=dict)
    """Per shard (by id): its link's name, or for a remote shard the name it goes by in dedup order."""
    remote_views: dict[int, str] = field(default_factory=dict)
    """Per remote shard (by id): the DuckDB view over its Arrow dataset."""
    defined: tuple[tuple[int, ...], tuple[int, int] | None, bool, str | None] | None = None
    """What the views hold now: (the shards' ids, the step range, deduplicated, the scan of a window)."""
    footer_tables: list[str] = field(default_factory=list)
    """The temporary tables of footer records (`footer_table`) the views read now."""
    footer_count: int = 0
    """Footer-record tables made so far (each is named by its number)."""
    ranges_map: RangesMap | None = None
    """Where the step ranges are aggregated: an ordered map that runs `aggregate_range` on each (a cluster's,
    `tokaudit._cluster`); None: in this process, on this engine's connection."""
    watch: Watch | None = None
    """What says how far the range being aggregated is (`step_parts` with progress)."""
    last_query: str = ""
    """The step query run last (`step_sql`): what a test compares with the documented one."""
    links: Path | None = None
    """A private folder of plainly named links to the shards whose paths hold a character DuckDB could
    read as a pattern ([ ] * ? { } and others): it is only given plain names and reads exactly the
    files it was given."""

    @classmethod
    def open(
        cls,
        shards: Sequence[Shard],
        memory_limit: str | None = None,
        threads: int | None = None,
        chunk_rows: int | None = None,
        only_steps: tuple[int, int] | None = None,
        extremes: bool = False,
        duplicates: dict[str, Duplicates] | None = None,
        ranges_map: RangesMap | None = None,
    ) -> Engine:
        """An engine over these shards (memory limit and chunk rows from the environment unless given).
        `duplicates`: the repeated keys an earlier engine over the same shards found (`Engine.duplicates`), so that
        this one's views leave out the same records without aggregating every step again."""
        environment_memory, environment_chunk = settings_from_environment()
        memory_limit = memory_limit or environment_memory
        connection = connect(
            {"memory_limit": memory_limit, "temp_directory": tempfile.gettempdir(), "preserve_insertion_order": False}
        )
        try:
            connection.execute("SET enable_progress_bar = false; SET enable_progress_bar_print = false")
            if threads:
                connection.execute(f"SET threads = {int(threads)}")
            count = (
                int(threads)
                if threads
                else int(connection.execute("SELECT current_setting('threads')").fetchall()[0][0])
            )
            engine = cls(
                connection=connection,
                shards=list(shards),
                duplicates=dict(duplicates or {}),
                chunk_rows=chunk_rows or environment_chunk,
                only_steps=only_steps,
                extremes=extremes,
                threads=count,
                memory_limit=memory_limit,
                ranges_map=ranges_map,
            )
            try:
                engine._name_files()
                engine._order_files()
            except BaseException:
                if engine.links is not None:
                    shutil.rmtree(engine.links, ignore_errors=True)
                raise
            # The views are defined when first read (`_whole`, the ranges of `step_table`): a view of
            # many thousand files takes long to write and bind, and the ranges replace it at once.
            return engine
        except BaseException:
            connection.close()
            raise

    def _name_files(self) -> None:
        """Each shard's name for DuckDB: its absolute path, a plainly named link to it (`links`) where the path holds
        a character DuckDB could read as a pattern, or the view over its Arrow dataset on object storage."""
        here = os.getcwd()
        for index, shard in enumerate(self.shards):
            # Path.absolute() without pathlib's parsing (a third of a second at 10,000 shards).
            name = os.path.join(here, shard.path) if shard.store is None else f"remote/{index:08d}.parquet"
            if shard.store is None and not _PLAIN_PATH.match(name):
                if self.links is None:
                    self.links = scratch_folder("tokaudit-shards-")
                link = self.links / f"{index:08d}.parquet"
                os.symlink(name, link)
                name = str(link)
            if shard.store is not None and shard.record is None or shard.shadowed:
                # DuckDB scans the file through pyarrow on object storage (no httpfs extension, no local copy), and
                # where the file's own columns shadow what its scan adds (`Shard.shadowed`): one Arrow dataset per
                # shard, streamed with the columns and steps asked.
                self.connection.register(f"remote_{index}", object_dataset(shard.store, str(shard.path)))
                self.remote_views[id(shard)] = f"remote_{index}"
            self.link_names[id(shard)] = name

    def _order_files(self) -> None:
        """The table `file_order` (`file_order_table`): each file's place in the order of publication, its folders' values."""
        self.connection.register("file_order_source", file_order_table(self.shards, self.link_names))
        self.connection.execute("CREATE TEMP TABLE file_order AS SELECT * FROM file_order_source")
        self.connection.unregister("file_order_source")

    def _whole(self) -> None:
        """The views over every shard (deduplicated where `step_table` found repeated keys): what per-step queries read."""
        self._define(self.shards, self.only_steps, deduplicate=bool(self.duplicates))

    def _scans(self, members: list[Shard]) -> list[tuple[list[Shard], str]]:
        """FROM clauses (as `r`) with `filename` and `file_row_number`, each with the shards it reads:
        a table of footer records per schema of the one-row shards whose footers give their record
        (`footer_table`), one read_parquet per schema of the other local shards, one view per other
        remote shard and per local one whose columns shadow the scan's (`Shard.shadowed`), without them (its row
        number unknown: a duplicate inside one such file keeps an arbitrary copy; across files the later file still
        wins)."""
        Signature = tuple[tuple[tuple[str, str], ...], tuple[str, ...]]  # and the columns folders give
        by_schema: dict[Signature, list[Shard]] = {}
        from_footers: dict[Signature, list[Shard]] = {}
        through_arrow: list[Shard] = []
        for shard in members:
            kind = (shard.signature, tuple(column for column, _ in shard.partition))
            # (a remote one always: `open` made no view of its file)
            if shard.record is not None and (self.footer_rows or shard.store is not None):
                from_footers.setdefault(kind, []).append(shard)
            elif shard.store is None and not shard.shadowed:
                by_schema.setdefault(kind, []).append(shard)
            else:
                through_arrow.append(shard)
        scans: list[tuple[list[Shard], str]] = []
        for held in from_footers.values():
            # One-row shards whose footers gave their record: a table of those records, not a file read.
            name = f"footer_records_{self.footer_count}"
            self.footer_count += 1
            self.connection.register(f"{name}_source", footer_table(held, [self.link_names[id(s)] for s in held]))
            self.connection.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS SELECT * FROM {name}_source")
            self.connection.unregister(f"{name}_source")
            self.footer_tables.append(name)
            scans.append((held, f"{name} r"))
        for (signature, _), local in by_schema.items():
            scans.append((local, parquet_scan([self.link_names[id(s)] for s in local], one_schema=bool(signature))))
        for shard in through_arrow:
            every = f"* EXCLUDE ({', '.join(shard.shadowed)})" if shard.shadowed else "*"
            scans.append(
                (
                    [shard],
                    f"(SELECT {every}, {sql_string(self.link_names[id(shard)])} AS filename, "
                    f"CAST(NULL AS BIGINT) AS file_row_number FROM {self.remote_views[id(shard)]}) r",
                )
            )
        return scans

    def _source(self, shards: Sequence[Shard], steps: tuple[int, int] | None, scan: str | None = None) -> str:
        """SQL for the raw records of these shards: scans per default run id (the parent folder name), so filling a
        missing run_id costs no per-row string work, and per schema; past RUN_SCANS runs, per schema alone, each
        file's run joined. `scan`: their records are this one scan instead (a window of a segment read in step
        order: one schema, one default run)."""
        where = f"WHERE r.step BETWEEN {steps[0]} AND {steps[1]}" if steps else ""
        if scan is not None:
            first = shards[0]
            return select_records(
                first.default_run, self._present(shards), given(scan, first), where, first.run_override
            )
        by_run: dict[tuple[str | None, bool], list[Shard]] = {}
        for shard in shards:
            by_run.setdefault((shard.default_run, shard.run_override), []).append(shard)
        if len(by_run) > RUN_SCANS:
            by_run = {(None, False): list(shards)}
        return " UNION ALL ".join(
            select_records(run, self._present(held), given(read, held[0], runs=run is None), where, override)
            for (run, override), members in by_run.items()
            for held, read in self._scans(members)
        )

    def _present(self, shards: Sequence[Shard]) -> set[str]:
        """The columns a scan of these shards reads: a column none of them holds a value of is a typed
        NULL, as for a file that lacks it (no column read, and the checks of its finiteness fold away)."""
        present = set().union(*(s.columns for s in shards))
        return present - valueless_columns(shards) if self.prune else present

    def _define(
        self, shards: Sequence[Shard], steps: tuple[int, int] | None, deduplicate: bool, scan: str | None = None
    ) -> None:
        # The views of thousands of files take a while to write and bind: a definition that is already
        # in place (one range, no duplicates: the usual log) is not written again.
        definition = (tuple(id(s) for s in shards), steps, deduplicate, scan)
        if definition == self.defined:
            return
        self.defined = definition
        replaced, self.footer_tables = self.footer_tables, []
        self.connection.execute(f"CREATE OR REPLACE TEMP VIEW raw_records AS {self._source(shards, steps, scan)}")
        for name in replaced:
            self.connection.execute(f"DROP TABLE {name}")
        # Of two records with one key, the later published is kept (`KEPT`); what a later launch superseded
        # (`LAUNCHED_VIEW`) is no part of the step.
        if deduplicate:
            self.connection.execute(LAUNCHED_VIEW)
        dedup = f"QUALIFY row_number() OVER ({KEPT}) = 1 AND NOT superseded" if deduplicate else ""
        self.connection.execute(records_view(dedup, "launched" if deduplicate else "raw_records"))

    def _find_duplicates(self) -> dict[str, Duplicates]:
        found = {}
        paths = {self.link_names[id(shard)]: str(shard.path) for shard in self.shards}  # (DuckDB's names: links)
        self.connection.execute(LAUNCHED_VIEW)  # (over the records as `_define` last defined them)
        for row in self.connection.execute(DUPLICATES_SQL).fetchall():
            run, copies, first, last, steps, files, identical, same_time, one_file, superseded, unlaunched, out = row
            named = tuple(sorted(paths.get(f, f) for f in files)[: FILES_NAMED + 1])  # (one more: there are more)
            kinds = (bool(identical), bool(same_time), bool(one_file), int(superseded), bool(unlaunched))
            left_out = tuple(sorted(paths.get(f, f) for f in out))
            found[str(run)] = Duplicates(int(copies), int(first), int(last), int(steps), named, *kinds, left_out)
        return found

    def step_table(self, progress: Told | None = None) -> pd.DataFrame:
        """One row per (run, grp, term, step) with everything the checks need (see `step_sql`), aggregated a step
        range at a time; duplicates looked for only where the per-rank count says there may be some, and left out.
        Memory: the table is never held twice (see `join_columns`)."""
        table = self.step_parts(progress)
        assert isinstance(table, pd.DataFrame)
        return table

    def step_parts(self, progress: Told | None = None, spill: bool = False) -> pd.DataFrame | Spilled:
        """`step_table`, or with `spill` and more than SPILL_STEPS steps, the table kept on disk a range at a time
        (`Spilled`, which the caller closes): what is held is then one range, whatever the number of steps.
        `progress` is told each range as it starts and how far it is as it runs (`watch.watching`)."""
        columns: dict[str, list[Any]] = {}
        spilled: Spilled | None = None
        held = 0
        chunks = step_ranges(self.shards, self.chunk_rows, self.only_steps, self.threads)
        tables = self._range_tables(chunks)
        try:
            parts = shares([range_rows(steps, members) for steps, members in chunks])
            for index, (steps, _) in enumerate(chunks):
                at = Aggregating(index, len(chunks), steps, *parts[index])
                with watching(self.connection, progress, at) as self.watch:
                    pieces, found = next(tables)
                self.watch = None
                add_duplicates(self.duplicates, found)
                while pieces:  # a range's tables in step order: one, or a window's each (`_windowed`)
                    table = pieces.pop(0)
                    note_precision(self.precision, self.rounded, table)
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
            close = getattr(tables, "close", None)
            if close is not None:
                close()
        if spilled is not None:
            return spilled
        joined = join_columns(columns)
        # Each chunk comes sorted by step and chunks follow each other in step order: with one (run,
        # group, term) the whole table is in order already; only several need sorting.
        if any(len(joined[c].categories) > 1 for c in ("run", "grp", "term")):
            reorder(
                joined, np.lexsort((joined["step"], joined["term"].codes, joined["grp"].codes, joined["run"].codes))
            )
        return pd.DataFrame(joined, copy=False)

    def _range_tables(
        self, chunks: list[tuple[tuple[int, int] | None, list[Shard]]]
    ) -> Iterator[tuple[list[dict[str, Any]], dict[str, Duplicates]]]:
        """Each range's table (in parts) and repeated keys, in order: here, or through `ranges_map` each by an engine of its
        own over the range's shards, given in this engine's order (of two records of one key the later file's
        wins) and with this engine's settings."""
        if self.ranges_map is None:
            return (self._range_table(steps, shards) for steps, shards in chunks)
        order = {id(shard): index for index, shard in enumerate(self.shards)}
        return self.ranges_map(
            aggregate_range,
            [
                RangeTask(
                    tuple(sorted(shards, key=lambda s: order[id(s)])),
                    steps,
                    self.extremes,
                    self.prune,
                    self.footer_rows,
                    self.memory_limit,
                )
                for steps, shards in chunks
            ],
        )

    def _range_table(
        self, steps: tuple[int, int] | None, shards: list[Shard]
    ) -> tuple[list[dict[str, Any]], dict[str, Duplicates]]:
        """One range's step table, in parts in step order, and its repeated keys (per run): by windows of whole steps
        where `stream.streamable` says so and its files are in step order (`_windowed`), else by one query."""
        if self.only_steps is None and streamable(shards, self.threads, self.chunk_rows):
            try:
                return self._windowed(steps, shards)
            except Unsorted:  # what the windows made is set aside and the segment is read whole
                pass
            except Undecodable as error:
                # DuckDB reads that file alone: where it cannot either, its error leads `_opening` to name the file
                # without an aggregation of the whole segment first; where it can, the segment is read whole.
                self.connection.execute(f"SELECT max(COLUMNS(*)) FROM {parquet_scan([error.name], one_schema=True)}")
        table, found = self._queried(steps, shards)
        return [table], found

    def _queried(
        self, steps: tuple[int, int] | None, shards: list[Shard], scan: str | None = None
    ) -> tuple[dict[str, Any], dict[str, Duplicates]]:
        """The step table of these shards' records (or of `scan`'s) by the query (`_aggregate`), its repeated keys
        found and left out first if it has any (and returned, per run)."""
        self._define(shards, steps, deduplicate=False, scan=scan)
        table = self._aggregate(shards)
        if np.nansum(table["repeated_micro"]) > 0 or np.nansum(table["wide_micro"]) > 0:
            found = self._find_duplicates()
            if found:
                self._define(shards, steps, deduplicate=True, scan=scan)
                return self._aggregate(shards), found
        return table, {}

    def _windowed(
        self, steps: tuple[int, int] | None, shards: list[Shard]
    ) -> tuple[list[dict[str, Any]], dict[str, Duplicates]]:
        """A segment read once in windows of whole steps (`stream.windowed`), each aggregated by the query as the
        records of the range."""
        rows, read = max(range_rows(steps, shards), 1), 0

        def aggregated(window: pa.Table) -> tuple[dict[str, Any], dict[str, Duplicates]]:
            nonlocal read
            if self.watch is not None:  # the window's share of the range's records
                self.watch.covering(read / rows, window.num_rows / rows)
            read += window.num_rows
            self.connection.register("window_records", window)
            try:
                return self._queried(steps, shards, scan="window_records r")
            finally:  # the window goes back before the next is read
                self.connection.unregister("window_records")

        files = [(str(shard.path), self.link_names[id(shard)], row_groups(shard, steps)) for shard in shards]
        try:  # (what their folders give is no column of the files: `sql.given` adds it to the window's records)
            folders = {column for column, _ in shards[0].partition}
            return windowed(files, sorted(self._present(shards) - folders), self.chunk_rows, aggregated)
        finally:
            self.defined = None

    def _aggregate(self, shards: Sequence[Shard]) -> dict[str, Any]:
        """One range's step table as arrays, by column: numpy's, as DuckDB hands them over (a pandas
        frame of each range cost a copy of every column into pandas' blocks, and the names' strings a
        conversion to Arrow strings before they became categories)."""
        one_record = one_record_form(shards)
        names = one_name_of(shards)
        absent = absent_values(shards) if self.prune else frozenset()
        self.last_query = step_sql(one_record, self.extremes, names is not None, absent)
        table: dict[str, Any] = self.connection.execute(self.last_query).fetchnumpy()
        return finished(table, names, aliases(one_record, absent), constants(one_record, absent))

    def unusable_files(self) -> list[Shard]:
        """The shards holding a NaN grad_divisor or grad_scale, or fewer positions than valid tokens (after
        `step_table`, which counts them)."""
        self._whole()
        names = {
            name
            for (name,) in self.connection.execute(
                f"SELECT DISTINCT filename FROM raw_records WHERE {UNUSABLE_RECORD}"
            ).fetchall()
        }
        return [s for s in self.shards if self.link_names[id(s)] in names]

    def records_at(self, run: str, step: int) -> pd.DataFrame:
        """Every record of one step of one run, with c, e and q = e·N."""
        self._whole()
        return self.connection.execute(RECORDS_AT_SQL, [run, step]).df()

    def rank_weights(self, rows: int, columns: int, pooled: Sequence[str] = ()) -> pd.DataFrame:
        """Per run, q = e·N of its valid records in a grid of at most `rows` rank rows by `columns` step columns
        (each cell a span of ranks and of steps; every rank its own row, every step its own column, where they
        fit): the cell's ranks, steps and lowest and highest q. N is the step's, per group and term; over every
        term in the `pooled` runs (their terms are one token mean).

        Over the whole log at once (not a range at a time), so it runs at half the memory limit, the step table
        and the figures being held beside it: DuckDB spills the rest."""
        self._whole()
        self.connection.execute(f"SET memory_limit = '{half_limit(self.memory_limit)}'")
        try:
            return self.connection.execute(
                RANK_WEIGHTS_SQL, {"rows": rows, "columns": columns, "pooled": list(pooled)}
            ).df()
        finally:
            self.connection.execute(f"SET memory_limit = '{self.memory_limit}'")

    def complete_through(self) -> dict[tuple[str, str], int]:
        """Per (run, group): the last step that every rank has recorded. Steps after it are still
        being written when the log is read during training (ranks flush at different times)."""
        self._whole()
        rows = self.connection.execute(COMPLETE_THROUGH_SQL).fetchall()
        return {(str(run), str(group)): int(step) for run, group, step in rows}

    def close(self) -> None:
        self.connection.close()
        if self.links is not None:
            shutil.rmtree(self.links, ignore_errors=True)


def aggregate_range(task: RangeTask) -> tuple[list[dict[str, Any]], dict[str, Duplicates]]:
    """A range's step table (in parts) and its repeated keys, by an engine of its own over the range's shards, on one thread:
    what `Engine.ranges_map` runs on a cluster's worker. The same query over the same records as the engine that
    cut the range, so the same bits."""
    engine = Engine.open(list(task.shards), memory_limit=task.memory_limit, threads=1, extremes=task.extremes)
    try:
        engine.prune, engine.footer_rows = task.prune, task.footer_rows
        return engine._range_table(task.steps, list(task.shards))
    finally:
        engine.close()
