"""A log opened: its footers validated and its records aggregated into the step table, the files that cannot be
decoded or whose values no audit can use named and left out."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import duckdb
import pandas as pd
import pyarrow.parquet as pq

from tokaudit._cluster import Cluster
from tokaudit._engine import Aggregating, Engine, Spilled
from tokaudit._loading import Loading, LogSet, cores, load, start_loading
from tokaudit._reader import Shard
from tokaudit._validation import check_every_row
from tokaudit.errors import LogFormatError, UsageError, first_line


Progress = Callable[[str | Aggregating], None]
"""What is told what the audit is doing: a line of text, or where the aggregation is."""

PROGRESS_ROWS = 1_000_000
"""Logs larger than this say on stderr what is being read."""

EVIDENCE_ROWS = 1_000_000
"""Logs of at most this many records aggregate every step's evidence columns (`engine.EVIDENCE`:
where its heaviest and lightest token were) in the one query: a little more of a short query, where each
finding's step aggregated again alone costs a DuckDB connection and a query of its own. Larger logs
aggregate them for a finding's step only (`_Extremes`): over every step they would cost a tenth of the
query and 48 bytes a step."""


def open_logs(
    paths: Sequence[str | os.PathLike[str]],
    progress: Progress | None = None,
    only_steps: tuple[int, int] | None = None,
    threads: int | None = None,
    started: Loading | None = None,
    loaded: LogSet | None = None,
) -> tuple[LogSet, Engine | None, pd.DataFrame]:
    """`open_log_parts` with the step table whole."""
    logset, engine, steps = open_log_parts(paths, progress, only_steps, threads, started, loaded=loaded)
    assert isinstance(steps, pd.DataFrame)
    return logset, engine, steps


def load_logs(
    paths: Sequence[str | os.PathLike[str]],
    started: Loading | None = None,
    threads: int | None = None,
    cluster: Cluster | None = None,
) -> LogSet:
    """The logs' footers validated (`load(paths, thorough=False)`): the load already under way (`started`),
    or one now."""
    # Footers are validated by as many processes as DuckDB has threads: every core unless told
    # (the trackers' audit beside training takes one, and so validates in its own process).
    if cluster is not None:  # the footers read on its workers
        with started or start_loading(paths, thorough=False) as found:
            return cluster.load(found)
    return started.result() if started is not None else load(paths, thorough=False, workers=threads or cores())


def open_log_parts(
    paths: Sequence[str | os.PathLike[str]],
    progress: Progress | None = None,
    only_steps: tuple[int, int] | None = None,
    threads: int | None = None,
    started: Loading | None = None,
    evidence: bool = False,
    spill: bool = False,
    loaded: LogSet | None = None,
    cluster: Cluster | None = None,
) -> tuple[LogSet, Engine | None, pd.DataFrame | Spilled]:
    """Load, validate and aggregate. A shard DuckDB cannot decode, or whose values no audit can use, is
    reported and left out.

    Files are validated from their footers; a NaN divisor or scale, which no footer shows, is counted
    by the aggregation, and only the files holding one are then read in full to say where.
    `started`: this load of `paths` already under way (`start_loading(paths, False, ...)`). `evidence`:
    a log of at most EVIDENCE_ROWS records is aggregated with the evidence columns (`engine.EVIDENCE`).
    `spill`: a table of more than `engine.SPILL_STEPS` steps is kept on disk a range at a time (`Spilled`,
    which the caller closes). `loaded`: the logs' footers already validated (`load(paths, thorough=False)`),
    which are then not validated again. `cluster`: the footers and the step ranges are read and aggregated on its
    workers (`tokaudit._cluster`)."""
    since = started.since if started is not None else time.time_ns()
    logset = loaded if loaded is not None else load_logs(paths, started, threads, cluster)
    shards = list(logset.shards)
    if only_steps is not None:
        # Files whose footer statistics put every step outside the range are not read at all.
        shards = [s for s in shards if s.may_hold(*only_steps)]
    problems = list(logset.problems)
    rows = sum(s.rows for s in shards)
    if only_steps is None:  # a folder of files of the log's columns and no row: nothing to judge there, said
        problems.extend(_empty_folders(shards))
    large = rows > PROGRESS_ROWS
    if progress and large:
        progress(f"reading {len(shards)} file(s), {rows:,} rows")
    while shards:
        done = _aggregated(
            shards,
            only_steps,
            threads,
            evidence and rows <= EVIDENCE_ROWS,
            cluster,
            progress if large else None,
            spill,
            since,
        )
        if isinstance(done, dict):  # files to leave out, named in the problems: the others are aggregated again
            problems.extend(done.values())
            shards = [s for s in shards if s.path not in done]
            continue
        engine, steps = done
        return LogSet(shards, problems), engine, steps
    return LogSet(shards, problems), None, pd.DataFrame()


def _empty_folders(shards: Sequence[Shard]) -> list[LogFormatError]:
    """Each folder whose files hold the log's columns and no row: one problem, whatever the folders beside it hold."""
    held: dict[str, list[int]] = {}
    for shard in shards:
        held.setdefault(
            str(shard.path.parent) if shard.store is None else shard.store.url(shard.path.parent), []
        ).append(shard.rows)
    return [
        LogFormatError(folder, f"no records: {len(rows)} Parquet file(s) of the log's columns, and no row in any")
        for folder, rows in held.items()
        if not any(rows)
    ]


def _aggregated(
    shards: list[Shard],
    only_steps: tuple[int, int] | None,
    threads: int | None,
    extremes: bool,
    cluster: Cluster | None,
    progress: Progress | None,
    spill: bool,
    since: int,
) -> tuple[Engine, pd.DataFrame | Spilled] | dict[object, LogFormatError]:
    """One aggregation of these shards: the engine and its step table, or the files to leave out before the next
    try (values no audit can use, a file DuckDB cannot decode, or one changed since the audit found it at `since`),
    each with its problem."""
    try:
        engine = Engine.open(
            shards,
            only_steps=only_steps,
            threads=threads,
            extremes=extremes,
            ranges_map=cluster.map if cluster else None,
        )
        try:
            steps = engine.step_parts(progress, spill)
            # a file rewritten or replaced while it was read, which DuckDB read without an error, is as much to leave
            # out as one it could not read
            unusable = changed(shards, since)
            if not unusable and (
                steps.unusable_values.sum() > 0 if isinstance(steps, pd.DataFrame) else steps.unusable > 0
            ):
                unusable = _unusable(engine.unusable_files())
            if unusable:
                engine.close()
                if isinstance(steps, Spilled):
                    steps.close()
                return unusable
            return engine, steps
        except (duckdb.Error, OSError):
            engine.close()
            raise
    except duckdb.InterruptException:
        raise KeyboardInterrupt from None  # Ctrl-C inside a query: the user's, never a shard's fault
    except (duckdb.Error, OSError) as error:  # (an object store's file gone: pyarrow's OSError, in DuckDB's scan)
        broken = _undecodable(shards) or changed(shards, since)
        if not broken and not isinstance(error, duckdb.Error):
            raise
        if not broken and isinstance(error, duckdb.OutOfMemoryException):
            # every file decodes: the limit is too small for this log, which is no file's fault
            raise UsageError(
                f"DuckDB ran out of memory under its limit ({first_line(error, 200)}); "
                "raise TOKAUDIT_MEMORY_LIMIT (default 512MB) or lower TOKAUDIT_CHUNK_ROWS"
            ) from None
        if not broken:
            raise LogFormatError(
                ", ".join(s.name for s in shards[:3]), f"cannot be aggregated ({first_line(error, 200)})"
            ) from None
        return broken


def changed(shards: list[Shard], since: int) -> dict[object, LogFormatError]:
    """Local shards changed, or gone, since the audit found them (`since`, ns): a file rewritten or replaced while it
    was read (a compaction, an rsync) may fail the aggregation and read whole again after; the others are not to
    blame. The change time, which this machine's clock sets and no tool can (rsync -a and cp -p set the modification
    time back to the source's, and a clock ahead sets it in the future)."""
    found: dict[object, LogFormatError] = {}
    for shard in shards:
        try:
            moved = shard.store is None and os.stat(shard.path).st_ctime_ns >= since
        except OSError:
            moved = True
        if moved:
            found[shard.path] = LogFormatError(
                shard.name, "changed while the audit read it (rewritten or replaced): audit it again once it is written"
            )
    return found


def _unusable(shards: list[Shard]) -> dict[object, LogFormatError]:
    """Every row of the shards the aggregation found a value no audit can use in (`UNUSABLE_RECORD`) checked, whatever
    their statistics say (they were checked at load): one line each."""
    found: dict[object, LogFormatError] = {}
    for shard in shards:
        try:
            check_every_row(pq.ParquetFile(shard.open()), frozenset(c for c, _ in shard.signature))
        except LogFormatError as error:
            found[shard.path] = LogFormatError(shard.name, error.problem)
        except Exception as error:  # (a file gone or damaged since the aggregation read it)
            found[shard.path] = LogFormatError(shard.name, f"cannot read the file's data ({first_line(error)})")
    return found


def _undecodable(shards: list[Shard]) -> dict[object, LogFormatError]:
    """Shards whose footer reads but whose data pages do not (corruption inside the file)."""
    broken: dict[object, LogFormatError] = {}
    for shard in shards:
        try:
            # every page decoded, a batch at a time: after DuckDB's failed aggregation the process holds its peak,
            # and a whole file read here would add to it
            for _ in pq.ParquetFile(shard.open()).iter_batches(batch_size=65_536):
                pass
        except Exception as error:
            said = "gone: removed or renamed since the audit listed it" if _gone(shard) else None
            broken[shard.path] = LogFormatError(shard.name, said or f"corrupt data ({first_line(error)})")
    return broken


def _gone(shard: Shard) -> bool:
    """Whether the shard's file is no longer where the audit listed it (on disk or in its object store)."""
    try:
        if shard.store is None:
            return not os.path.lexists(shard.path)
        import pyarrow.fs as pafs

        return bool(shard.store.filesystem.get_file_info(str(shard.path)).type == pafs.FileType.NotFound)
    except OSError:
        return False
