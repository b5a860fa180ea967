"""DuckDB's settings for the audit: its memory limit and chunk from the environment, and a quiet connection."""

from __future__ import annotations

import os
import re
from typing import Any

import duckdb

from tokaudit._engine.ranges import CHUNK_ROWS
from tokaudit.errors import UsageError


DEFAULT_MEMORY_LIMIT = "512MB"
"""DuckDB's share: with the interpreter, pandas, pyarrow and the step table beside it, the audit stays within
768 MiB, also where a segment that no range may cut is aggregated whole (`engine.ranges`)."""


_BYTES = {"b": 1, "kb": 1e3, "kib": 2**10, "mb": 1e6, "mib": 2**20, "gb": 1e9, "gib": 2**30, "tb": 1e12, "tib": 2**40}
"""The units of a size DuckDB reads, in bytes."""

_BIGGEST = {unit: 2**60 / scale for unit, scale in _BYTES.items()}
"""The most of each unit DuckDB takes: an exbibyte (a larger limit it refuses, as if the log were at fault)."""

_MEMORY = re.compile(rf"^\s*(\d+(?:\.\d+)?)\s*({'|'.join(_BYTES)}|%)\s*$", re.IGNORECASE)
"""A size DuckDB reads: a number and a unit (it refuses a number alone), or a share of the memory."""


def _unit(name: str) -> str:
    return name.upper().replace("IB", "iB")


def settings_from_environment() -> tuple[str, int]:
    """(memory limit, chunk rows) from TOKAUDIT_MEMORY_LIMIT and TOKAUDIT_CHUNK_ROWS, checked."""
    memory = os.environ.get("TOKAUDIT_MEMORY_LIMIT", DEFAULT_MEMORY_LIMIT)
    size = _MEMORY.match(memory)
    if size is None or not 0 < float(size.group(1)) <= (
        100 if size.group(2) == "%" else _BIGGEST[size.group(2).lower()]
    ):
        raise UsageError(
            f"TOKAUDIT_MEMORY_LIMIT={memory!r} is no size up to an exbibyte, in {', '.join(map(_unit, _BYTES))}, "
            "or share of the memory up to 100% (examples: 768MB, 2GiB, 50%)"
        )
    chunk = os.environ.get("TOKAUDIT_CHUNK_ROWS", str(CHUNK_ROWS))
    if not chunk.strip().isdigit() or int(chunk) < 1:
        raise UsageError(f"TOKAUDIT_CHUNK_ROWS={chunk!r} is not a positive whole number of rows")
    return memory.strip(), int(chunk)


_QUIET_IO = {"async_threads": 0}
"""Settings a DuckDB that knows them takes. DuckDB 2 starts 8 threads of its own for asynchronous I/O in every
database, whatever `threads` says; on local files they only wake and sleep, taking CPU from the query."""

_NAN_SAFE = "SET parquet_can_have_nan = true"
"""DuckDB 2 takes a float column's footer statistics for the truth unless told otherwise: on a file whose
statistics say min = max = 1.0 (pyarrow leaves NaN out of them and writes no NaN count), `WHERE isnan(x)`
skips the row group and finds nothing, and max(x) is 1.0. A NaN is what the audit looks for."""


def connect(config: dict[str, Any]) -> duckdb.DuckDBPyConnection:
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


def half_limit(limit: str) -> str:
    """Half a memory limit as DuckDB reads one (`_MEMORY`: "768MB", "2GiB", "50%")."""
    found = _MEMORY.match(limit)
    if found is None:
        return limit
    number, unit = float(found.group(1)), found.group(2).lower()
    if unit == "%":
        return f"{number / 2:g}%"
    return f"{max(16, int(number * _BYTES[unit] / 2 / 2**20))}MiB"
