"""The step table of a range whose records form a dense grid, reduced by numpy with no hash grouping.

The recorder writes one rank's records per file, in step order and, within a step, in microbatch
order. When every rank of a range holds the same steps, each with microbatches 0…M−1 once, the
records read rank after rank are an array [R ranks, S steps, M microbatches]: a per-step aggregate
reduces axes 0 and 2, a per-rank one axis 2, a per-microbatch one axis 0. The query
(`engine.step_sql`) groups the same records three times in hash tables, which costs several times
reading them; reshapes cost less than reading (figures in docs/design.md).

This mirrors the query's semantics aggregate by aggregate (NULL as DuckDB has it: min, max and sum
skip it, count_if over none is NULL; float sums compensated as its fsum and favg are, which gives the
same doubles on every log compared). Data-parallel groups that write their own ranks' files are a grid
each (`grids_of`). Several loss terms recorded in turn at each (step, microbatch), as the recorder writes
them, make the records [R, S, M, T terms]: read once, each term is a grid of its own (every T-th record).
Anything else returns None and the range takes the query: a file of several runs or groups, files of one
term beside files of several for one (run, group), several schemas in one group, one-row shards read from
their footers, a file cut by the range, a rank missing from a step, a repeated or missing microbatch or
term, records out of order, and any value that is not finite (the query counts and names those). A test
compares both tables bit for bit on random grids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tokaudit.engine.fold import Folded, fold_block, step_columns
from tokaudit.reader import Shard
from tokaudit.schema import COLUMNS_BY_NAME, UNNAMED


GRID_COLUMNS = ("grad_divisor", "grad_scale", "divisor_known", "positions", "backward_scalar",
                "token_weight_sum", "token_weight_min", "token_weight_max", "masked_weight_abs_sum",
                "reported_loss", "sync", "skipped", "world_size")
"""The columns read besides step, micro, valid_tokens and loss_sum, where a file holds a value of them."""

_SQL_TYPES = {"int": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN"}

MAX_MICRO = 64
"""Microbatches a grid may have: the query's repeated-key and wide-index counts use 64-bit masks."""

@dataclass(frozen=True)
class Grid:
    """A range's files in the order that makes them an array [ranks, steps, microbatches] (× terms where each
    file holds several), by their footers."""

    names: tuple[str, str, str | None]
    """The one (run, group, term) of its records; the term None where each file holds several loss terms,
    recorded in turn at every (step, microbatch), which the data says (`grid_table`)."""
    rank_files: tuple[tuple[Shard, ...], ...]
    """Each rank's files in step order, rank after rank (as `ranks`)."""
    ranks: tuple[int, ...]
    """The rank of each block of rows, in order."""
    micro: int
    """M: microbatches per (rank, step)."""
    rank_rows: int
    """Rows of each rank: S·M (S·M·T with T terms in each file)."""
    given: tuple[tuple[str, Any], ...] = ()
    """(column, value) of the columns every file's footer gives the same one value of (`Shard.constants`),
    which are then not read."""

    @property
    def files(self) -> tuple[Shard, ...]:
        """Every file, rank after rank."""
        return tuple(shard for held in self.rank_files for shard in held)

def _grid_names(shard: Shard) -> tuple[str, str, str | None] | None:
    """A shard's (run, group, term) by its footer, the term None where it varies (several loss terms in one
    file); None where the run or the group varies."""
    if shard.names is not None:
        return shard.names
    if shard.run_group is not None and "term" in shard.columns:
        return shard.run_group[0], shard.run_group[1], None
    return None

def grid_of(shards: Sequence[Shard], steps: tuple[int, int] | None) -> Grid | None:
    """The grid these shards form by their footers, or None: every shard a local file read from its data,
    of one schema and one (run, group, term) (or one (run, group) and terms that vary), one rank each,
    microbatches 0…M−1 (M the same for all), inside `steps`; a rank's files do not overlap in steps, and
    every rank has the same number of rows. Whether each rank holds the same steps, every microbatch once
    and in order (and every term once and in one order within each), is checked on the data."""
    if not shards or len({s.signature for s in shards}) != 1 or len({_grid_names(s) for s in shards}) != 1:
        return None
    by_rank: dict[int, list[Shard]] = {}
    micro: int | None = None
    for shard in shards:
        if (shard.store is not None or shard.record is not None or _grid_names(shard) is None
                or shard.rank_range is None or shard.micro_range is None or shard.step_range is None):
            return None
        low, high = shard.rank_range
        first, last = shard.micro_range
        if low != high or first != 0 or (micro is not None and last + 1 != micro) or last + 1 > MAX_MICRO:
            return None
        if steps is not None and not (steps[0] <= shard.step_range[0] and shard.step_range[1] <= steps[1]):
            return None
        micro = last + 1
        by_rank.setdefault(low, []).append(shard)
    rank_files: list[tuple[Shard, ...]] = []
    rows: set[int] = set()
    for rank in sorted(by_rank):
        held = sorted(by_rank[rank], key=lambda s: s.step_range or (0, 0))
        if any((b.step_range or (0, 0))[0] <= (a.step_range or (0, 0))[1] for a, b in zip(held, held[1:])):
            return None
        rows.add(sum(s.rows for s in held))
        rank_files.append(tuple(held))
    if micro is None or len(rows) != 1 or (rank_rows := rows.pop()) == 0 or rank_rows % micro:
        return None
    names = _grid_names(shards[0])
    assert names is not None
    given = set(shards[0].constants)
    for constants in {s.constants for s in shards}:
        given &= set(constants)
    return Grid(names=names, rank_files=tuple(rank_files), ranks=tuple(sorted(by_rank)), micro=micro,
                rank_rows=rank_rows, given=tuple(sorted(given)))

def grids_of(shards: Sequence[Shard], steps: tuple[int, int] | None) -> list[Grid] | None:
    """The grids these shards form, one per (run, group, term) (or per (run, group) whose files each hold
    several terms) in the names' order, when each name's shards form one (`grid_of`): data-parallel groups
    each write their own ranks' files."""
    by_name: dict[tuple[str, str, str | None], list[Shard]] = {}
    for shard in shards:
        names = _grid_names(shard)
        if names is None:
            return None
        by_name.setdefault(names, []).append(shard)
    # files of several terms beside files of one term of the same (run, group) would give a term twice
    if len({names[:2] for names in by_name}) != len(by_name) and any(names[2] is None for names in by_name):
        return None
    grids = [grid_of(by_name[names], steps) for names in sorted(by_name, key=lambda n: (n[0], n[1], n[2] or ""))]
    return None if not grids or any(grid is None for grid in grids) else [g for g in grids if g is not None]

def _split(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray | None]:
    """A fetched column as (its values, where it is NULL), None when nowhere; a NULL's value is arbitrary: with
    NULLs, the values are read from the array's buffers as they are (a view; bits unpacked for a bool), where
    filling the NULLs first copied every value (a fifth of a second of the recorder's-columns log at 10⁷)."""
    values = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if values.null_count == 0:
        return values.to_numpy(zero_copy_only=False), None
    validity, data = values.buffers()[:2]
    end = values.offset + len(values)
    if validity is None or data is None:  # (no buffer of its own: every value NULL)
        return np.zeros(len(values), dtype=values.type.to_pandas_dtype()), np.ones(len(values), dtype=bool)
    nulls = np.unpackbits(np.frombuffer(validity, np.uint8), count=end, bitorder="little")[values.offset:] == 0
    if pa.types.is_boolean(values.type):
        bits = np.unpackbits(np.frombuffer(data, np.uint8), count=end, bitorder="little")[values.offset:]
        return bits.view(np.bool_), nulls
    return np.frombuffer(data, dtype=values.type.to_pandas_dtype(), count=end)[values.offset:], nulls

def grid_table(connection: duckdb.DuckDBPyConnection, grid: Grid, link: Callable[[Shard], str],
               constants: dict[str, Any], rtol: float, block_rows: int
               ) -> list[tuple[tuple[str, str, str], dict[str, np.ndarray]]] | None:
    """The query's step table of this grid (the general form, without names or evidence) per (run, group,
    term), in the terms' order, or None when its data is not a grid of finite values after all. `link`: a
    shard's name for DuckDB. `constants`: the one world_size and grad_divisor the footers give, where they
    do (`engine.footer_facts`). Ranks are read `block_rows` records at a time at most."""
    columns, given = _selected(grid, constants)
    run, group, term = grid.names
    ranks_per_block = max(1, block_rows // grid.rank_rows)
    terms: list[str] = [] if term is None else [term]
    folded: list[Folded] = []
    step_numbers: np.ndarray | None = None
    for start in range(0, len(grid.ranks), ranks_per_block):
        block_files = grid.rank_files[start:start + ranks_per_block]
        listed = "[" + ", ".join("'" + link(s).replace("'", "''") + "'" for held in block_files for s in held) + "]"
        rows = len(block_files) * grid.rank_rows
        # As Arrow, not numpy: DuckDB hands a column over faster; in one batch, each column is one Arrow
        # array, which numpy views without a copy.
        fetched = connection.sql(f"SELECT {columns} FROM read_parquet({listed}, union_by_name = false)"
                                 ).to_arrow_table(batch_size=rows)
        if fetched.num_rows != rows:
            return None
        names = fetched.column("term").combine_chunks() if term is None else None
        record = {name: _split(fetched.column(name)) for name in fetched.column_names if name != "term"}
        del fetched
        if not terms:
            terms = _terms_in_turn(record, names, grid)
            if not terms:
                return None
        if not folded:
            folded = [Folded() for _ in terms]
        # [ranks, steps, M, T]: rank after rank, each rank's steps, each step's microbatches, each's terms
        full = (len(block_files), grid.rank_rows // (grid.micro * len(terms)), grid.micro, len(terms))
        step_numbers = _arranged(record, names, terms, full, step_numbers)
        if step_numbers is None:
            return None
        for position, held in enumerate(folded):
            # one term's records: every T-th from its first (a copy in order where T > 1)
            mine = {name: (values.reshape(full)[..., position].reshape(-1),
                           None if nulls is None else nulls.reshape(full)[..., position].reshape(-1))
                    for name, (values, nulls) in record.items()}
            if not fold_block(mine, full[:3], constants, given, rtol, held):
                return None
    assert step_numbers is not None
    return sorted((((run, group, name), step_columns(held, step_numbers, grid.micro, grid.ranks, constants))
                   for name, held in zip(terms, folded)), key=lambda named: named[0])


def _selected(grid: Grid, constants: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The SELECT list that reads a grid's files as the query casts their columns, and the columns left unread
    with their one value. A column no file holds a value of is NULL on every record, as the query reads it
    (`engine.valueless_columns`); one whose footers give its one value (`Grid.given`) is that value on every record."""
    files = grid.files
    given = dict(grid.given)
    if "grad_divisor" in constants and "grad_divisor" in files[0].columns:
        given["grad_divisor"] = constants["grad_divisor"]  # the range's one D
    read = [c for c in GRID_COLUMNS if c in files[0].columns and c not in constants and c not in given
            and not all(c in s.null_columns for s in files)]
    types = dict(files[0].signature)
    loss = _value("loss_sum", types.get("loss_sum"))
    # A NaN shows in no statistics: each float column left unread is read into the loss as S − (v − v), which
    # is S bit for bit (−0.0 too) where v is finite (v − v = +0.0), and NaN where v is NaN: the grid then
    # gives way to the query, which counts it and names its file.
    for column in sorted(c for c in given if COLUMNS_BY_NAME[c].kind == "float"):
        loss += f' - ("{column}" - "{column}")'
    columns = ", ".join([_read(c, types.get(c)) for c in ("step", "micro", "valid_tokens")] + [f'{loss} AS "loss_sum"']
                        + [_read(c, types.get(c)) for c in read])
    if grid.names[2] is None:
        # several loss terms in each file, the query's names: coalesce(term, '0')
        columns += f', coalesce(CAST("term" AS VARCHAR), \'{UNNAMED}\') AS "term"'
    return columns, given


def _terms_in_turn(record: dict[str, tuple[np.ndarray, np.ndarray | None]], names: pa.Array | None,
                   grid: Grid) -> list[str]:
    """T terms recorded in turn at each (step, microbatch): the first step's rows are M·T, its first T rows'
    terms the order of all; [] where they are not."""
    assert names is not None
    step = record["step"][0]
    count = int(np.count_nonzero(step[:grid.rank_rows] == step[0]))
    if count % grid.micro or grid.rank_rows % count:
        return []
    terms: list[str] = names.slice(0, count // grid.micro).to_pylist()
    return terms if len(set(terms)) == len(terms) else []


def _arranged(record: dict[str, tuple[np.ndarray, np.ndarray | None]], names: pa.Array | None, terms: list[str],
              full: tuple[int, int, int, int], step_numbers: np.ndarray | None) -> np.ndarray | None:
    """The grid's steps where a block's records are one: each rank the same strictly increasing steps (those of
    the blocks before), each step microbatches 0…M−1 in order, each microbatch the terms once, in the one order;
    None where they are not."""
    step, step_nulls = record["step"]
    index, index_nulls = record["micro"]
    if step_nulls is not None or index_nulls is not None:
        return None
    step = step.reshape(full)
    first = step[0, :, 0, 0]
    if step_numbers is None:
        step_numbers = first
        if full[1] > 1 and not (np.diff(first) > 0).all():
            return None
    if not ((step == step_numbers[None, :, None, None]).all()
            and (index.reshape(full) == np.arange(full[2])[:, None]).all()):
        return None
    if names is not None:
        codes = pc.index_in(names, value_set=pa.array(terms, names.type))
        if codes.null_count or not (codes.to_numpy(zero_copy_only=False).reshape(full) == np.arange(len(terms))).all():
            return None
    return step_numbers


_AS_READ = frozenset({"int64", "int32", "int16", "int8", "double", "bool"})
"""Arrow types that numpy computes with as the query does after its casts (to BIGINT, DOUBLE, BOOLEAN):
read as they are, which spares a conversion of every value (a float32 is widened first, as the query does)."""

def _value(column: str, arrow_type: str | None) -> str:
    """A column's value as the query casts it, in SQL."""
    if arrow_type in _AS_READ and (COLUMNS_BY_NAME[column].kind == "float") == (arrow_type == "double"):
        return f'"{column}"'
    return f'CAST("{column}" AS {_SQL_TYPES[COLUMNS_BY_NAME[column].kind]})'

def _read(column: str, arrow_type: str | None) -> str:
    return f'{_value(column, arrow_type)} AS "{column}"'
