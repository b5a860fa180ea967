"""Validate log shards from their footers without modifying them; bad files are reported, not fatal.

Which files and in which processes: `tokaudit._loading`. What a footer says: `tokaudit._footers`; what is
refused: `tokaudit._validation`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import PurePath
from typing import Any

import pyarrow as pa

from tokaudit.errors import LogFormatError, first_line
from tokaudit._footers import Footer, FragmentFooter, SchemaFacts, all_names, bounds_of, checked_schema, footer_record
from tokaudit._footers import footer_stats, local_footer, names_of, range_of, record_stats, row_group_steps
from tokaudit._footers import run_group_of
from tokaudit._partitions import PARTITION_COLUMNS, partition_folders, partition_values, run_folder
from tokaudit._schema import Provenance, read_dropped, read_provenance
from tokaudit._storage import Store, describe, sized_fragment
from tokaudit._validation import INT64_MAX, check_values, raise_beyond_int64


@dataclass(frozen=True, slots=True)
class Shard:
    """One readable log file."""

    path: PurePath
    """Where it is: a local path, or the path inside `store`."""
    columns: frozenset[str]
    """Schema columns it holds (extra columns are ignored)."""
    rows: int
    """Row count from the footer."""
    default_run: str
    """Run id for rows without one: the file's parent folder name."""
    step_range: tuple[int, int] | None = None
    """Lowest and highest step, from the footer's statistics (None when they are missing)."""
    rank_range: tuple[int, int] | None = None
    """Lowest and highest rank, likewise."""
    micro_range: tuple[int, int] | None = None
    """Lowest and highest microbatch index, likewise."""
    dropped: dict[str, Any] | None = None
    """The recorder's note of records it could not keep ({"run", "group", "rank", "steps"})."""
    provenance: Provenance = Provenance()
    """What its footer's provenance says: the trainer, a pipeline schedule's division, the launch."""
    store: Store | None = None
    """The object store holding it (s3://, gs://, …); None for a local file."""
    signature: tuple[tuple[str, str], ...] = ()
    """(name, Arrow type) of its schema columns in file order: shards that share one are scanned together
    without reconciling their schemas file by file."""
    names: tuple[str, str, str] | None = None
    """The one (run, group, term) all its records carry, defaults applied, when its footer shows it (each
    column absent, or one value with no null); None when it may hold several."""
    world_range: tuple[int, int] | None = None
    """Lowest and highest world_size, from the footer's statistics."""
    divisor_range: tuple[Any, Any] | None = None
    """Lowest and highest grad_divisor as the footer's statistics give them (None when it lacks them, or
    the column is absent or holds a null)."""
    null_columns: frozenset[str] = frozenset()
    """Its columns of NULLABLE_COLUMNS whose footer shows no value at all (in every row group a null count
    equal to the rows): what the recorder writes for what it was not given (no probe, no reported loss).
    The aggregation reads these as it reads a column the file lacks (`engine.sql.valueless_columns`)."""
    run_group: tuple[str, str] | None = None
    """The one (run, group) all its records carry, defaults applied, when its footer shows it: as `names`,
    but also where the term varies (several loss terms recorded in one file)."""
    run_override: bool = False
    """Its records' run is `default_run` whatever their run_id says: a run id that other folders hold too,
    this folder's run named by its path (`loading.separate_runs`)."""
    partition: tuple[tuple[str, Any], ...] = ()
    """(column, value) of each column its `column=value` folders give and the file lacks (`partitions`), the value
    of every record of it (None: a null); they are among `columns`, and not in `signature`."""
    step_groups: tuple[tuple[int, int, int], ...] = ()
    """Per row group (first step, last step, rows) where the file has several with step statistics
    (`footers.row_group_steps`); () for one row group, which `step_range` and `rows` describe."""
    record: tuple[Any, ...] | None = None
    """A one-row file's record, one value per `signature` column (None: a null), when its footer's
    statistics give every value exactly (`footer_record`): the aggregation reads it from here instead of
    opening the file again (what most of the audit of many one-row shards would cost)."""
    shadowed: tuple[str, ...] = ()
    """Its extra columns named as what the aggregation's scan adds to each record (`footers.SCAN_COLUMNS`): DuckDB's
    Parquet scan cannot read the file beside them, so it is scanned as an Arrow dataset without them."""

    @property
    def name(self) -> str:
        """How it is named to people: its local path, or its URL."""
        return _name(self.path, self.store)

    def may_hold(self, first: int, last: int) -> bool:
        """Its footer does not rule out a step from first to last (no statistics: it may hold any)."""
        return self.step_range is None or (self.step_range[0] <= last and self.step_range[1] >= first)

    def open(self) -> Any:
        """A file pyarrow reads it from, on disk or in its store."""
        return _open(self.path, self.store)


def _name(path: PurePath, store: Store | None) -> str:
    return store.url(path) if store is not None else str(path)


def _open(path: PurePath, store: Store | None) -> Any:
    # A NativeFile either way: for a local path pyarrow then skips resolving a filesystem.
    return store.filesystem.open_input_file(str(path)) if store is not None else pa.OSFile(str(path))


def inspect_batch(
    paths: Sequence[PurePath], thorough: bool, stores: Sequence[Store | None] | None = None
) -> list[Shard | tuple[str, str]]:
    """Each file's Shard, or (its name, its problem): what crosses back from a worker process."""
    out: list[Shard | tuple[str, str]] = []
    for index, path in enumerate(paths):
        try:
            out.append(inspect_shard(path, stores[index] if stores else None, thorough))
        except LogFormatError as error:
            out.append((error.path, error.problem))
    return out


_FIELDS = tuple(f.name for f in fields(Shard) if f.name != "path")


def packed_shards(inspected: list[Shard | tuple[str, str]]) -> list[tuple[Any, ...] | tuple[str, str]]:
    """What a worker hands back: each shard's fields but its path, which the caller holds (a pickled Path
    is parsed again when loaded, a large share of validating its footer), or the problem."""
    return [
        item if not isinstance(item, Shard) else tuple(getattr(item, name) for name in _FIELDS) for item in inspected
    ]


def unpacked_shards(packed: list[tuple[Any, ...]], paths: Sequence[PurePath]) -> list[Shard | tuple[str, str]]:
    """`packed_shards`'s list with each shard's path given back."""
    return [
        Shard(path, *item) if len(item) == len(_FIELDS) else (item[0], item[1])
        for path, item in zip(paths, packed, strict=True)
    ]


def inspect_shard(path: PurePath, store: Store | None = None, thorough: bool = True) -> Shard:
    """Check one file against the log format: columns, types, version, and values no audit can use.
    `thorough=False` leaves out what only a full read of grad_divisor and grad_scale shows (NaN):
    `load(..., thorough=False)` callers check those values in their aggregation instead."""
    name = _name(path, store)
    folders = partition_folders(path)
    supplied = frozenset(column for column, _ in folders if column in PARTITION_COLUMNS)
    parquet, stored, facts, index = _read_footer(path, store, name, supplied)
    metadata = parquet.metadata
    try:
        given = partition_values(folders, facts.present)
    except LogFormatError as error:
        raise LogFormatError(name, error.problem) from None
    present = facts.present | given.keys()
    record, stats, empty = _footer_values(name, parquet, index, facts, thorough, given)
    # the parent folder's name without pathlib's parsing of the path (a fifth of a footer's time)
    folder = os.path.basename(os.path.dirname(str(path))) if store is None else path.parent.name
    if folder.endswith(".parquet") or "=" in folder:  # a part of a Spark-style dataset: its run's folder is above
        folder = run_folder(path).name
    names = names_of(stats, present, folder)
    try:
        dropped = read_dropped(stored)
    except ValueError as error:
        raise LogFormatError(name, str(error)) from None
    return Shard(
        path=path,
        columns=present,
        partition=tuple(sorted(given.items())),
        rows=metadata.num_rows,
        default_run=folder,
        step_range=range_of(stats["step"]),
        rank_range=range_of(stats["rank"]),
        micro_range=range_of(stats["micro"]),
        world_range=range_of(stats["world_size"]),
        divisor_range=bounds_of(stats["grad_divisor"]) if "grad_divisor" in stats else None,
        dropped=dropped,
        provenance=read_provenance(stored),
        store=store,
        signature=facts.signature,
        names=all_names(names),
        run_group=run_group_of(names),
        null_columns=empty,
        step_groups=row_group_steps(metadata, index, facts) if record is None else (),
        record=record,
        shadowed=facts.shadowed,
    )


def _read_footer(
    path: PurePath, store: Store | None, name: str, supplied: frozenset[str]
) -> tuple[Footer, dict[bytes, bytes] | None, SchemaFacts, dict[str, int]]:
    """`inspect_shard`'s file opened: its footer, the footer's key-value pairs, what its schema says and each
    column's place in the footer. A file that is no readable Parquet file, or whose schema is refused, raises
    its problem, named `name`. `supplied`: the columns its folders may give (`partitions.PARTITION_COLUMNS`)."""
    try:
        if store is None:
            parquet = local_footer(name) or Footer(_open(path, store))
        else:
            fragment = sized_fragment(store, str(path))
            parquet = FragmentFooter(fragment) if fragment is not None else Footer(_open(path, store))
        metadata = parquet.metadata
        stored = metadata.metadata  # its key-value pairs (made anew at every ask: asked once)
        facts, index = _schema_of(parquet, stored, supplied)
    except OSError as error:
        if store is None:
            raise LogFormatError(name, f"not a readable Parquet file ({first_line(error)})") from None
        raise LogFormatError(name, describe(error)) from None
    except Exception as error:
        raise LogFormatError(name, f"not a readable Parquet file ({first_line(error)})") from None
    if facts.problem is not None:
        raise LogFormatError(name, facts.problem)
    return parquet, stored, facts, index


def _footer_values(
    name: str, parquet: Footer, index: dict[str, int], facts: SchemaFacts, thorough: bool, given: dict[str, Any]
) -> tuple[tuple[Any, ...] | None, dict[str, tuple[Any, Any, int | None]], frozenset[str]]:
    """`inspect_shard`'s values checked: a one-row file's record where its footer gives it exactly (else None),
    each bounded column's (min, max, null count), and the columns of NULLABLE_COLUMNS with no value. Values no
    audit can use raise their problem, named `name`. `given`: the values its folders give (`partition_values`),
    checked as the file's own."""
    metadata = parquet.metadata
    present = facts.present | given.keys()
    try:
        record = footer_record(metadata, index, facts.signature)
        empty: frozenset[str] = frozenset()
        if record is not None:
            stats = record_stats(record, facts)
            empty = frozenset(
                c for (c, _), value in zip(facts.signature, record) if value is None and c in NULLABLE_COLUMNS
            )
        else:
            stats, empty = footer_stats(metadata, index, facts, present & NULLABLE_COLUMNS)
        for column in facts.unsigned:
            high = stats[column][1]
            if high is None or high > INT64_MAX:
                raise_beyond_int64(parquet, column)
        for column, value in given.items():
            stats[column] = (value, value, 0) if value is not None else (None, None, metadata.num_rows)
        readable = _WithPartitions(parquet, given, metadata.num_rows) if given else parquet
        if metadata.num_rows:  # a file of no record (pandas' empty frame: columns of type null) has no value to check
            check_values(readable, present, stats, thorough, exact=record is not None)
    except LogFormatError as error:
        # a value its folder gave is the folder's to mend, not the file's
        folders = [f"{column}={value}" for column, value in given.items() if f"'{column}'" in error.problem]
        said = f" (from its folder {', '.join(folders)})" if folders else ""
        raise LogFormatError(name, error.problem + said) from None
    except Exception as error:
        raise LogFormatError(name, f"cannot read the file's data ({first_line(error)})") from None
    return record, stats, empty


class _WithPartitions:
    """A file's columns read whole, with those its folders give (`partition_values`) as columns of their value."""

    def __init__(self, parquet: Footer, given: dict[str, Any], rows: int) -> None:
        self.parquet, self.given, self.rows = parquet, given, rows

    def read(self, columns: list[str]) -> pa.Table:
        own = [c for c in columns if c not in self.given]
        table = self.parquet.read(own) if own else pa.table({})
        given = {c: pa.array([self.given[c]] * self.rows) for c in columns if c in self.given}
        return pa.table({**{c: table[c] for c in own}, **given})


NULLABLE_COLUMNS = frozenset(
    {
        "token_weight_sum",
        "token_weight_min",
        "token_weight_max",
        "masked_weight_abs_sum",
        "reported_loss",
        "sync",
        "skipped",
        "positions",
        "divisor_known",
        "precision_bits",
    }
)
"""Optional columns a scan of files that hold no value of them reads as typed NULLs (`engine.sql.valueless_columns`)."""

_LAST_FOOTER: list[tuple[Any, bytes | None, frozenset[str], SchemaFacts, dict[str, int]]] = []
"""The Parquet schema seen last, its stored Arrow schema, the columns its folders gave, what it says and each
column's place in the footer: the shards of one log share them, and comparing two Parquet schemas is far cheaper
than making the Arrow schema and the places again."""


def _schema_of(
    parquet: Footer, pairs: dict[bytes, bytes] | None, supplied: frozenset[str]
) -> tuple[SchemaFacts, dict[str, int]]:
    """What a file's schema says, and each column's place in its footer. Two files whose Parquet schemas
    are equal and whose writers stored the same Arrow schema (ARROW:schema, from which pyarrow takes the
    Arrow types the Parquet ones leave open: a dictionary, a time zone) have the same Arrow schema. `pairs`:
    the footer's key-value metadata; `supplied`: the columns its folders may give."""
    metadata = parquet.metadata
    stored = (pairs or {}).get(b"ARROW:schema")
    if _LAST_FOOTER:
        schema, arrow, given, facts, index = _LAST_FOOTER[0]
        if arrow == stored and given == supplied and metadata.schema.equals(schema):
            return facts, index
    facts = checked_schema(parquet.schema_arrow, supplied)
    index = {metadata.schema.column(i).name: i for i in range(metadata.num_columns)}
    _LAST_FOOTER[:] = [(metadata.schema, stored, supplied, facts, index)]
    return facts, index
