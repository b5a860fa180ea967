"""Validate log shards (SPEC §2) from their footers without modifying them; bad files are reported, not fatal.

Which files and in which processes: `tokaudit.loading`."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import PurePath
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

try:  # the reader pq.ParquetFile wraps; private, so the public class stands in where it differs
    from pyarrow._parquet import ParquetReader as _ParquetReader
except ImportError:  # pragma: no cover - every pyarrow this supports has it
    _ParquetReader = None

from tokaudit.errors import LogFormatError
from tokaudit.schema import (COLUMNS_BY_NAME, INT32_MAX, REQUIRED_COLUMNS, SCHEMA_VERSION, UNNAMED, kind_accepts,
                             read_dropped)
from tokaudit.storage import Store, describe

KIND_WORDS = {"int": "an integer type", "float": "a numeric type", "bool": "bool", "string": "string",
              "timestamp": "a timestamp"}


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
    The aggregation reads these as it reads a column the file lacks (`engine.footer_facts`)."""
    run_group: tuple[str, str] | None = None
    """The one (run, group) all its records carry, defaults applied, when its footer shows it: as `names`,
    but also where the term varies (several loss terms recorded in one file)."""
    record: tuple[Any, ...] | None = None
    """A one-row file's record, one value per `signature` column (None: a null), when its footer's
    statistics give every value exactly (`footer_record`): the aggregation reads it from here instead of
    opening the file again (DuckDB's 0.3 ms of CPU a file, most of the audit of 10,000 one-row shards)."""
    constants: tuple[tuple[str, Any], ...] = ()
    """(column, value) of each of CONSTANT_COLUMNS whose footer gives the one value of every record (lowest =
    highest, no null), as its statistics hold it: a grid reads none of them (`tokaudit.grid`). A float column
    may still hide a NaN, which no statistics show."""

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


def _inspect_batch(paths: Sequence[PurePath], thorough: bool, stores: Sequence[Store | None] | None = None
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


def _packed(inspected: list[Shard | tuple[str, str]]) -> list[tuple[Any, ...] | tuple[str, str]]:
    """What a worker hands back: each shard's fields but its path, which the caller holds (a pickled Path
    is parsed again when loaded: 0.1 ms a file, more than a third of validating its footer), or the problem."""
    return [item if not isinstance(item, Shard) else tuple(getattr(item, name) for name in _FIELDS)
            for item in inspected]


def _unpacked(packed: list[tuple[Any, ...]], paths: Sequence[PurePath]) -> list[Shard | tuple[str, str]]:
    """`_packed`'s list with each shard's path given back."""
    return [Shard(path, *item) if len(item) == len(_FIELDS) else (item[0], item[1])
            for path, item in zip(paths, packed, strict=True)]


class _Footer:
    """A Parquet file's footer, parsed once: what `pq.ParquetFile` gives, less the work it does for reading
    (a map of nested column paths, about a fifth of opening a footer), which is done only when a column
    is read (`read`), from the same open file and parsed footer."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.parquet: pq.ParquetFile | None = None
        self.reader: Any = None
        try:
            if _ParquetReader is None:
                raise TypeError("no private reader")
            self.reader = _ParquetReader()
            self.reader.open(source)
            self.metadata: pq.FileMetaData = self.reader.metadata
        except (TypeError, AttributeError):  # a pyarrow whose private reader differs: the public one
            self.reader = None
            self.parquet = pq.ParquetFile(source)
            self.metadata = self.parquet.metadata

    @property
    def schema_arrow(self) -> pa.Schema:
        """Its Arrow schema (made from the footer when asked: 10 µs, which a schema seen last spares)."""
        schema: pa.Schema = self.reader.schema_arrow if self.reader is not None else self.parquet.schema_arrow  # type: ignore[union-attr]
        return schema

    def read(self, columns: list[str]) -> pa.Table:
        if self.parquet is None:
            self.parquet = pq.ParquetFile(self.source, metadata=self.metadata)
        return self.parquet.read(columns=columns, use_threads=True)


_TAIL_BYTES = 1 << 14
"""The bytes read from the end of a local file for its footer: a log's footers take 2–5 KB."""


def _local_footer(path: str) -> _Footer | None:
    """A local file's footer, read with one pread of its last _TAIL_BYTES (two where the footer is longer) and
    parsed from memory. pyarrow's reader of the file itself reads its last 64 KiB (most of a recorder's shard)
    through a file object made for it: 72 → 61 µs a file. None where the file does not open, or its last bytes
    are not a footer that parses: pyarrow's reader of the file then says what is wrong, in its words."""
    try:
        handle = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(handle).st_size
            tail = os.pread(handle, min(size, _TAIL_BYTES), max(0, size - _TAIL_BYTES))
            # "PAR1" | data | footer | the footer's length (4 bytes, little-endian) | "PAR1"
            if len(tail) >= 8 and tail[-4:] == b"PAR1":
                length = int.from_bytes(tail[-8:-4], "little") + 8
                if len(tail) < length <= size - 4:
                    tail = os.pread(handle, length, size - length)
        finally:
            os.close(handle)
        footer = _Footer(pa.BufferReader(tail))
    except Exception:
        return None
    footer.source = path  # columns are read from the file (`read`)
    return footer


def inspect_shard(path: PurePath, store: Store | None = None, thorough: bool = True) -> Shard:
    """Check one file against SPEC §2: columns, types, version, and values no audit can use.
    `thorough=False` leaves out what only a full read of grad_divisor and grad_scale shows (NaN):
    `load(..., thorough=False)` callers check those values in their aggregation instead."""
    name = _name(path, store)
    try:
        parquet = (store is None and _local_footer(name)) or _Footer(_open(path, store))
        metadata = parquet.metadata
        stored = metadata.metadata  # its key-value pairs (made anew at every ask: asked once)
        facts, index = _schema_of(parquet, stored)
    except OSError as error:
        if store is None:
            raise LogFormatError(name, f"not a readable Parquet file ({_short(error)})") from None
        raise LogFormatError(name, describe(error)) from None
    except Exception as error:
        raise LogFormatError(name, f"not a readable Parquet file ({_short(error)})") from None
    if facts.problem is not None:
        raise LogFormatError(name, facts.problem)
    present = facts.present
    try:
        record = footer_record(metadata, index, facts.signature)
        empty: frozenset[str] = frozenset()
        if record is not None:
            stats = _record_stats(record, facts)
            empty = frozenset(c for (c, _), value in zip(facts.signature, record) if value is None and c in NULLABLE_COLUMNS)
        else:
            stats, empty = _footer_stats(metadata, index, facts, present & NULLABLE_COLUMNS)
        for column in facts.unsigned:
            high = stats[column][1]
            if high is None or high > INT64_MAX:
                _raise_beyond_int64(parquet, column)
        _check_values(parquet, present, stats, thorough)
    except LogFormatError as error:
        raise LogFormatError(name, error.problem) from None
    except Exception as error:
        raise LogFormatError(name, f"cannot read the file's data ({_short(error)})") from None
    # the parent folder's name without pathlib's parsing of the path (a fifth of a footer's time)
    folder = os.path.basename(os.path.dirname(str(path))) if store is None else path.parent.name
    names = _names(stats, present, folder)
    return Shard(path=path, columns=frozenset(present), rows=metadata.num_rows,
                 default_run=folder, step_range=_range(stats["step"]), rank_range=_range(stats["rank"]),
                 micro_range=_range(stats["micro"]), world_range=_range(stats["world_size"]),
                 divisor_range=_bounds(stats["grad_divisor"]) if "grad_divisor" in stats else None,
                 dropped=read_dropped(stored),
                 store=store, signature=facts.signature,
                 names=_all_names(names), run_group=_run_group(names), null_columns=empty, record=record,
                 constants=_constants(stats))


NULLABLE_COLUMNS = frozenset({"token_weight_sum", "token_weight_min", "token_weight_max", "masked_weight_abs_sum",
                              "reported_loss", "sync", "skipped", "positions", "divisor_known"})
"""Optional columns whose absence lets the aggregation leave out aggregates (`engine.FOOTER_CONSTANTS`)."""


_LAST_FOOTER: list[tuple[Any, bytes | None, _SchemaFacts, dict[str, int]]] = []
"""The Parquet schema seen last, its stored Arrow schema, what it says and each column's place in the footer:
the shards of one log share them, and comparing two Parquet schemas (0.25 µs) spares making the Arrow
schema (10 µs) and the places (10 µs)."""


def _schema_of(parquet: _Footer, pairs: dict[bytes, bytes] | None) -> tuple[_SchemaFacts, dict[str, int]]:
    """What a file's schema says, and each column's place in its footer. Two files whose Parquet schemas
    are equal and whose writers stored the same Arrow schema (ARROW:schema, from which pyarrow takes the
    Arrow types the Parquet ones leave open: a dictionary, a time zone) have the same Arrow schema. `pairs`:
    the footer's key-value metadata."""
    metadata = parquet.metadata
    stored = (pairs or {}).get(b"ARROW:schema")
    if _LAST_FOOTER:
        schema, arrow, facts, index = _LAST_FOOTER[0]
        if arrow == stored and metadata.schema.equals(schema):
            return facts, index
    facts = _checked_schema(parquet.schema_arrow)
    index = {metadata.schema.column(i).name: i for i in range(metadata.num_columns)}
    _LAST_FOOTER[:] = [(metadata.schema, stored, facts, index)]
    return facts, index


def _footer_stats(metadata: pq.FileMetaData, index: dict[str, int], facts: _SchemaFacts, nullable: frozenset[str]
                  ) -> tuple[dict[str, tuple[Any, Any, int | None]], frozenset[str]]:
    """Per bounded column, (min, max, null count) over all row groups, None where a statistic is missing;
    and those of `nullable` that hold only nulls by the footer (a null count equal to the rows of every row
    group; a column without a null count is not claimed). Each column's statistics are taken once a row
    group, its bounds read as stored where that is the value (`_SchemaFacts.raw`, a fifth of the time of
    pyarrow's logical value) and a name's text decoded from its stored bytes. `index`: each column's place
    in the footer."""
    groups = [metadata.row_group(group) for group in range(metadata.num_row_groups)]
    out: dict[str, tuple[Any, Any, int | None]] = {}
    empty: list[str] = []
    for column in facts.bounded | nullable:
        place = index.get(column)
        bounded = column in facts.bounded
        stored = column in facts.raw
        bounding = bounded  # bounds still gathered
        only_nulls = column in nullable  # every row group's values null so far
        low: Any = None
        high: Any = None
        nulls: int | None = 0
        for group in groups:
            statistics = group.column(place).statistics if place is not None else None
            if only_nulls and (statistics is None or not statistics.has_null_count
                               or statistics.null_count != group.num_rows):
                only_nulls = False
            if bounding:
                if statistics is None or not statistics.has_min_max or nulls is None:
                    low = high = nulls = None
                    bounding = False
                else:
                    least, most = ((statistics.min_raw, statistics.max_raw) if stored
                                   else _statistic_bounds(statistics, column, facts))
                    if isinstance(least, bytes):  # a half float's: as good as none (its values are read instead)
                        low = high = nulls = None
                        bounding = False
                    else:
                        low = least if low is None else min(low, least)
                        high = most if high is None else max(high, most)
                        nulls = nulls + statistics.null_count if statistics.has_null_count else None
            if not (bounding or only_nulls):
                break
        if bounded:
            out[column] = (low, high, nulls)
        if only_nulls:
            empty.append(column)
    return out, frozenset(empty)


def _statistic_bounds(statistics: Any, column: str, facts: _SchemaFacts) -> tuple[Any, Any]:
    """A row group's (min, max) of a column whose stored statistics are not its value: a name's text decoded
    from its stored UTF-8, anything else as pyarrow gives it."""
    if column in facts.text:
        try:
            return statistics.min_raw.decode("utf-8"), statistics.max_raw.decode("utf-8")
        except (AttributeError, UnicodeDecodeError):
            pass
    return statistics.min, statistics.max


_TIMESTAMP = re.compile(r"^timestamp\[(s|ms|us|ns)(?:, tz=(.+))?\]$")
_FOOTER_TYPES = {**dict.fromkeys(("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"), pa.int64()),
                 "float": pa.float64(), "double": pa.float64(), "bool": pa.bool_(),
                 **dict.fromkeys(("string", "large_string"), pa.string())}
_PYTHON_TYPES = {pa.int64(): int, pa.float64(): float, pa.bool_(): bool, pa.string(): str}


SIGNLESS_ZEROS = frozenset({"masked_weight_abs_sum"})
"""Float columns whose zero's sign nothing reads (a sum of absolute values, only compared with 0 and tested
for finiteness): `footer_record` takes a 0 in their footer as 0.0. The recorder's probe writes 0.0 there on
almost every record."""


@functools.lru_cache(maxsize=256)
def footer_type(arrow_type: str) -> pa.DataType | None:
    """The type a `Shard.record` value of a column of this Arrow type (as `Shard.signature` names it) is
    held in: the file's own type, but integers as int64, floats as double and strings (dictionaries of
    them too) as string, each of which the records' casts turn into what they make of the file's type
    (`engine._select`: BIGINT, DOUBLE, VARCHAR) bit for bit; None for a type whose value a footer does not
    give exactly (a half float's statistics are bytes)."""
    dictionary = re.match(r"^dictionary<values=(large_)?string, ", arrow_type)
    if dictionary:
        return pa.string()
    timestamp = _TIMESTAMP.match(arrow_type)
    if timestamp:
        return pa.timestamp(timestamp.group(1), timestamp.group(2))
    return _FOOTER_TYPES.get(arrow_type)


@functools.lru_cache(maxsize=256)
def _footer_reading(arrow_type: str) -> tuple[type, bool, bool] | None:
    """How `footer_record` reads a column of this Arrow type: its value's Python type, whether the
    statistics' stored value (`min_raw`, a fifth of the time of `min`) is the value (signed integers,
    floats, bools; not unsigned integers, stored as signed, nor strings, stored as bytes), and whether it
    is a time stamp (its stored integer, in its unit). None: `footer_type` does not hold it."""
    held = footer_type(arrow_type)
    if held is None:
        return None
    if pa.types.is_timestamp(held):
        return int, True, True
    return _PYTHON_TYPES[held], arrow_type in ("int8", "int16", "int32", "int64", "float", "double", "bool"), False


def footer_record(metadata: pq.FileMetaData, index: dict[str, int], signature: tuple[tuple[str, str], ...]
                  ) -> tuple[Any, ...] | None:
    """`Shard.record`: the values of a file of one row, from its footer's statistics, when they give each
    exactly: a null count of 1 (a null), or no null and a min equal to the max. Not exact, and so None:
    a float 0 (Parquet writes min −0.0 and max +0.0 whatever its sign) but in SIGNLESS_ZEROS, NaN (never
    in statistics), a string too long for statistics, missing statistics, a type `footer_type` does not
    hold."""
    if metadata.num_rows != 1 or metadata.num_row_groups != 1:
        return None
    group = metadata.row_group(0)
    values: list[Any] = []
    for column, arrow_type in signature:
        reading = _footer_reading(arrow_type)
        statistics = group.column(index[column]).statistics
        if reading is None or statistics is None or not statistics.has_null_count:
            return None
        nulls = statistics.null_count
        if nulls == 1:
            values.append(None)
            continue
        if nulls != 0 or not statistics.has_min_max:
            return None
        expected, raw, timestamp = reading
        # a time stamp is read as its stored integer (its logical value, a datetime, has no nanoseconds)
        if timestamp and statistics.physical_type != "INT64":
            return None
        low, high = (statistics.min_raw, statistics.max_raw) if raw else (statistics.min, statistics.max)
        if type(low) is not expected or type(high) is not expected or low != high:
            return None
        value = _one_value(column, low)
        if value is _UNKNOWN:
            return None
        values.append(value)
    return tuple(values)


_UNKNOWN = object()
"""What a statistics' one value does not give (`_one_value`)."""


def _one_value(column: str, low: Any) -> Any:
    """The value every record holds where a column's statistics have min = max = `low`: `low` itself, but a
    float zero only in SIGNLESS_ZEROS (as 0.0), its sign being in no statistics (Parquet writes min −0.0 and
    max +0.0 whatever it is), and never NaN; _UNKNOWN where it gives none."""
    if low.__class__ is float and (low == 0.0 or low != low):
        return 0.0 if low == 0.0 and column in SIGNLESS_ZEROS else _UNKNOWN
    return low


def _record_stats(record: tuple[Any, ...], facts: _SchemaFacts) -> dict[str, tuple[Any, Any, int | None]]:
    """`_footer_stats` of a one-row file's bounded columns from its record (`footer_record`): (v, v, 0) for a
    value v, and for a null what a footer without a min or max gives, (None, None, None)."""
    return {column: (None, None, None) if value is None else (value, value, 0)
            for (column, _), value in zip(facts.signature, record) if column in facts.bounded}


_NAME_COLUMNS = (("run_id", None), ("group", UNNAMED), ("term", UNNAMED))
"""The columns that name a record's (run, group, term), and their defaults (None: the file's folder),
as `engine._select` applies them."""


def _names(stats: dict[str, tuple[Any, Any, int | None]], present: frozenset[str], default_run: str
           ) -> tuple[str | None, str | None, str | None]:
    """`Shard.names` from the footer's statistics, column by column: a column's one value when its min and
    max are equal and it has no null, its default when it is absent; otherwise None (a column of nulls
    only has no min or max, so it is None too: the names are then aggregated as for any log)."""
    names: list[str | None] = []
    for column, default in _NAME_COLUMNS:
        if column not in present:
            names.append(default_run if default is None else default)
            continue
        low, high, nulls = stats[column]
        names.append(low if nulls == 0 and isinstance(low, str) and low == high else None)
    return names[0], names[1], names[2]


def _all_names(names: tuple[str | None, str | None, str | None]) -> tuple[str, str, str] | None:
    run, group, term = names
    return (run, group, term) if run is not None and group is not None and term is not None else None


def _run_group(names: tuple[str | None, str | None, str | None]) -> tuple[str, str] | None:
    run, group, _ = names
    return (run, group) if run is not None and group is not None else None


CONSTANT_COLUMNS = ("world_size", "grad_divisor", "grad_scale", "positions", "divisor_known", "sync", "skipped",
                    "masked_weight_abs_sum")
"""Columns a file often holds one value of (a world size, a fixed divisor, a loss scale that did not move,
a fixed length, a divisor always seen, every backward synchronized, no update skipped, no weight on a masked
position), which its footer then gives (`Shard.constants`)."""


def _constants(stats: dict[str, tuple[Any, Any, int | None]]) -> tuple[tuple[str, Any], ...]:
    """`Shard.constants` from a file's statistics (`_footer_stats`)."""
    found = []
    for column in CONSTANT_COLUMNS:
        low, high, nulls = stats.get(column, _NO_STATISTICS)
        if nulls != 0 or low is None or low != high or low.__class__ not in (int, float, bool):
            continue
        value = _one_value(column, low)
        if value is not _UNKNOWN:
            found.append((column, value))
    return tuple(found)


_NO_STATISTICS: tuple[Any, Any, int | None] = (None, None, None)


def _range(stats: tuple[Any, Any, int | None]) -> tuple[int, int] | None:
    """(lowest, highest) of an integer column when its statistics hold both and it has no nulls."""
    bounds = _bounds(stats)
    return (int(bounds[0]), int(bounds[1])) if bounds is not None else None


def _bounds(stats: tuple[Any, Any, int | None]) -> tuple[Any, Any] | None:
    """(lowest, highest) of a column when its statistics hold both and it has no nulls."""
    low, high, nulls = stats
    return (low, high) if low is not None and high is not None and nulls == 0 else None


@dataclass(frozen=True, slots=True)
class _SchemaFacts:
    """What a schema says, worked out once for every shard that has it."""

    problem: str | None
    """What makes it unusable (SPEC §2), or None."""
    present: frozenset[str]
    """Its schema columns."""
    bounded: frozenset[str]
    """Its columns whose statistics the checks read (`_check_values`, the step, rank and microbatch ranges)."""
    unsigned: tuple[str, ...]
    """Its uint64 columns, whose values may pass the int64 range."""
    signature: tuple[tuple[str, str], ...]
    """`Shard.signature`: the fields that are schema columns."""
    raw: frozenset[str]
    """Its columns whose statistics' stored value is the value (`_footer_reading`): read as stored, which
    takes a fifth of the time of the logical value."""
    text: frozenset[str]
    """Its columns of text (string, large_string, a dictionary of either), whose statistics' value is their
    stored UTF-8 bytes decoded."""


_SCHEMAS: dict[tuple[tuple[str, str], ...], _SchemaFacts] = {}
"""Schemas already checked, by their fields."""
def _checked_schema(schema: pa.Schema) -> _SchemaFacts:
    """What a schema says, made once for all the shards that have it (the schema seen last is not even
    made again: `_schema_of`)."""
    fields = tuple((f.name, str(f.type)) for f in schema)
    facts = _SCHEMAS.get(fields)
    if facts is None:
        if len(_SCHEMAS) > 1024:
            _SCHEMAS.clear()
        present = frozenset(column for column in schema.names if column in COLUMNS_BY_NAME)
        problem = _schema_problem(schema, present)
        unsigned = () if problem else tuple(sorted(c for c in present if pa.types.is_uint64(schema.field(c).type)))
        signature = tuple(f for f in fields if f[0] in COLUMNS_BY_NAME)
        raw = frozenset(c for c, arrow_type in signature if (_footer_reading(arrow_type) or (int, False, False))[1])
        text = frozenset(c for c, arrow_type in signature if footer_type(arrow_type) == pa.string())
        facts = _SCHEMAS[fields] = _SchemaFacts(problem, present, (present & _STATISTICS) | set(unsigned), unsigned,
                                                signature, raw, text)
    return facts


def _schema_problem(schema: pa.Schema, present: frozenset[str]) -> str | None:
    """What makes a schema unusable (SPEC §2: required columns, no repeats, each column's type), or None.
    `present`: its schema columns."""
    for column in REQUIRED_COLUMNS:
        if column not in schema.names:
            return f"missing column '{column}'"
    repeated = sorted({column for column in schema.names if schema.names.count(column) > 1 and column in COLUMNS_BY_NAME})
    if repeated:
        return f"column '{repeated[0]}' appears more than once"
    for column in sorted(present):
        expected = COLUMNS_BY_NAME[column].kind
        arrow_type = schema.field(column).type
        if not kind_accepts(expected, arrow_type):
            return f"column '{column}' has type {arrow_type}, expected {KIND_WORDS[expected]}"
    return None


# (column, lowest allowed value, what it means); null never allowed for required columns.
_LOWER_BOUNDS: tuple[tuple[str, int, str], ...] = (
    ("valid_tokens", 0, "a negative count"),
    ("positions", 0, "a negative count"),
    ("world_size", 1, "a world size below 1"),
    ("rank", 0, "a negative rank"),
    ("micro", 0, "a negative microbatch index"),
    ("masked_weight_abs_sum", 0, "a negative sum of absolute values"),
)
_UPPER_BOUNDS: tuple[tuple[str, int, str], ...] = (
    ("valid_tokens", INT32_MAX, "more tokens than a microbatch can hold (above 2³¹ − 1)"),
    ("positions", INT32_MAX, "more positions than a microbatch can hold (above 2³¹ − 1)"),
    ("world_size", INT32_MAX, "a value beyond int32, its type in SPEC §2"),
    ("rank", INT32_MAX, "a value beyond int32, its type in SPEC §2"),
    ("micro", INT32_MAX, "a value beyond int32, its type in SPEC §2"),
)
"""(column, highest allowed value, what it means): the step table holds ranks, microbatch indices, W and one
record's count in 32 bits, and a step's N (Σ n over at most 2³² records) then stays exact in int64 and in a
float64. A file may store these columns in any integer type."""
_STATISTICS = (frozenset(REQUIRED_COLUMNS) | {column for column, _, _ in _LOWER_BOUNDS}
               | {"schema_version", "run_id", "group", "term"} | set(CONSTANT_COLUMNS))
"""Columns whose footer statistics are read: `_check_values`'s, the names' (`_names`) and the constants'
(`_constants`)."""


def _check_values(parquet: _Footer, present: frozenset[str], stats: dict[str, tuple[Any, Any, int | None]],
                  thorough: bool) -> None:
    """Statistics first (no data read); the columns themselves only when statistics cannot decide.
    A NaN divisor or scale never shows in statistics, nor does T < n on one record where T's and n's ranges
    overlap: `thorough` reads those columns; otherwise the aggregation counts them and only the files it
    names are inspected thoroughly."""
    need: set[str] = set()
    if "schema_version" in present:
        high = stats["schema_version"][1]
        if high is None:
            need.add("schema_version")
        elif high > SCHEMA_VERSION:
            raise LogFormatError("", _newer_version(high))
    for column in REQUIRED_COLUMNS:
        if column == "backward_scalar":
            continue
        if stats[column][2] != 0:
            need.add(column)
    if stats["backward_scalar"][2] != 0:
        need.update({"backward_scalar", "token_weight_sum"} & present)
        if "token_weight_sum" not in present:
            need.add("backward_scalar")
    for column, lowest, _ in _LOWER_BOUNDS:
        if column in present and (stats[column][0] is None or stats[column][0] < lowest):
            need.add(column)
    for column, highest, _ in _UPPER_BOUNDS:
        if column in present and (stats[column][1] is None or stats[column][1] > highest):
            need.add(column)
    if "grad_divisor" in present and (stats["grad_divisor"][0] is None or stats["grad_divisor"][0] <= 0):
        need.add("grad_divisor")
    if thorough and "positions" in present:
        # T ≥ n on every record (T counts the positions the n valid tokens are among): the statistics settle
        # it when the file's least T is at least its greatest n; otherwise the aggregation counts the records
        # (`unusable_values`) and only the files it names are read here
        least, greatest = stats["positions"][0], stats["valid_tokens"][1]
        if least is None or greatest is None or least < greatest:
            need.update({"positions", "valid_tokens"})
    rank_high, world_low = stats["rank"][1], stats["world_size"][0]
    if rank_high is None or world_low is None or rank_high >= world_low:
        need.update({"rank", "world_size"})
    if thorough:
        for column in ("grad_divisor", "grad_scale"):
            if column in present:
                need.add(column)  # NaN never shows in statistics
    if need:
        _check_rows(parquet.read(sorted(need)), need)


def _check_rows(table: pa.Table, columns: Iterable[str]) -> None:
    columns = set(columns)
    if "schema_version" in columns:
        high = pc.max(table["schema_version"]).as_py()
        if high is not None and high > SCHEMA_VERSION:
            raise LogFormatError("", _newer_version(high))
    for column in REQUIRED_COLUMNS:
        if column in columns and column != "backward_scalar":
            _no_nulls(table, column)
    if "backward_scalar" in columns:
        missing = pc.is_null(table["backward_scalar"])
        if "token_weight_sum" in table.column_names:
            missing = pc.and_(missing, pc.is_null(table["token_weight_sum"]))
        _raise_at_first(missing, "column 'backward_scalar' is null where no probe weights were recorded")
    for column, lowest, meaning in _LOWER_BOUNDS:
        if column in columns:
            values = table[column]
            if pa.types.is_floating(values.type):
                values = pc.cast(values, pa.float64())  # a half float has no kernels of its own
            _raise_at_first(pc.less(values, lowest), f"column '{column}' has {meaning}", table[column])
    for column, highest, meaning in _UPPER_BOUNDS:
        if column in columns:
            _raise_at_first(pc.greater(table[column], highest), f"column '{column}' holds {meaning}", table[column])
    if {"rank", "world_size"} <= columns:
        _raise_at_first(pc.greater_equal(table["rank"], table["world_size"]),
                        "column 'rank' is not below 'world_size'", table["rank"])
    if {"positions", "valid_tokens"} <= columns:
        below = pc.fill_null(pc.less(table["positions"], table["valid_tokens"]), False)
        if pc.any(below).as_py():
            row = pc.index(below, True).as_py()
            raise LogFormatError("", f"column 'positions' is below 'valid_tokens' ({table['positions'][row].as_py()} "
                                     f"< {table['valid_tokens'][row].as_py()}) at row {row}")
    if "grad_divisor" in columns:
        divisor = pc.cast(table["grad_divisor"], pa.float64())  # a half float has no kernels of its own
        bad = pc.or_(pc.is_nan(divisor), pc.less_equal(divisor, 0))
        _raise_at_first(bad, "column 'grad_divisor' is not a positive number", table["grad_divisor"])
    if "grad_scale" in columns:
        _raise_at_first(pc.is_nan(pc.cast(table["grad_scale"], pa.float64())),
                        "column 'grad_scale' is NaN", table["grad_scale"])


INT64_MAX = (1 << 63) - 1


def _raise_beyond_int64(parquet: _Footer, column: str) -> None:
    values = parquet.read([column])[column]
    _raise_at_first(pc.greater(values, pa.scalar(INT64_MAX, pa.uint64())),
                    f"column '{column}' holds a value beyond the int64 range", values)


def _no_nulls(table: pa.Table, column: str) -> None:
    _raise_at_first(pc.is_null(table[column]), f"column '{column}' has a null value")


def _raise_at_first(mask: Any, problem: str, values: Any = None) -> None:
    mask = pc.fill_null(mask, False)
    if not pc.any(mask).as_py():
        return
    row = pc.index(mask, True).as_py()
    shown = f" ({values[row].as_py()!r})" if values is not None else ""
    raise LogFormatError("", f"{problem}{shown} at row {row}")


def _newer_version(version: int) -> str:
    return (f"schema_version {version} is newer than this tokaudit reads ({SCHEMA_VERSION}); "
            "upgrade tokaudit (pip install -U tokaudit)")


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:160]
