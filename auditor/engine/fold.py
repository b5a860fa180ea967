"""The grid's reductions: a block of ranks' records [ranks, steps, M] folded into per-step aggregates, as the
query computes them (NULL as DuckDB has it: min, max and sum skip it, count_if over none is NULL; float sums
compensated as its fsum and favg are)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokaudit.schema import COLUMNS_BY_NAME


NUMPY_TYPES = {"int": np.int64, "float": np.float64, "bool": np.bool_}

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

class Folded:
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

def _finite(values: np.ndarray, nulls: np.ndarray | None) -> bool:
    finite = np.isfinite(values)
    return bool(finite.all() if nulls is None else (finite | nulls).all())

Columns = dict[str, tuple[np.ndarray, np.ndarray | None]]
"""A block's records by column: (values, where NULL or None), each [ranks·steps·M] as read."""


@dataclass
class Weighed:
    """One block of ranks as the query sees it (RECORDS_SQL and the view `records`): [ranks, steps, M] arrays,
    e = c·g/D and w (e where the record has valid tokens and a weight, else NULL as NaN)."""

    shape: tuple[int, int, int]
    column: Callable[[str], tuple[np.ndarray | None, np.ndarray | None]]
    """[ranks, steps, M] of a column and its NULLs; (None, None): no value at all (a NULL on every record)."""
    tokens: np.ndarray
    loss: np.ndarray
    divisor: Any
    scale: Any
    world: Any
    valid: np.ndarray
    effective: np.ndarray
    known: np.ndarray


def fold_block(record: Columns, shape: tuple[int, int, int], constants: dict[str, Any], given: dict[str, Any],
               rtol: float, folded: Folded) -> bool:
    """One block of ranks folded into `folded`: the query's per-record values, then its per-step, per-rank
    and per-(step, microbatch) aggregates; False (nothing folded) where a value is not finite or T < n.
    `given`: the columns left unread, and their one value (`Grid.given`)."""
    weighed = _weighed(record, shape, constants, given)
    if weighed is None:
        return False
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        loss_by_rank, objective_by_rank = _fold_steps(folded, weighed, constants, rtol)
        _fold_ranks(folded, weighed, loss_by_rank, objective_by_rank)
    return True


def _columns(record: Columns, shape: tuple[int, int, int], given: dict[str, Any]
             ) -> Callable[[str], tuple[np.ndarray | None, np.ndarray | None]]:
    def column(name: str) -> tuple[np.ndarray | None, np.ndarray | None]:
        """[ranks, steps, M] and its NULLs; (None, None): no value at all (a NULL on every record)."""
        if name in given:
            # its one value on every record, typed as the query casts it (a view: no array is made)
            return np.broadcast_to(np.asarray(given[name], dtype=NUMPY_TYPES[COLUMNS_BY_NAME[name].kind]), shape), None
        if name not in record:
            return None, None
        values, nulls = record[name]
        return values.reshape(shape), (None if nulls is None else nulls.reshape(shape))
    return column


def _usable(record: Columns, column: Callable[[str], tuple[np.ndarray | None, np.ndarray | None]],
            tokens: np.ndarray, loss: np.ndarray) -> bool:
    """Every value the query would take as it is: finite where not NULL, T ≥ n (else the query counts the
    record, and its file is named)."""
    if record["valid_tokens"][1] is not None or record["loss_sum"][1] is not None or not np.isfinite(loss).all():
        return False
    positions, positions_nulls = column("positions")
    if positions is not None and (positions < tokens if positions_nulls is None
                                  else (positions < tokens) & ~positions_nulls).any():
        return False
    for name in ("backward_scalar", "token_weight_sum", "token_weight_min", "token_weight_max",
                 "masked_weight_abs_sum", "reported_loss"):
        values, nulls = column(name)
        if values is not None and not _finite(values, nulls):
            return False
    return True


def _weighed(record: Columns, shape: tuple[int, int, int], constants: dict[str, Any], given: dict[str, Any]
             ) -> Weighed | None:
    """The block's weights, or None where the query must decide (a value not finite, T < n, no weight)."""
    column = _columns(record, shape, given)
    tokens = record["valid_tokens"][0].reshape(shape)
    loss = record["loss_sum"][0].reshape(shape)
    if not _usable(record, column, tokens, loss):
        return None
    world: Any = constants.get("world_size")
    world_values, world_nulls = column("world_size")
    if world is None:
        if world_values is None or world_nulls is not None:
            return None
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
        return None  # a NaN divisor or scale: the query counts it and its file is named
    valid = tokens > 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        implied = _implied(column, loss, tokens, shape)
        if implied is None:
            return None
        implied = np.where(valid, implied, np.nan)
        effective = (implied if isinstance(scale, float) and scale == 1.0 else implied * scale) / divisor
    if np.isinf(effective).any():
        return None  # a weight that is not finite: the query's nonfinite_valid (NaN is NULL here)
    return Weighed(shape, column, tokens, loss, divisor, scale, world, valid, effective, ~np.isnan(effective))


def _implied(column: Callable[[str], tuple[np.ndarray | None, np.ndarray | None]], loss: np.ndarray,
             tokens: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray | None:
    """c = probe Σ∂b/∂ℓ / n where recorded, else b/S (S ≠ 0); NULL (NaN) where neither; None: the query decides."""
    scalar, scalar_nulls = column("backward_scalar")
    weight_sum, weight_sum_nulls = column("token_weight_sum")
    counts = tokens.astype(np.float64)
    if weight_sum is None:
        if scalar is None or scalar_nulls is not None:
            return None  # backward_scalar NULL with no probe: validation rejects it, the query decides
        return np.where(loss != 0, scalar / loss, np.nan)
    if weight_sum_nulls is None:
        return weight_sum / counts  # every record probed: b/S is never asked for
    by_scalar = np.where(loss != 0, scalar / loss, np.nan) if scalar is not None else np.full(shape, np.nan)
    if scalar_nulls is not None:
        by_scalar = np.where(scalar_nulls, np.nan, by_scalar)
    return np.where(weight_sum_nulls, by_scalar, weight_sum / counts)


def _fold_steps(folded: Folded, block: Weighed, constants: dict[str, Any], rtol: float
                ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The per-step aggregates of STEP_AGGREGATES; returns the per-rank compensated sums of S and w·S."""
    shape, column, tokens, loss = block.shape, block.column, block.tokens, block.loss
    weight, known, valid = block.effective, block.known, block.valid
    folded.add("tokens", _step_sum(tokens))
    loss_by_rank = _rank_sums(loss)  # the query's fsum per (rank, step), and the step's from them
    folded.low("n_low", _per_step(np.minimum, tokens))
    folded.high("n_high", _per_step(np.maximum, tokens))
    if "world_size" not in constants:
        folded.low("w_low", _per_step(np.minimum, block.world))
        folded.high("w_high", _per_step(np.maximum, block.world))
    if "grad_divisor" not in constants:
        every = np.broadcast_to(block.divisor, shape)
        folded.low("d_low", _per_step(np.fmin, every))
        folded.high("d_high", _per_step(np.fmax, every))
    _fold_extremes(folded, block)
    folded.add("weighted_records", _step_count(known))
    folded.add("unweighted_records", _step_count(valid & ~known))
    trusted, trusted_nulls = column("divisor_known")
    unknown = np.zeros(shape, dtype=bool) if trusted is None else (
        valid & ~trusted if trusted_nulls is None else valid & ~trusted & ~trusted_nulls)
    folded.add("unknown_divisor", _step_count(unknown))
    objective_by_rank = _rank_sums(np.where(known, weight * loss, 0.0))
    _fold_probe(folded, block, rtol)
    _fold_flags(folded, block)
    return loss_by_rank, objective_by_rank


def _fold_extremes(folded: Folded, block: Weighed) -> None:
    """e's extremes per step, and e × each candidate denominator's (n, T) and the probe's per-token ones."""
    weight, shape = block.effective, block.shape
    # per (step, microbatch) over this block's ranks: e's extremes per step, and em's (`step_columns`)
    micro_low, micro_high = np.fmin.reduce(weight, axis=0), np.fmax.reduce(weight, axis=0)
    folded.low("e_low", _over_micro(np.fmin, micro_low))
    folded.high("e_high", _over_micro(np.fmax, micro_high))
    folded.low("micro_low", micro_low)
    folded.high("micro_high", micro_high)
    # e·n per (rank, step) over its microbatches: the step's extremes, and (× M) enm's
    weighted_tokens = weight * block.tokens.astype(np.float64)
    rank_en_low, rank_en_high = _over_micro(np.fmin, weighted_tokens), _over_micro(np.fmax, weighted_tokens)
    folded.low("en_low", np.fmin.reduce(rank_en_low, axis=0))
    folded.high("en_high", np.fmax.reduce(rank_en_high, axis=0))
    micro = float(shape[2])
    folded.low("enm_low", np.fmin.reduce(rank_en_low * micro, axis=0))
    folded.high("enm_high", np.fmax.reduce(rank_en_high * micro, axis=0))
    positions, positions_nulls = block.column("positions")
    if positions is not None:
        weighted_positions = weight * (positions if positions_nulls is None
                                       else np.where(positions_nulls, np.nan, positions))
        folded.low("et_low", _per_step(np.fmin, weighted_positions))
        folded.high("et_high", _per_step(np.fmax, weighted_positions))
        folded.add("positions", _step_sum(positions if positions_nulls is None
                                          else np.where(positions_nulls, 0, positions)))
        folded.add("positions?", _known(positions_nulls, shape))  # positions_known, and where Σ is NULL
    # the probe's per-token extremes where recorded, else the mean weight: coalesce(probe, w) + 0·w
    for name, column, how, extremes in (("tok_low", "token_weight_min", np.fmin, micro_low),
                                        ("tok_high", "token_weight_max", np.fmax, micro_high)):
        probe, nulls = block.column(column)
        if probe is None:
            # w + 0·w is w bit for bit (w finite; −0.0 + −0.0 is −0.0): e's extremes themselves
            folded.fold(name, _over_micro(how, extremes), how)
            continue
        scaled = probe * block.scale / block.divisor
        token = (scaled if nulls is None else np.where(nulls, weight, scaled)) + 0 * weight
        folded.fold(name, _per_step(how, token), how)


def _fold_probe(folded: Folded, block: Weighed, rtol: float) -> None:
    """The probe's counts: records probed, non-uniform inside, weight on masked positions."""
    weight_min, weight_min_nulls = block.column("token_weight_min")
    weight_max, weight_max_nulls = block.column("token_weight_max")
    if weight_min is not None and weight_max is not None:
        either = (weight_min_nulls if weight_max_nulls is None else weight_max_nulls if weight_min_nulls is None
                  else weight_min_nulls | weight_max_nulls)
        folded.count_if("probe_nonuniform", weight_max - weight_min > rtol * np.abs(weight_max), either)
    masked, masked_nulls = block.column("masked_weight_abs_sum")
    if masked is not None:
        reference = np.where(block.known, np.abs(block.effective * block.divisor / block.scale), 0.0)
        folded.count_if("masked_weighted", (masked > 0) & (masked > rtol * reference), masked_nulls)
    weight_sum, weight_sum_nulls = block.column("token_weight_sum")
    folded.add("probed", _known(weight_sum_nulls, block.shape) if weight_sum is not None
               else np.zeros(block.shape[1], dtype=np.int64))


def _fold_flags(folded: Folded, block: Weighed) -> None:
    """sync, skipped and the reported losses."""
    sync, sync_nulls = block.column("sync")
    if sync is not None:
        folded.add("sync_known", _known(sync_nulls, block.shape))
        folded.count_if("sync_true", sync, sync_nulls)
    skipped, skipped_nulls = block.column("skipped")
    if skipped is not None:
        folded.count_if("skipped_true", skipped, skipped_nulls)
        folded.count_if("skipped_false", ~skipped, skipped_nulls)
    reported, reported_nulls = block.column("reported_loss")
    if reported is not None:
        shown = reported if reported_nulls is None else np.where(reported_nulls, np.nan, reported)
        folded.low("reported_low", _per_step(np.fmin, shown))
        folded.high("reported_high", _per_step(np.fmax, shown))
        folded.add("reported", _known(reported_nulls, block.shape))


def _fold_ranks(folded: Folded, block: Weighed, loss_by_rank: tuple[np.ndarray, np.ndarray],
                objective_by_rank: tuple[np.ndarray, np.ndarray]) -> None:
    """Per (rank, step), over its M microbatches: RANK_AGGREGATES and RANK_SHAPE, and the compensated sums."""
    shape, tokens, weight = block.shape, block.tokens, block.effective
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
    sync, sync_nulls = block.column("sync")
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
    folded.low("er_low", np.fmin.reduce(rank_low * rank_tokens, axis=0))
    folded.high("er_high", np.fmax.reduce(rank_high * rank_tokens, axis=0))
    folded.add("micro_tokens", tokens.sum(axis=0))


def _known(nulls: np.ndarray | None, shape: tuple[int, int, int]) -> np.ndarray:
    """count(column) per step: its records that are not NULL."""
    if nulls is None:
        return np.full(shape[1], shape[0] * shape[2], dtype=np.int64)
    return _step_count(~nulls)

class _Typed:
    """The folded aggregates of `steps` steps as the query types them."""

    def __init__(self, held: dict[str, np.ndarray], steps: int) -> None:
        self.held, self.steps = held, steps

    def integer(self, values: np.ndarray | int) -> np.ndarray:
        return np.broadcast_to(np.asarray(values, dtype=np.int32), (self.steps,)).copy()

    def nullable(self, name: str, kind: type[np.integer[Any]] = np.int32) -> np.ndarray:
        """count_if, or the sum of a column: NULL where no record's value was known."""
        if name not in self.held:
            return np.full(self.steps, np.nan)
        values, known = self.held[name], self.held[name + "?"]
        return values.astype(kind) if (known > 0).all() else np.where(known > 0, values, np.nan)

    def double(self, name: str) -> np.ndarray:
        return self.held[name].astype(np.float64) if name in self.held else np.full(self.steps, np.nan)


def _rank_mask(ranks: tuple[int, ...]) -> np.uint64:
    """rank_mask: the ranks below 64 present in a step, as set bits (every rank is in every step of a grid)."""
    mask = np.uint64(0)
    for rank in ranks:
        if rank < 64:
            mask |= np.uint64(1) << np.uint64(rank)
    return mask


def step_columns(folded: Folded, step: np.ndarray, micro: int, ranks: tuple[int, ...], constants: dict[str, Any]
                 ) -> dict[str, np.ndarray]:
    """The folded aggregates as the query's columns, in its order and types (a count NULL on some step is
    float64 with NaN there, as `_aggregate` makes DuckDB's masked counts)."""
    held = folded.held
    steps = len(step)
    out = _Typed(held, steps)
    integer, nullable, double = out.integer, out.nullable, out.double
    world = constants.get("world_size")
    divisor = constants.get("grad_divisor")
    mask = _rank_mask(ranks)
    local = held["local_means?"]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_of_local_means = np.where(local > 0, folded.sums.value("local_means") / np.where(local > 0, local, 1),
                                       np.nan)
    # em = extreme of e over the step's microbatch × that microbatch's tokens over all ranks
    micro_tokens = held["micro_tokens"]
    return {
        "step": step.astype(np.int64),
        "records": integer(micro * len(ranks)),
        "rank_max": integer(max(ranks)),
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
        "ranks": integer(len(ranks)),
        "mean_of_local_means": mean_of_local_means,
        "rank_mask": np.full(steps, mask, dtype=np.uint64),
        "unsynced_ranks": nullable("unsynced_ranks"),
        "repeated_micro": integer(0),
        "m_low": integer(micro), "m_high": integer(micro),
        "enm_low": double("enm_low"), "enm_high": double("enm_high"),
        "er_low": double("er_low"), "er_high": double("er_high"),
        "em_low": _over_micro(np.fmin, held["micro_low"] * micro_tokens),
        "em_high": _over_micro(np.fmax, held["micro_high"] * micro_tokens),
    }
