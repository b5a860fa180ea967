"""What the reader refuses: a missing or mistyped column, a newer schema version, values no audit can use."""

from __future__ import annotations

import math

from collections.abc import Iterable
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from tokaudit.errors import LogFormatError
from tokaudit._schema import COLUMNS, REQUIRED_COLUMNS, SCHEMA_VERSION


class Readable(Protocol):
    """A file whose columns can be read whole (`footers.Footer`): what a check of its values reads."""

    def read(self, columns: list[str]) -> pa.Table: ...


_LOWER_BOUNDS = tuple((c.name, *c.low) for c in COLUMNS if c.low is not None)
"""(column, lowest allowed value, what a value below it is), from the log format's columns (`schema.Column`)."""

_UPPER_BOUNDS = tuple((c.name, *c.high) for c in COLUMNS if c.high is not None)
"""(column, highest allowed value, what a value above it is): the step table holds ranks, microbatch indices, W and
one record's count in 32 bits, and a step's N (Σ n over at most 2³² records) then stays exact in int64 and in a
float64. A file may store these columns in any integer type."""

STATISTICS_COLUMNS = (
    frozenset(REQUIRED_COLUMNS)
    | {column for column, _, _ in _LOWER_BOUNDS}
    | {"schema_version", "run_id", "group", "term", "grad_divisor", "term_weight"}
)
"""Columns whose footer statistics are read: `check_values`'s, the names' (`names_of`), D's (`Shard.divisor_range`)
and λ's (positive)."""


def check_values(
    parquet: Readable,
    present: frozenset[str],
    stats: dict[str, tuple[Any, Any, int | None]],
    thorough: bool,
    exact: bool = False,
) -> None:
    """Statistics first (no data read); the columns themselves only when statistics cannot decide.
    A NaN divisor or scale never shows in statistics, nor does T < n on one record where T's and n's ranges
    overlap: `thorough` reads those columns; otherwise the aggregation counts them and only the files it
    names are inspected thoroughly. `exact`: the statistics are a one-row file's record (`footer_record`),
    which holds no NaN and whose missing bound is a null: they decide everything, and a column is read only
    for the message naming the row of a value they show out of bounds."""
    unsure = not exact  # a missing statistic says nothing (or, exact, a null: nothing to check)
    need: set[str] = set()
    if "schema_version" in present:
        high = stats["schema_version"][1]
        if high is None:
            need.add("schema_version")
        elif high > SCHEMA_VERSION:
            raise LogFormatError("", newer_version(high))
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
        if column in present and _beyond(stats[column][0], lowest, unsure):
            need.add(column)
    for column, highest, _ in _UPPER_BOUNDS:
        if column in present and _beyond(stats[column][1], highest, unsure, above=True):
            need.add(column)
    # D positive, λ at least 0 (0: a term switched off on purpose, a warm-up), each finite (an infinite one weighs none)
    for column, zero in (("grad_divisor", True), ("term_weight", False)):
        low, high = stats.get(column, (0, 0, 0))[:2]
        if column in present and (
            _beyond(low, 0, unsure, inclusive=zero) or _beyond(high, math.inf, unsure, True, True)
        ):
            need.add(column)
    if thorough and "positions" in present:
        # T ≥ n on every record (T counts the positions the n valid tokens are among): the statistics settle
        # it when the file's least T is at least its greatest n; otherwise the aggregation counts the records
        # (`unusable_values`) and only the files it names are read here
        least, greatest = stats["positions"][0], stats["valid_tokens"][1]
        if unsure if least is None or greatest is None else least < greatest:
            need.update({"positions", "valid_tokens"})
    rank_high, world_low = stats["rank"][1], stats["world_size"][0]
    if rank_high is None or world_low is None or rank_high >= world_low:
        need.update({"rank", "world_size"})
    if thorough and unsure:
        for column in ("grad_divisor", "grad_scale", "term_weight"):
            if column in present:
                need.add(column)  # NaN never shows in statistics
    if need:
        _check_rows(parquet.read(sorted(need)), need)


def _beyond(bound: Any, limit: float, unsure: bool, above: bool = False, inclusive: bool = False) -> bool:
    """Whether a column's statistic may pass its limit (below it, or `above`; at it too where `inclusive`);
    a missing statistic (None) may where the statistics are `unsure`."""
    if bound is None:
        return unsure
    if above:
        return bool(bound > limit or inclusive and bound == limit)
    return bool(bound < limit or inclusive and bound == limit)


ROW_COLUMNS = frozenset(
    {c for c, _, _ in _LOWER_BOUNDS + _UPPER_BOUNDS}
    | {"rank", "world_size", "positions", "valid_tokens", "grad_divisor", "term_weight", "grad_scale"}
)
"""The columns whose values `check_every_row` checks."""


def check_every_row(parquet: Readable, present: frozenset[str]) -> None:
    """Every row's bounded values checked, whatever the statistics say: where the aggregation found a value no audit
    can use that the file's statistics did not show (a damaged page, a writer's bug)."""
    columns = present & ROW_COLUMNS
    _check_rows(parquet.read(sorted(columns)), columns)


def _check_rows(table: pa.Table, columns: Iterable[str]) -> None:
    columns = set(columns)
    if "schema_version" in columns:
        high = pc.max(table["schema_version"]).as_py()
        if high is not None and high > SCHEMA_VERSION:
            raise LogFormatError("", newer_version(high))
    for column in REQUIRED_COLUMNS:
        if column in columns and column != "backward_scalar":
            _no_nulls(table, column)
    if "backward_scalar" in columns:
        missing = pc.is_null(table["backward_scalar"])
        if "token_weight_sum" in table.column_names:
            missing = pc.and_(missing, pc.is_null(table["token_weight_sum"]))
        problem = "column 'backward_scalar' is null where no probe weights were recorded"
        _raise_at_first(missing, problem, after=_pandas_nan(table, "backward_scalar"))
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
        rank, world = table["rank"], table["world_size"]
        _raise_at_first_of_two(
            pc.greater_equal(rank, world), "column 'rank' is not below 'world_size'", rank, "≥", world
        )
    if {"positions", "valid_tokens"} <= columns:
        positions, valid = table["positions"], table["valid_tokens"]
        _raise_at_first_of_two(
            pc.less(positions, valid), "column 'positions' is below 'valid_tokens'", positions, "<", valid
        )
    for column, below, meaning in (
        ("grad_divisor", pc.less_equal, "positive number"),
        ("term_weight", pc.less, "number ≥ 0"),
    ):
        if column in columns:
            divisor = pc.cast(table[column], pa.float64())  # a half float has no kernels of its own
            bad = pc.or_(pc.or_(pc.is_nan(divisor), below(divisor, 0)), pc.is_inf(divisor))
            _raise_at_first(bad, f"column '{column}' is not a finite {meaning}", table[column])
    if "grad_scale" in columns:
        scale = pc.cast(table["grad_scale"], pa.float64())
        _raise_at_first(pc.is_nan(scale), "column 'grad_scale' is NaN", table["grad_scale"])


INT64_MAX = (1 << 63) - 1


def raise_beyond_int64(parquet: Readable, column: str) -> None:
    values = parquet.read([column])[column]
    _raise_at_first(
        pc.greater(values, pa.scalar(INT64_MAX, pa.uint64())),
        f"column '{column}' holds a value beyond the int64 range",
        values,
    )


def _no_nulls(table: pa.Table, column: str) -> None:
    _raise_at_first(pc.is_null(table[column]), f"column '{column}' has a null value", after=_pandas_nan(table, column))


def _pandas_nan(table: pa.Table, column: str) -> str:
    """What a null in a float column most likely was: pandas writes a float NaN as a null, and the NaN the log held
    (a non-finite loss or backward scalar, a finding of its own) is gone."""
    floating = pa.types.is_floating(table.schema.field(column).type)
    return ": pandas writes a NaN as a null; write the NaN itself (pyarrow keeps it)" if floating else ""


def _raise_at_first_of_two(mask: Any, problem: str, first: Any, sign: str, second: Any) -> None:
    """`_raise_at_first` of a problem between two columns, both values said (a rank of 5 and a W of 2 read "(5)"
    after 'world_size', as if W were 5)."""
    mask = pc.fill_null(mask, False)
    if pc.any(mask).as_py():
        row = pc.index(mask, True).as_py()
        raise LogFormatError("", f"{problem} ({first[row].as_py()} {sign} {second[row].as_py()}) at row {row}")


def _raise_at_first(mask: Any, problem: str, values: Any = None, after: str = "") -> None:
    mask = pc.fill_null(mask, False)
    if not pc.any(mask).as_py():
        return
    row = pc.index(mask, True).as_py()
    shown = f" ({values[row].as_py()!r})" if values is not None else ""
    raise LogFormatError("", f"{problem}{shown} at row {row}{after}")


def newer_version(version: int) -> str:
    return (
        f"schema_version {version} is newer than this tokaudit reads ({SCHEMA_VERSION}); "
        "upgrade tokaudit (pull its checkout and pip install it again)"
    )
