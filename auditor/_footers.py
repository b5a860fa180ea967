"""What a Parquet footer says of its file: its schema's facts, statistics per column, a one-row file's record,
names and ranges."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokaudit._schema import COLUMNS_BY_NAME, REQUIRED_COLUMNS, UNNAMED, kind_accepts
from tokaudit._validation import STATISTICS_COLUMNS


try:  # the reader pq.ParquetFile wraps; private, so the public class stands in where it differs
    from pyarrow._parquet import ParquetReader as _ParquetReader
except ImportError:  # pragma: no cover - every pyarrow this supports has it
    _ParquetReader = None

KIND_WORDS = {
    "int": "an integer type",
    "float": "a float or integer type",
    "bool": "bool",
    "string": "string",
    "timestamp": "a timestamp",
}


class Footer:
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
        """Its Arrow schema, made from the footer when asked (a schema seen last spares it)."""
        schema: pa.Schema = self.reader.schema_arrow if self.reader is not None else self.parquet.schema_arrow  # type: ignore[union-attr]
        return schema

    def read(self, columns: list[str]) -> pa.Table:
        if self.parquet is None:
            self.parquet = pq.ParquetFile(self.source, metadata=self.metadata)
        return self.parquet.read(columns=columns, use_threads=True)


class FragmentFooter(Footer):
    """An object's footer read through a dataset fragment that knows the object's size: pyarrow's reader of a
    path first asks the store for its size (a HEAD), half the requests of a log of small objects."""

    def __init__(self, fragment: Any) -> None:
        fragment.ensure_complete_metadata()  # one ranged GET of the object's tail
        self.fragment = fragment
        self.metadata = fragment.metadata
        self.reader = self.parquet = None

    @property
    def schema_arrow(self) -> pa.Schema:
        schema: pa.Schema = self.fragment.physical_schema
        return schema

    def read(self, columns: list[str]) -> pa.Table:
        table: pa.Table = self.fragment.to_table(columns=columns)
        return table


TAIL_BYTES = 1 << 14
"""The bytes read from the end of a local file for its footer: a log's footers take 2–5 KB."""


def local_footer(path: str) -> Footer | None:
    """A local file's footer, read with one pread of its last TAIL_BYTES (two where the footer is longer) and
    parsed from memory. pyarrow's reader of the file itself reads its last 64 KiB (most of a recorder's shard)
    through a file object made for it, which costs more. None where the file does not open, or its last bytes
    are not a footer that parses: pyarrow's reader of the file then says what is wrong, in its words."""
    try:
        handle = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(handle).st_size
            tail = os.pread(handle, min(size, TAIL_BYTES), max(0, size - TAIL_BYTES))
            # "PAR1" | data | footer | the footer's length (4 bytes, little-endian) | "PAR1"
            if len(tail) >= 8 and tail[-4:] == b"PAR1":
                length = int.from_bytes(tail[-8:-4], "little") + 8
                if len(tail) < length <= size - 4:
                    tail = os.pread(handle, length, size - length)
        finally:
            os.close(handle)
        footer = Footer(pa.BufferReader(tail))
    except Exception:
        return None
    footer.source = path  # columns are read from the file (`read`)
    return footer


def footer_stats(
    metadata: pq.FileMetaData, index: dict[str, int], facts: SchemaFacts, nullable: frozenset[str]
) -> tuple[dict[str, tuple[Any, Any, int | None]], frozenset[str]]:
    """Per bounded column, (min, max, null count) over all row groups, None where a statistic is missing;
    and those of `nullable` that hold only nulls by the footer (a null count equal to the rows of every row
    group; a column without a null count is not claimed). Each column's statistics are taken once a row
    group, its bounds read as stored where that is the value (`SchemaFacts.raw`, a fifth of the time of
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
            if only_nulls and (
                statistics is None or not statistics.has_null_count or statistics.null_count != group.num_rows
            ):
                only_nulls = False
            if bounding:
                if statistics is None or not statistics.has_min_max or nulls is None:
                    low = high = nulls = None
                    bounding = False
                else:
                    least, most = (
                        (statistics.min_raw, statistics.max_raw)
                        if stored
                        else _statistic_bounds(statistics, column, facts)
                    )
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


def row_group_steps(
    metadata: pq.FileMetaData, index: dict[str, int], facts: SchemaFacts
) -> tuple[tuple[int, int, int], ...]:
    """Per row group (first step, last step, rows) when the file has several and each says its steps with
    no null; () else (the file's `step_range` and rows then stand for its one row group). The audit's step
    ranges end between row groups, so that none is decoded twice (`engine.ranges`)."""
    place = index.get("step")
    if metadata.num_row_groups < 2 or place is None:
        return ()
    out = []
    for number in range(metadata.num_row_groups):
        group = metadata.row_group(number)
        statistics = group.column(place).statistics
        if statistics is None or not statistics.has_min_max or not statistics.has_null_count or statistics.null_count:
            return ()
        low, high = (
            (statistics.min_raw, statistics.max_raw) if "step" in facts.raw else (statistics.min, statistics.max)
        )
        out.append((int(low), int(high), group.num_rows))
    return tuple(out)


def _statistic_bounds(statistics: Any, column: str, facts: SchemaFacts) -> tuple[Any, Any]:
    """A row group's (min, max) of a column whose stored statistics are not its value: a name's text decoded
    from its stored UTF-8, anything else as pyarrow gives it."""
    if column in facts.text:
        try:
            return statistics.min_raw.decode("utf-8"), statistics.max_raw.decode("utf-8")
        except (AttributeError, UnicodeDecodeError):
            pass
    return statistics.min, statistics.max


_TIMESTAMP = re.compile(r"^timestamp\[(s|ms|us|ns)(?:, tz=(.+))?\]$")

_FOOTER_TYPES = {
    **dict.fromkeys(("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"), pa.int64()),
    "float": pa.float64(),
    "double": pa.float64(),
    "bool": pa.bool_(),
    **dict.fromkeys(("string", "large_string", "string_view"), pa.string()),
}

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
    (`engine.sql.select_records`: BIGINT, DOUBLE, VARCHAR) bit for bit; None for a type whose value a footer does not
    give exactly (a half float's statistics are bytes)."""
    dictionary = re.match(r"^dictionary<values=(large_)?string, ", arrow_type)
    if dictionary:
        return pa.string()
    timestamp = _TIMESTAMP.match(arrow_type)
    if timestamp:
        return pa.timestamp(timestamp.group(1), timestamp.group(2))
    return _FOOTER_TYPES.get(arrow_type)


@functools.lru_cache(maxsize=256)
def footer_reading(arrow_type: str) -> tuple[type, bool, bool] | None:
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


def footer_record(
    metadata: pq.FileMetaData, index: dict[str, int], signature: tuple[tuple[str, str], ...]
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
        reading = footer_reading(arrow_type)
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
        value = one_value_of(column, low)
        if value is UNKNOWN:
            return None
        values.append(value)
    return tuple(values)


UNKNOWN = object()
"""What a statistics' one value does not give (`one_value_of`)."""


def one_value_of(column: str, low: Any) -> Any:
    """The value every record holds where a column's statistics have min = max = `low`: `low` itself, but a
    float zero only in SIGNLESS_ZEROS (as 0.0), its sign being in no statistics (Parquet writes min −0.0 and
    max +0.0 whatever it is), and never NaN; UNKNOWN where it gives none."""
    if low.__class__ is float and (low == 0.0 or low != low):
        return 0.0 if low == 0.0 and column in SIGNLESS_ZEROS else UNKNOWN
    return low


def record_stats(record: tuple[Any, ...], facts: SchemaFacts) -> dict[str, tuple[Any, Any, int | None]]:
    """`footer_stats` of a one-row file's bounded columns from its record (`footer_record`): (v, v, 0) for a
    value v, and for a null what a footer without a min or max gives, (None, None, None)."""
    return {
        column: (None, None, None) if value is None else (value, value, 0)
        for (column, _), value in zip(facts.signature, record)
        if column in facts.bounded
    }


_NAME_COLUMNS = (("run_id", None), ("group", UNNAMED), ("term", UNNAMED))
"""The columns that name a record's (run, group, term), and their defaults (None: the file's folder),
as `engine.sql.select_records` applies them."""


def names_of(
    stats: dict[str, tuple[Any, Any, int | None]], present: frozenset[str], default_run: str
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


def all_names(names: tuple[str | None, str | None, str | None]) -> tuple[str, str, str] | None:
    run, group, term = names
    return (run, group, term) if run is not None and group is not None and term is not None else None


def run_group_of(names: tuple[str | None, str | None, str | None]) -> tuple[str, str] | None:
    run, group, _ = names
    return (run, group) if run is not None and group is not None else None


def range_of(stats: tuple[Any, Any, int | None]) -> tuple[int, int] | None:
    """(lowest, highest) of an integer column when its statistics hold both and it has no nulls."""
    bounds = bounds_of(stats)
    return (int(bounds[0]), int(bounds[1])) if bounds is not None else None


def bounds_of(stats: tuple[Any, Any, int | None]) -> tuple[Any, Any] | None:
    """(lowest, highest) of a column when its statistics hold both and it has no nulls."""
    low, high, nulls = stats
    return (low, high) if low is not None and high is not None and nulls == 0 else None


@dataclass(frozen=True, slots=True)
class SchemaFacts:
    """What a schema says, worked out once for every shard that has it."""

    problem: str | None
    """What makes it unusable, or None."""
    present: frozenset[str]
    """Its schema columns."""
    bounded: frozenset[str]
    """Its columns whose statistics the checks read (`check_values`, the step, rank and microbatch ranges)."""
    unsigned: tuple[str, ...]
    """Its uint64 columns, whose values may pass the int64 range."""
    signature: tuple[tuple[str, str], ...]
    """`Shard.signature`: the fields that are schema columns."""
    raw: frozenset[str]
    """Its columns whose statistics' stored value is the value (`footer_reading`): read as stored, which
    takes a fifth of the time of the logical value."""
    text: frozenset[str]
    """Its columns of text (string, large_string, a dictionary of either), whose statistics' value is their
    stored UTF-8 bytes decoded."""
    shadowed: tuple[str, ...] = ()
    """`Shard.shadowed`: its extra columns named as the scan's own (SCAN_COLUMNS)."""


SCAN_COLUMNS = ("filename", "file_row_number")
"""What the aggregation's scan adds to each record (its file and its row there): a file's own column of either name
is an extra column DuckDB's Parquet scan cannot read beside them."""


_SCHEMAS: dict[tuple[tuple[tuple[str, str], ...], frozenset[str]], SchemaFacts] = {}
"""Schemas already checked, by their fields and the columns folders supplied."""


def checked_schema(schema: pa.Schema, supplied: frozenset[str] = frozenset()) -> SchemaFacts:
    """What a schema says, made once for all the shards that have it (the schema seen last is not even
    made again: `_schema_of`). `supplied`: columns the file's folders give where it lacks them (`partitions`)."""
    fields = tuple((f.name, str(f.type)) for f in schema)
    facts = _SCHEMAS.get((fields, supplied))
    if facts is None:
        if len(_SCHEMAS) > 1024:
            _SCHEMAS.clear()
        present = frozenset(column for column in schema.names if column in COLUMNS_BY_NAME)
        problem = _schema_problem(schema, present, supplied)
        unsigned = () if problem else tuple(sorted(c for c in present if pa.types.is_uint64(schema.field(c).type)))
        signature = tuple(f for f in fields if f[0] in COLUMNS_BY_NAME)
        raw = frozenset(c for c, arrow_type in signature if (footer_reading(arrow_type) or (int, False, False))[1])
        text = frozenset(c for c, arrow_type in signature if footer_type(arrow_type) == pa.string())
        shadowed = tuple(column for column in SCAN_COLUMNS if column in schema.names)
        facts = _SCHEMAS[fields, supplied] = SchemaFacts(
            problem, present, (present & STATISTICS_COLUMNS) | set(unsigned), unsigned, signature, raw, text, shadowed
        )
    return facts


_PANDAS_INTEGERS = (
    " (a count written as float: pandas does so where one value is missing, numpy where it was computed as a float; "
    "write it as an integer, with pandas' nullable integer where a value is missing: df.astype({{'{column}': 'Int64'}}))"
)
"""The fix where an integer column came as float: a pandas frame with NaN in it (one step without positions, a
concatenation of frames where one lacks the column) writes the whole column so."""


def _schema_problem(schema: pa.Schema, present: frozenset[str], supplied: frozenset[str]) -> str | None:
    """What makes a schema unusable (required columns, no repeats, each column's type), or None.
    `present`: its schema columns; `supplied`: those its folders give."""
    cased = [name for name in schema.names if name.lower() in COLUMNS_BY_NAME and name.lower() not in schema.names]
    if cased:  # read as absent, an optional column's default would stand in for the file's own values
        return (
            f"column '{cased[0]}' is the log's '{cased[0].lower()}' in other letters: rename it (the log format's "
            "names are lower-case)"
        )
    missing = [column for column in REQUIRED_COLUMNS if column not in schema.names and column not in supplied]
    if len(missing) == len(REQUIRED_COLUMNS):
        return f"not a tokaudit log (no column {', '.join(repr(c) for c in missing)})"
    if missing:  # what it holds: a log another writer made lacks one most often
        return f"missing column '{missing[0]}' ({COLUMNS_BY_NAME[missing[0]].meaning})"
    repeated = sorted(
        {column for column in schema.names if schema.names.count(column) > 1 and column in COLUMNS_BY_NAME}
    )
    if repeated:
        return f"column '{repeated[0]}' appears more than once"
    for column in sorted(present):
        expected = COLUMNS_BY_NAME[column].kind
        arrow_type = schema.field(column).type
        if not kind_accepts(expected, arrow_type):
            problem = f"column '{column}' has type {arrow_type}, expected {KIND_WORDS[expected]}"
            if expected == "int" and pa.types.is_floating(arrow_type):
                problem += _PANDAS_INTEGERS.format(column=column)
            elif pa.types.is_decimal(arrow_type):  # numeric, but exact decimals are not a log's floats
                problem += f" (write it as a float: CAST({column} AS DOUBLE))"
            return problem
    return None
