"""The step table's columns as numpy arrays: ranges joined without a second copy, constants held as one value, spilled to disk past SPILL_STEPS."""

from __future__ import annotations

from dataclasses import dataclass

import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from pandas.api.types import union_categoricals

from tokaudit._engine.columns import ROUNDED_BITS, STEP_COLUMN_BY_NAME, STEP_COLUMNS
from tokaudit._engine.sql import FETCHED_TYPES
from tokaudit.errors import UsageError


def categorical(names: np.ndarray) -> pd.Categorical:
    """A handful of names repeated on every step, as categories (one byte a step) in sorted order, as
    pd.Categorical makes them: from a hash of the Python strings themselves, where pd.Categorical would
    first turn every row into an Arrow string (three times as long)."""
    codes, names_found = pd.factorize(names)
    order = np.argsort(names_found)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return pd.Categorical.from_codes(rank[codes], categories=pd.Index(list(names_found[order])))


SPILL_STEPS = 1_250_000
"""Steps past which the audit keeps the step table on disk a range at a time (`Engine.step_parts`): whole,
it costs about 127 bytes a step (1.6 GB at 12.5M steps) and the checks would add their own. What is held before it
goes, beside the range or window being aggregated, is what decides the audit's peak on a log of millions of steps:
up to 1.25M steps the 768 MiB budget holds with a window's records in Arrow's memory beside them (at 1.5M it does
not). Below it the checks' passes read the table in memory, not each range again from disk."""

SCRATCH_PREFIXES = ("tokaudit-steps-", "tokaudit-shards-")
"""The folders an audit makes under TMPDIR: a spilled step table, the links to shards with odd names."""


def scratch_folder(prefix: str) -> Path:
    """A folder of this audit's under TMPDIR, named after its process: a later audit can tell whether the process
    that made it is still alive (`sweep_scratch`)."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def sweep_scratch() -> None:
    """Remove what audits killed before their clean-up (SIGKILL, a lost node) left under TMPDIR: the folders whose
    process is gone. A live audit's folders, and any not named after a process, are never touched."""
    try:
        entries = list(os.scandir(tempfile.gettempdir()))
    except OSError:
        return
    for entry in entries:
        prefix = next((p for p in SCRATCH_PREFIXES if entry.name.startswith(p)), None)
        pid = entry.name[len(prefix) :].split("-", 1)[0] if prefix else ""
        if pid.isdigit() and not _alive(int(pid)) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


class Spilled:
    """A step table kept on disk, one file per step range in step order (each range's rows in step order
    within every (run, group, term)): read back one range at a time (`parts`). The names each range holds
    are noted as it is written. A column held as one value stays one value (`constant_of`). The folder is
    made under TMPDIR with the first range and removed by `close`."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.paths: list[Path] = []
        self.names: set[tuple[str, str, str]] = set()
        """Every (run, group, term) of the table."""
        self.unusable = 0
        """Steps with a NaN divisor or scale or T < n (`unusable_values`), counted as the ranges are written: the
        caller need not read them back to know."""
        self.unsynced = 0
        """Steps some rank's last microbatch of which did not synchronize (`unsynced_ranks`), counted the same way."""

    def add(self, table: dict[str, Any]) -> None:
        rows = len(table["step"])
        if not rows:
            return
        self.names.update(table_names(table))
        packed = {
            name: ("one value", values[:1].copy(), len(values)) if one_value(values) else values
            for name, values in table.items()
        }
        try:
            if self.folder is None:
                self.folder = scratch_folder("tokaudit-steps-")
            path = self.folder / f"steps-{len(self.paths):06d}.pickle"
            with open(path, "wb") as out:
                pickle.dump(packed, out, protocol=5)
        except OSError as error:
            raise UsageError(
                f"cannot keep the step table of this log on disk ({error.strerror or error}: "
                f"{error.filename or tempfile.gettempdir()}); it needs about 130 bytes a step: "
                "free space there or set TMPDIR to a folder that has it"
            ) from None
        self.paths.append(path)
        self.unusable += int(np.count_nonzero(np.nan_to_num(table["unusable_values"]) > 0))
        self.unsynced += int(np.count_nonzero(np.nan_to_num(table["unsynced_ranks"]) > 0))

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def parts(self) -> Iterator[pd.DataFrame]:
        assert self.folder is not None or not self.paths
        for path in self.paths:
            with open(path, "rb") as source:
                packed = pickle.load(source)
            yield pd.DataFrame(
                {
                    name: np.broadcast_to(values[1], (values[2],)) if isinstance(values, tuple) else values
                    for name, values in packed.items()
                },
                copy=False,
            )


def table_names(table: dict[str, Any]) -> set[tuple[str, str, str]]:
    """The (run, group, term) a range's table holds: its names' codes, each distinct combination once."""
    columns = [pd.Categorical(table[c]) for c in ("run", "grp", "term")]
    sizes = [len(column.categories) + 1 for column in columns]  # + 1: a missing name's code, −1
    # the three codes as one number, in mixed radix: a sort of integers, not of rows
    key = ((columns[0].codes.astype(np.int64) + 1) * sizes[1] + columns[1].codes + 1) * sizes[2] + columns[2].codes + 1
    found = []
    for value in np.unique(key).tolist():
        value, term = divmod(value, sizes[2])
        run, group = divmod(value, sizes[1])
        found.append(
            tuple(
                str(column.categories[code - 1]) if code else "nan"  # as a missing name reads as text
                for column, code in zip(columns, (run, group, term))
            )
        )
    return set(found)  # type: ignore[arg-type]


def join_columns(columns: dict[str, list[Any]]) -> dict[str, Any]:
    """One table from the ranges' columns, a column at a time: each column's parts are let go as soon
    as they are joined (a concat of frames would hold the table twice at its peak). The
    frame is then made around the joined arrays, not copied into pandas' blocks (assigning a column
    copies it; so does a frame of one block per type)."""
    order = list(columns)
    joined: dict[str, Any] = {}
    # A column made of the very arrays of another (`sql.aliases`) is that column
    # again, joined with it: grouped by the parts' identities, taken while every part is alive. Its parts
    # are then let go at once, not held until its own turn (at 12.5M steps four such pairs held 400 MB).
    same_parts: dict[tuple[int, ...], list[str]] = {}
    for name, parts in columns.items():
        same_parts.setdefault(tuple(id(part) for part in parts), []).append(name)
    for names in same_parts.values():
        parts = columns.pop(names[0])
        for alias in names[1:]:
            del columns[alias]
        value = constant_of(parts)
        if value is None:
            if len(parts) == 1:
                value = parts[0]
            elif isinstance(parts[0], pd.Categorical):
                value = union_categoricals(parts, sort_categories=True)
            else:
                # A count with NULLs in some range only is float64 there: the joined column then is too.
                value = np.concatenate(parts)
        for name in names:
            joined[name] = value
        del parts, value
    return {name: joined[name] for name in order}


def constant_of(parts: list[Any]) -> np.ndarray | None:
    """A numeric column whose every row holds one value, bit for bit (W, D, a count that is always 0 or
    always the ranks, a column no record has: about half the columns of a run that never changed its
    set-up), as that value repeated without memory (a read-only array of stride 0); else None."""
    dtype = parts[0].dtype if isinstance(parts[0], np.ndarray) else None
    if dtype is None or dtype.kind not in "iuf" or any(part.dtype != dtype for part in parts):
        return None
    rows = sum(len(part) for part in parts)
    if rows < 2:
        return None
    first = next(part[:1] for part in parts if len(part))
    # Compared as bits (0.0 and -0.0 differ, and NaN equals NaN when it is the same NaN); a part that is
    # one value already is compared by that value.
    for part in parts:
        values = part[:1] if one_value(part) else part
        if not same_bits(values, np.broadcast_to(first, values.shape)):
            return None
    return np.broadcast_to(first.copy(), (rows,))


def same_bits(one: Any, other: Any) -> bool:
    """Two numeric arrays of one dtype and length that hold the same bits in every row (NaN included)."""
    if (
        not (isinstance(one, np.ndarray) and isinstance(other, np.ndarray))
        or one.dtype != other.dtype
        or one.dtype.kind not in "iuf"
        or one.shape != other.shape
    ):
        return False
    as_bits = np.dtype(f"u{one.dtype.itemsize}")
    return bool((one.view(as_bits) == other.view(as_bits)).all())


def one_value(values: Any) -> bool:
    """An array that is one value repeated without memory (`constant_of`'s, stride 0)."""
    return isinstance(values, np.ndarray) and values.strides == (0,) and len(values) > 0


def reorder(joined: dict[str, Any], order: np.ndarray) -> None:
    """Every column put in this order, in place, one at a time, each old column let go before the next
    is taken (a frame's sort_values holds the table twice), and an array shared by several columns
    (`sql.aliases`) taken once and still shared."""
    taken: dict[int, Any] = {}
    for name in list(joined):
        values = joined[name]
        if one_value(values):
            continue  # one value in every row (`constant_of`): in any order
        if id(values) not in taken:
            taken[id(values)] = values.take(order)
        joined[name] = taken[id(values)]
        del values


@dataclass(frozen=True)
class Duplicates:
    """A run's records that repeat a (group, term, step, micro, rank) already logged, of which one was kept."""

    dropped: int
    """Records left out (every copy but the one kept)."""
    first: int
    last: int
    steps: int
    """First and last step with a repeated key, and how many steps had one."""
    files: tuple[str, ...] = ()
    """The first files the repeated keys were found in, by their paths, sorted: FILES_NAMED, and one more where there
    are more (every range's first, so the first of all where ranges are added)."""
    identical: bool = True
    """Every repeated record holds the values of the one kept (S, n, b, the probe, g, D, W, sync, skipped)."""
    same_time: bool = True
    """And was written at the same time: a copy of the same records, not a second launch that computed them."""
    one_file: bool = False
    """Some key is repeated inside one file, which one process wrote: its step went back during that launch."""
    superseded: int = 0
    """Records of an earlier launch's (step, rank) that a later launch recorded again, or of a rank past its W at a
    step it recorded again (`sql.LAUNCHED_VIEW`), left out with the copies."""
    unlaunched: bool = False
    """Some copy lies in a file that does not say which launch wrote it (another writer's): of those, the copy in
    the file modified last was kept."""
    left_out: tuple[str, ...] = ()
    """Every file that holds a copy left out (a later published one kept), by its path."""

    def __add__(self, other: Duplicates) -> Duplicates:
        """Repeated keys found in another range (ranges hold different steps)."""
        return Duplicates(
            self.dropped + other.dropped,
            min(self.first, other.first),
            max(self.last, other.last),
            self.steps + other.steps,
            tuple(sorted({*self.files, *other.files}))[: FILES_NAMED + 1],
            self.identical and other.identical,
            self.same_time and other.same_time,
            self.one_file or other.one_file,
            self.superseded + other.superseded,
            self.unlaunched or other.unlaunched,
            tuple(sorted({*self.left_out, *other.left_out})),
        )


FILES_NAMED = 4
"""Files a duplicate_records finding names."""


def add_duplicates(target: dict[str, Duplicates], found: dict[str, Duplicates]) -> None:
    """Count repeated keys found in another range, per run, as `Engine.duplicates`."""
    for run, duplicates in found.items():
        target[run] = target[run] + duplicates if run in target else duplicates


def finished(
    table: dict[str, Any], names: tuple[str, str, str] | None, held: dict[str, str], literal: dict[str, np.ndarray]
) -> dict[str, Any]:
    """A range's fetched columns as the step table holds them, in the declared order: the names as categories
    (the one name of `names` when the query left them out), NULLs as NaN, constants as one value (`literal`'s,
    from `sql.constants`, never fetched), and one array for a column that is another's (`held`, from
    `sql.aliases`)."""
    rows = len(table["step"])
    if names is not None:
        # The one name of each column, as the categories `categorical` makes of it.
        table.update(
            {
                column: pd.Categorical.from_codes(np.zeros(rows, dtype=np.int8), categories=pd.Index([name]))
                for column, name in zip(("run", "grp", "term"), names)
            }
        )
    for name, values in table.items():
        if name in ("run", "grp", "term"):
            if names is None:
                table[name] = categorical(values)
            continue
        if isinstance(values, np.ma.MaskedArray):
            # A column with NULLs (no record of the step said): NaN, which compares and sums as the
            # checks expect; a count becomes float64 for it.
            values = np.ma.filled(values.astype(np.float64), np.nan) if values.mask.any() else np.asarray(values.data)
        if values.dtype == np.float64:
            # −0.0 + 0.0 is 0.0: which zero the extreme of tied 0.0 and −0.0 is depends on the order the
            # records came in (DuckDB keeps the last of equals, in its scan's or its hash table's order),
            # and so would the report's; the table holds 0.0 for both.
            values = np.add(values, 0.0, out=values if values.flags.writeable else None)
        # A constant column is held as its one value from here on: the ranges wait for `join_columns` with
        # about half their columns taking no memory.
        constant = constant_of([values])
        table[name] = values if constant is None else constant
    for name, value in literal.items():  # as a fetched column of that value would be held
        table[name] = (
            np.broadcast_to(value, (rows,))
            if rows > 1
            else np.repeat(value, rows)
            if rows
            else np.zeros(0, dtype=FETCHED_TYPES[STEP_COLUMN_BY_NAME[name].type or None])
        )
    order = ["run", "grp", "term", "step", *(c.name for c in STEP_COLUMNS if c.name in table or c.name in held)]
    return {name: table[held.get(name, name)] for name in order}


def note_precision(precision: dict[str, int], rounded: dict[str, list[int]], table: dict[str, Any]) -> None:
    """Per run of a range's table: the fewest significant bits its records say (`precision_bits_low`), folded into
    `precision`; the most bits a backward scalar of rank 0 held (`scalar_bits_high`) and in how many steps, into
    `rounded` (`rounded_precision`)."""
    runs = table["run"]
    said, held = (np.asarray(table[c], dtype=np.float64) for c in ("precision_bits_low", "scalar_bits_high"))
    for code in np.unique(runs.codes):
        mine, run = runs.codes == code, str(runs.categories[code])
        fewest, most = np.fmin.reduce(said[mine]), np.fmax.reduce(held[mine])  # NaN: no record says, no b held
        if not np.isnan(fewest):
            precision[run] = min(precision.get(run, 64), int(fewest))
        seen = rounded.setdefault(run, [0, 0])
        seen[0] = seen[0] if np.isnan(most) else max(seen[0], int(most))
        # the distinct steps where rank 0 held a b (ranges hold other steps): the table is in step order (`step_sql`),
        # so a step's rows are adjacent
        steps = np.asarray(table["step"])[mine][~np.isnan(held[mine])]
        seen[1] += int(np.count_nonzero(steps[1:] != steps[:-1])) + int(len(steps) > 0)


def rounded_precision(rounded: dict[str, list[int]]) -> dict[str, int]:
    """The runs whose every backward scalar of rank 0 holds bfloat16's or float16's bits (`columns.ROUNDED_BITS`), in 3
    steps or more: their b was computed in that precision (logged as a wider float: a Python number), or is round
    numbers (integer losses), which hold those bits too; a float32 value of a real loss holds 8 bits by chance once in
    2¹⁶."""
    return {run: most for run, (most, steps) in rounded.items() if 0 < most <= max(ROUNDED_BITS) and steps >= 3}
