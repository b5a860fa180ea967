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

from tokaudit.reader import Shard
from tokaudit.schema import COLUMNS_BY_NAME, UNNAMED

GRID_COLUMNS = ("grad_divisor", "grad_scale", "divisor_known", "positions", "backward_scalar",
                "token_weight_sum", "token_weight_min", "token_weight_max", "masked_weight_abs_sum",
                "reported_loss", "sync", "skipped", "world_size")
"""The columns read besides step, micro, valid_tokens and loss_sum, where a file holds a value of them."""
_SQL_TYPES = {"int": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN"}
_NUMPY_TYPES = {"int": np.int64, "float": np.float64, "bool": np.bool_}
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


class _Compensated:
    """Σ per step of several named sums, as DuckDB's fsum and favg add: compensated, each addition's exact error
    carried along (`_neumaier`), so that the float sums are the query's to the last bit or nearly, not (R·M)·ε
    off: each rank's microbatches first, vectorized over the ranks, then the ranks one after the other, every
    name at once (a rank's step is one short row each: one pass for all costs a third of one each)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.total: np.ndarray | None = None
        self.error: np.ndarray | None = None

    def add(self, sums: Sequence[np.ndarray], errors: Sequence[np.ndarray | None]) -> None:
        """Each name's per-rank sums [ranks, steps] (`_rank_sums`, or one value a rank) and what they lost
        (None: nothing)."""
        stacked = np.stack(sums, axis=1)  # [ranks, names, steps]
        if self.total is None:
            self.total, self.error = np.zeros(stacked.shape[1:]), np.zeros(stacked.shape[1:])
        assert self.error is not None
        for rank in range(stacked.shape[0]):
            _neumaier(self.total, self.error, stacked[rank])
        for index, lost in enumerate(errors):
            if lost is not None:
                self.error[index] += lost.sum(axis=0)

    def value(self, name: str) -> np.ndarray:
        assert self.total is not None and self.error is not None
        index = self.names.index(name)
        total: np.ndarray = self.total[index] + self.error[index]
        return total


def _rank_sums(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[ranks, steps, M] summed over M, compensated: (the sums, what they lost)."""
    sums, errors = values[..., 0].copy(), np.zeros(values.shape[:2])
    for index in range(1, values.shape[2]):
        _neumaier(sums, errors, values[..., index])
    return sums, errors


def _neumaier(total: np.ndarray, error: np.ndarray, values: np.ndarray) -> None:
    """total += values in place, what the addition loses added to `error`, exactly (Knuth's TwoSum, the
    error Neumaier's branch on |s| ≥ |x| gives, in 8 passes instead of 11): t = s + x, v = t − s, the lost
    part is (s − (t − v)) + (x − v)."""
    added = total + values
    virtual = added - total
    lost = added - virtual
    np.subtract(total, lost, out=lost)
    np.subtract(values, virtual, out=virtual)
    lost += virtual
    error += lost
    total[...] = added


class _Folded:
    """Per-step partial aggregates over blocks of ranks, each folded into the last by its own rule."""

    def __init__(self) -> None:
        self.held: dict[str, np.ndarray] = {}
        self.sums = _Compensated(("loss", "objective", "local_means"))

    def fold(self, name: str, values: np.ndarray, how: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        held = self.held.get(name)
        self.held[name] = values if held is None else how(held, values)

    def low(self, name: str, values: np.ndarray) -> None:
        self.fold(name, values, np.fmin)  # NaN stands for NULL: min and max skip it, as DuckDB's do

    def high(self, name: str, values: np.ndarray) -> None:
        self.fold(name, values, np.fmax)

    def add(self, name: str, values: np.ndarray) -> None:
        self.fold(name, values, np.add)

    def count_if(self, name: str, condition: np.ndarray, nulls: np.ndarray | None) -> None:
        """DuckDB's count_if per step over [ranks, steps, M] of a condition that is NULL where `nulls` (None:
        nowhere): the records where it holds, and NULL on a step where no record's is known."""
        shape = (condition.shape[0], condition.shape[1], condition.shape[2])
        self.add(name, _step_count(condition if nulls is None else condition & ~nulls))
        self.add(name + "?", _known(nulls, shape))


def _over_micro(how: Callable[[np.ndarray, np.ndarray], np.ndarray], values: np.ndarray) -> np.ndarray:
    """[…, M] reduced over M, one microbatch at a time (numpy reduces a short last axis slowly)."""
    out = values[..., 0]
    for index in range(1, values.shape[-1]):
        out = how(out, values[..., index])
    return out


def _per_step(how: Callable[[np.ndarray, np.ndarray], np.ndarray], values: np.ndarray) -> np.ndarray:
    """[ranks, steps, M] reduced to [steps]: over the ranks first, each rank's rows one contiguous run."""
    ufunc: Any = how
    return _over_micro(how, ufunc.reduce(values, axis=0))


def _step_sum(values: np.ndarray) -> np.ndarray:
    """Σ over ranks and microbatches of [ranks, steps, M], per step."""
    return _over_micro(np.add, values.sum(axis=0))


def _step_count(condition: np.ndarray) -> np.ndarray:
    """The records of each step of [ranks, steps, M] where `condition` holds."""
    if not condition.any():
        return np.zeros(condition.shape[1], dtype=np.int64)
    return _step_sum(condition.astype(np.int64))


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


def _finite(values: np.ndarray, nulls: np.ndarray | None) -> bool:
    finite = np.isfinite(values)
    return bool(finite.all() if nulls is None else (finite | nulls).all())


def grid_table(connection: duckdb.DuckDBPyConnection, grid: Grid, link: Callable[[Shard], str],
               constants: dict[str, Any], rtol: float, block_rows: int
               ) -> list[tuple[tuple[str, str, str], dict[str, np.ndarray]]] | None:
    """The query's step table of this grid (the general form, without names or evidence) per (run, group,
    term), in the terms' order, or None when its data is not a grid of finite values after all. `link`: a
    shard's name for DuckDB. `constants`: the one world_size and grad_divisor the footers give, where they
    do (`engine.footer_facts`). Ranks are read `block_rows` records at a time at most."""
    # A column no file holds a value of is NULL on every record, as the query reads it (`engine._valueless`);
    # one whose footers give its one value (`Grid.given`) is that value on every record.
    files = grid.files
    given = dict(grid.given)
    if "grad_divisor" in constants and "grad_divisor" in files[0].columns:
        given["grad_divisor"] = constants["grad_divisor"]  # the range's one D
    read = [c for c in GRID_COLUMNS if c in files[0].columns and c not in constants and c not in given
            and not all(c in s.null_columns for s in files)]
    micro = grid.micro
    run, group, term = grid.names
    ranks_per_block = max(1, block_rows // grid.rank_rows)
    types = dict(files[0].signature)
    loss = _value("loss_sum", types.get("loss_sum"))
    # A NaN shows in no statistics: each float column left unread is read into the loss as S − (v − v), which
    # is S bit for bit (−0.0 too) where v is finite (v − v = +0.0), and NaN where v is NaN: the grid then
    # gives way to the query, which counts it and names its file.
    for column in sorted(c for c in given if COLUMNS_BY_NAME[c].kind == "float"):
        loss += f' - ("{column}" - "{column}")'
    columns = ", ".join([_read(c, types.get(c)) for c in ("step", "micro", "valid_tokens")] + [f'{loss} AS "loss_sum"']
                        + [_read(c, types.get(c)) for c in read])
    if term is None:
        # several loss terms in each file, the query's names: coalesce(term, '0')
        columns += f', coalesce(CAST("term" AS VARCHAR), \'{UNNAMED}\') AS "term"'
    terms: list[str] = [] if term is None else [term]
    folded: list[_Folded] = []
    step_numbers: np.ndarray | None = None
    for start in range(0, len(grid.ranks), ranks_per_block):
        block_files = grid.rank_files[start:start + ranks_per_block]
        listed = "[" + ", ".join("'" + link(s).replace("'", "''") + "'" for held in block_files for s in held) + "]"
        rows = len(block_files) * grid.rank_rows
        # As Arrow, not numpy: DuckDB hands a column over in 0.6 of the time; in one batch, each column is one
        # Arrow array, which numpy views without a copy.
        fetched = connection.sql(f"SELECT {columns} FROM read_parquet({listed}, union_by_name = false)"
                                 ).to_arrow_table(batch_size=rows)
        if fetched.num_rows != rows:
            return None
        names = fetched.column("term").combine_chunks() if term is None else None
        record = {name: _split(fetched.column(name)) for name in fetched.column_names if name != "term"}
        del fetched
        step, step_nulls = record["step"]
        index, index_nulls = record["micro"]
        if step_nulls is not None or index_nulls is not None:
            return None
        if not terms:
            assert names is not None
            # T terms recorded in turn at each (step, microbatch): the first step's rows are M·T, its first T
            # rows' terms the order of all
            count = int(np.count_nonzero(step[:grid.rank_rows] == step[0]))
            if count % micro or grid.rank_rows % count:
                return None
            terms = names.slice(0, count // micro).to_pylist()
            if len(set(terms)) != len(terms):
                return None
        if not folded:
            folded = [_Folded() for _ in terms]
        # [ranks, steps, M, T]: rank after rank, each rank's steps, each step's microbatches, each's terms
        steps_per_rank = grid.rank_rows // (micro * len(terms))
        full = (len(block_files), steps_per_rank, micro, len(terms))
        shape = full[:3]
        # The grid itself: each rank the same strictly increasing steps, each step microbatches 0…M−1 in order,
        # each microbatch the terms once, in the one order.
        step = step.reshape(full)
        first = step[0, :, 0, 0]
        if step_numbers is None:
            step_numbers = first
            if steps_per_rank > 1 and not (np.diff(first) > 0).all():
                return None
        if not ((step == step_numbers[None, :, None, None]).all()
                and (index.reshape(full) == np.arange(micro)[:, None]).all()):
            return None
        if names is not None:
            codes = pc.index_in(names, value_set=pa.array(terms, names.type))
            if codes.null_count or not (codes.to_numpy(zero_copy_only=False).reshape(full) == np.arange(len(terms))).all():
                return None
        for position, held in enumerate(folded):
            # one term's records: every T-th from its first (a copy in order where T > 1)
            mine = {name: (values.reshape(full)[..., position].reshape(-1),
                           None if nulls is None else nulls.reshape(full)[..., position].reshape(-1))
                    for name, (values, nulls) in record.items()}
            if not _block(mine, shape, constants, given, rtol, held):
                return None
    assert step_numbers is not None
    return sorted((((run, group, name), _table(held, step_numbers, grid, constants))
                   for name, held in zip(terms, folded)), key=lambda named: named[0])


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


def _block(record: dict[str, tuple[np.ndarray, np.ndarray | None]], shape: tuple[int, int, int],
           constants: dict[str, Any], given: dict[str, Any], rtol: float, folded: _Folded) -> bool:
    """One block of ranks folded into `folded`: the query's per-record values (RECORDS_SQL and the view
    `records`), then its per-step, per-rank and per-(step, microbatch) aggregates; False (nothing folded)
    where a value is not finite or T < n. `given`: the columns left unread, and their one value (`Grid.given`)."""
    def column(name: str) -> tuple[np.ndarray | None, np.ndarray | None]:
        """[ranks, steps, M] and its NULLs; (None, None): no value at all (a NULL on every record)."""
        if name in given:
            # its one value on every record, typed as the query casts it (a view: no array is made)
            return np.broadcast_to(np.asarray(given[name], dtype=_NUMPY_TYPES[COLUMNS_BY_NAME[name].kind]), shape), None
        if name not in record:
            return None, None
        values, nulls = record[name]
        return values.reshape(shape), (None if nulls is None else nulls.reshape(shape))

    tokens = record["valid_tokens"][0].reshape(shape)
    loss = record["loss_sum"][0].reshape(shape)
    if record["valid_tokens"][1] is not None or record["loss_sum"][1] is not None or not np.isfinite(loss).all():
        return False
    positions, positions_nulls = column("positions")
    if positions is not None and (positions < tokens if positions_nulls is None
                                  else (positions < tokens) & ~positions_nulls).any():
        return False  # T < n: the query counts it (unusable_values) and its file is named
    scalar, scalar_nulls = column("backward_scalar")
    weight_sum, weight_sum_nulls = column("token_weight_sum")
    weight_min, weight_min_nulls = column("token_weight_min")
    weight_max, weight_max_nulls = column("token_weight_max")
    masked, masked_nulls = column("masked_weight_abs_sum")
    reported, reported_nulls = column("reported_loss")
    for values, nulls in ((scalar, scalar_nulls), (weight_sum, weight_sum_nulls), (weight_min, weight_min_nulls),
                          (weight_max, weight_max_nulls), (masked, masked_nulls), (reported, reported_nulls)):
        if values is not None and not _finite(values, nulls):
            return False
    world: Any = constants.get("world_size")
    world_values, world_nulls = column("world_size")
    if world is None:
        if world_values is None or world_nulls is not None:
            return False
        world = world_values

    def coalesced(name: str, default: Any) -> Any:
        """coalesce(column, default): a footer's one value as a number (no array made for it)."""
        if name in given:
            return float(given[name])
        values, nulls = column(name)
        return default if values is None else values if nulls is None else np.where(nulls, default, values)

    divisor: Any = coalesced("grad_divisor", np.asarray(world, dtype=np.float64))  # D = coalesce(grad_divisor, W)
    scale: Any = coalesced("grad_scale", 1.0)  # g = coalesce(grad_scale, 1)
    if not isinstance(scale, float) and (scale == 1.0).all():
        scale = 1.0  # c·1 is c bit for bit: no loss scaler, no pass over the records for it
    if not (np.isfinite(divisor).all() and np.isfinite(scale).all()):
        return False  # a NaN divisor or scale: the query counts it and its file is named
    if scalar is None and weight_sum is None:
        return False
    valid = tokens > 0
    counts = tokens.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        # c = probe Σ∂b/∂ℓ / n where recorded, else b/S (S ≠ 0); e = c·g/D, NULL (NaN) where c is
        if weight_sum is None:
            assert scalar is not None
            implied = np.where(loss != 0, scalar / loss, np.nan)
            if scalar_nulls is not None:
                return False  # backward_scalar NULL with no probe: validation rejects it, the query decides
        elif weight_sum_nulls is None:
            implied = weight_sum / counts  # every record probed: b/S is never asked for
        else:
            by_scalar = (np.where(loss != 0, scalar / loss, np.nan) if scalar is not None
                         else np.full(shape, np.nan))
            if scalar_nulls is not None:
                by_scalar = np.where(scalar_nulls, np.nan, by_scalar)
            implied = np.where(weight_sum_nulls, by_scalar, weight_sum / counts)
        implied = np.where(valid, implied, np.nan)
        effective = (implied if isinstance(scale, float) and scale == 1.0 else implied * scale) / divisor
        if np.isinf(effective).any():
            return False  # a weight that is not finite: the query's nonfinite_valid (NaN is NULL here)
        known = ~np.isnan(effective)
        weight = effective  # w: e where the record has valid tokens and a weight, else NULL (NaN)
        weighted_loss = weight * loss
        weighted_tokens = weight * counts

        folded.add("tokens", _step_sum(tokens))
        loss_by_rank = _rank_sums(loss)  # the query's fsum per (rank, step), and the step's from them
        folded.low("n_low", _per_step(np.minimum, tokens))
        folded.high("n_high", _per_step(np.maximum, tokens))
        if "world_size" not in constants:
            folded.low("w_low", _per_step(np.minimum, world))
            folded.high("w_high", _per_step(np.maximum, world))
        if "grad_divisor" not in constants:
            every = np.broadcast_to(divisor, shape)
            folded.low("d_low", _per_step(np.fmin, every))
            folded.high("d_high", _per_step(np.fmax, every))
        # per (step, microbatch) over this block's ranks: e's extremes per step, and em's (below)
        micro_low, micro_high = np.fmin.reduce(weight, axis=0), np.fmax.reduce(weight, axis=0)
        folded.low("e_low", _over_micro(np.fmin, micro_low))
        folded.high("e_high", _over_micro(np.fmax, micro_high))
        # e·n per (rank, step) over its microbatches: the step's extremes, and (× M) enm's
        rank_en_low, rank_en_high = _over_micro(np.fmin, weighted_tokens), _over_micro(np.fmax, weighted_tokens)
        folded.low("en_low", np.fmin.reduce(rank_en_low, axis=0))
        folded.high("en_high", np.fmax.reduce(rank_en_high, axis=0))
        if positions is not None:
            weighted_positions = weight * (positions if positions_nulls is None
                                           else np.where(positions_nulls, np.nan, positions))
            folded.low("et_low", _per_step(np.fmin, weighted_positions))
            folded.high("et_high", _per_step(np.fmax, weighted_positions))
            folded.add("positions", _step_sum(positions if positions_nulls is None
                                              else np.where(positions_nulls, 0, positions)))
            folded.add("positions?", _known(positions_nulls, shape))  # positions_known, and where Σ is NULL
        # the probe's per-token extremes where recorded, else the mean weight: coalesce(probe, w) + 0·w
        for name, probe, nulls, how, extremes in (("tok_low", weight_min, weight_min_nulls, np.fmin, micro_low),
                                                  ("tok_high", weight_max, weight_max_nulls, np.fmax, micro_high)):
            if probe is None:
                # w + 0·w is w bit for bit (w finite; −0.0 + −0.0 is −0.0): e's extremes themselves
                folded.fold(name, _over_micro(how, extremes), how)
                continue
            scaled = probe * scale / divisor
            token = (scaled if nulls is None else np.where(nulls, weight, scaled)) + 0 * weight
            folded.fold(name, _per_step(how, token), how)
        folded.add("weighted_records", _step_count(known))
        folded.add("unweighted_records", _step_count(valid & ~known))
        trusted, trusted_nulls = column("divisor_known")
        unknown = np.zeros(shape, dtype=bool) if trusted is None else (
            valid & ~trusted if trusted_nulls is None else valid & ~trusted & ~trusted_nulls)
        folded.add("unknown_divisor", _step_count(unknown))
        objective_by_rank = _rank_sums(np.where(known, weighted_loss, 0.0))
        if weight_min is not None and weight_max is not None:
            either = (weight_min_nulls if weight_max_nulls is None else weight_max_nulls if weight_min_nulls is None
                      else weight_min_nulls | weight_max_nulls)
            folded.count_if("probe_nonuniform", weight_max - weight_min > rtol * np.abs(weight_max), either)
        if masked is not None:
            reference = np.where(known, np.abs(effective * divisor / scale), 0.0)
            folded.count_if("masked_weighted", (masked > 0) & (masked > rtol * reference), masked_nulls)
        folded.add("probed", _known(weight_sum_nulls, shape) if weight_sum is not None
                   else np.zeros(shape[1], dtype=np.int64))
        sync, sync_nulls = column("sync")
        if sync is not None:
            folded.add("sync_known", _known(sync_nulls, shape))
            folded.count_if("sync_true", sync, sync_nulls)
        skipped, skipped_nulls = column("skipped")
        if skipped is not None:
            folded.count_if("skipped_true", skipped, skipped_nulls)
            folded.count_if("skipped_false", ~skipped, skipped_nulls)
        if reported is not None:
            shown = reported if reported_nulls is None else np.where(reported_nulls, np.nan, reported)
            folded.low("reported_low", _per_step(np.fmin, shown))
            folded.high("reported_high", _per_step(np.fmax, shown))
            folded.add("reported", _known(reported_nulls, shape))

        # Per (rank, step), over its M microbatches
        rank_tokens = _over_micro(np.add, tokens)
        rank_loss = loss_by_rank[0] + loss_by_rank[1]
        rank_low = _over_micro(np.fmin, weight)
        rank_high = _over_micro(np.fmax, weight)
        local = rank_tokens > 0
        local_means = np.where(local, rank_loss / np.where(local, rank_tokens, 1), 0.0)
        # ΣS, Σw·S and the sum of local means, compensated
        folded.sums.add((loss_by_rank[0], objective_by_rank[0], local_means),
                        (loss_by_rank[1], objective_by_rank[1], None))
        folded.add("local_means?", local.sum(axis=0))
        if sync is not None:
            # last_sync = arg_max(sync, micro): the sync of the highest microbatch that has one
            if sync_nulls is None:
                last, last_known = sync[..., -1], np.ones(shape[:2], dtype=bool)
            else:
                last, last_known = np.zeros(shape[:2], dtype=bool), np.zeros(shape[:2], dtype=bool)
                for index in range(shape[2]):
                    here = ~sync_nulls[..., index]
                    last = np.where(here, sync[..., index], last)
                    last_known |= here
            folded.add("unsynced_ranks", (last_known & ~last).sum(axis=0))
            folded.add("unsynced_ranks?", last_known.sum(axis=0))
        micro = float(shape[2])
        folded.low("enm_low", np.fmin.reduce(rank_en_low * micro, axis=0))
        folded.high("enm_high", np.fmax.reduce(rank_en_high * micro, axis=0))
        folded.low("er_low", np.fmin.reduce(rank_low * rank_tokens, axis=0))
        folded.high("er_high", np.fmax.reduce(rank_high * rank_tokens, axis=0))
        # per (step, microbatch): e's extremes and the tokens, over every rank before em is taken (`_table`)
        folded.low("micro_low", micro_low)
        folded.high("micro_high", micro_high)
        folded.add("micro_tokens", tokens.sum(axis=0))
    return True


def _known(nulls: np.ndarray | None, shape: tuple[int, int, int]) -> np.ndarray:
    """count(column) per step: its records that are not NULL."""
    if nulls is None:
        return np.full(shape[1], shape[0] * shape[2], dtype=np.int64)
    return _step_count(~nulls)


def _table(folded: _Folded, step: np.ndarray, grid: Grid, constants: dict[str, Any]) -> dict[str, np.ndarray]:
    """The folded aggregates as the query's columns, in its order and types (a count NULL on some step is
    float64 with NaN there, as `_aggregate` makes DuckDB's masked counts)."""
    held = folded.held
    steps = len(step)
    count = grid.micro * len(grid.ranks)

    def integer(values: np.ndarray | int) -> np.ndarray:
        return np.broadcast_to(np.asarray(values, dtype=np.int32), (steps,)).copy()

    def nullable(name: str, kind: type[np.integer[Any]] = np.int32) -> np.ndarray:
        """count_if, or the sum of a column: NULL where no record's value was known."""
        if name not in held:
            return np.full(steps, np.nan)
        values, known = held[name], held[name + "?"]
        return values.astype(kind) if (known > 0).all() else np.where(known > 0, values, np.nan)

    def double(name: str) -> np.ndarray:
        return held[name].astype(np.float64) if name in held else np.full(steps, np.nan)

    world = constants.get("world_size")
    divisor = constants.get("grad_divisor")
    # rank_mask: ranks below 64 present in the step, as set bits; every rank is in every step of a grid
    mask = np.uint64(0)
    for rank in grid.ranks:
        if rank < 64:
            mask |= np.uint64(1) << np.uint64(rank)
    local = held["local_means?"]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_of_local_means = np.where(local > 0, folded.sums.value("local_means") / np.where(local > 0, local, 1),
                                       np.nan)
    # em = extreme of e over the step's microbatch × that microbatch's tokens over all ranks
    micro_tokens = held["micro_tokens"]
    table: dict[str, np.ndarray] = {
        "step": step.astype(np.int64),
        "records": integer(count),
        "rank_max": integer(max(grid.ranks)),
        "w_low": integer(world if world is not None else held["w_low"]),
        "w_high": integer(world if world is not None else held["w_high"]),
        "d_low": np.full(steps, float(divisor)) if divisor is not None else double("d_low"),
        "d_high": np.full(steps, float(divisor)) if divisor is not None else double("d_high"),
        "n_low": held["n_low"].astype(np.int64), "n_high": held["n_high"].astype(np.int64),
        "tokens": held["tokens"].astype(np.int64), "loss": folded.sums.value("loss"),
        "e_low": double("e_low"), "e_high": double("e_high"),
        "en_low": double("en_low"), "en_high": double("en_high"),
        "et_low": double("et_low"), "et_high": double("et_high"),
        "tok_low": double("tok_low"), "tok_high": double("tok_high"),
        "weighted_records": integer(held["weighted_records"]),
        "unweighted_records": integer(held["unweighted_records"]),
        "unknown_divisor": integer(held["unknown_divisor"]),
        "objective": folded.sums.value("objective"),
        "nonfinite_valid": integer(0), "nonfinite_zero": integer(0),
        "probe_nonuniform": nullable("probe_nonuniform"),
        "masked_weighted": nullable("masked_weighted"),
        "probed": integer(held["probed"]),
        "sync_known": integer(held.get("sync_known", 0)),
        "sync_true": nullable("sync_true"),
        "skipped_true": nullable("skipped_true"), "skipped_false": nullable("skipped_false"),
        "reported_low": double("reported_low"), "reported_high": double("reported_high"),
        "reported": integer(held.get("reported", 0)),
        "positions": nullable("positions", np.int64),
        "positions_known": integer(held.get("positions?", 0)),
        "wide_micro": integer(0), "unusable_values": integer(0),
        "ranks": integer(len(grid.ranks)),
        "mean_of_local_means": mean_of_local_means,
        "rank_mask": np.full(steps, mask, dtype=np.uint64),
        "unsynced_ranks": nullable("unsynced_ranks"),
        "repeated_micro": integer(0),
        "m_low": integer(grid.micro), "m_high": integer(grid.micro),
        "enm_low": double("enm_low"), "enm_high": double("enm_high"),
        "er_low": double("er_low"), "er_high": double("er_high"),
        "em_low": _over_micro(np.fmin, held["micro_low"] * micro_tokens),
        "em_high": _over_micro(np.fmax, held["micro_high"] * micro_tokens),
    }
    return table
