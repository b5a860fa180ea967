"""From buffered records to the log's Arrow table: one device→host copy per column, values checked."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tokaudit._schema import COLUMNS_BY_NAME

Number = int | float | bool
Value = Number | torch.Tensor | None
INT64_MAX = (1 << 63) - 1


_PACKABLE = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)
"""Dtypes whose every value a float64 holds exactly (an int64 count up to 2⁵³)."""


def significant_bits(*values: Any) -> int | None:
    """The fewest significant bits among the floating-point tensors or dtypes given (8 for bfloat16, 11 float16,
    24 float32, 53 float64); None where none is one: a Python number says nothing of how it was computed."""
    bits = [
        _bits_of(dtype)
        for dtype in (v.dtype if isinstance(v, torch.Tensor) else v for v in values)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point
    ]
    return min(bits) if bits else None


_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
"""p significant bits of the usual dtypes: a dict, which torch.compile traces (a cache wrapper it warns about)."""


def _bits_of(dtype: torch.dtype) -> int:
    # eps = 2^(1−p) for p significant bits (the implicit leading one included)
    return _BITS.get(dtype) or round(1 - math.log2(torch.finfo(dtype).eps))


class Packed:
    """A value the recorder held as a one-number tensor, now the `index`-th number of a float64 tensor on its
    device that holds the values of closed updates (`pack`)."""

    __slots__ = ("values", "index")

    def __init__(self, values: torch.Tensor, index: int) -> None:
        self.values = values
        self.index = index

    def tensor(self) -> torch.Tensor:
        """The value as a tensor again (a view of the pack, float64)."""
        return self.values[self.index]


class PackedHost:
    """The packs of one flush on the host: of each slab, the span of places its records hold, copied with one
    device→host copy per device (`copy`), made when the first column asks (`to_host`) unless the flush asks
    for all its values first."""

    def __init__(self) -> None:
        self._spans: dict[int, tuple[int, list[float]]] = {}  # id(slab): (first place copied, the numbers)

    def copy(self, values: Sequence[Packed]) -> None:
        """The places of `values` that are not on the host yet, copied there: of each slab, from the lowest place
        asked to the highest (a flush of a few records copies a few numbers, not the slab's 2¹⁴)."""
        asked: dict[int, tuple[torch.Tensor, int, int]] = {}
        for value in values:
            slab, index = value.values, value.index
            _, low, high = asked.get(id(slab), (slab, index, index))
            asked[id(slab)] = (slab, min(low, index), max(high, index))
        missing: dict[torch.device, list[tuple[int, torch.Tensor, int, int]]] = {}
        for key, (slab, low, high) in asked.items():
            if key in self._spans:
                first, numbers = self._spans[key]
                if first <= low and high < first + len(numbers):
                    continue
                low, high = min(low, first), max(high, first + len(numbers) - 1)  # copied again, wider
            missing.setdefault(slab.device, []).append((key, slab, low, high))
        with torch.no_grad():
            for spans in missing.values():
                host = torch.cat([slab[low : high + 1] for _, slab, low, high in spans]).cpu().tolist()
                start = 0
                for key, _, low, high in spans:
                    self._spans[key] = (low, host[start : start + high - low + 1])
                    start += high - low + 1

    @property
    def copied(self) -> int:
        """How many numbers were copied to the host."""
        return sum(len(numbers) for _, numbers in self._spans.values())

    def number(self, value: Packed) -> float:
        """`value` as copied (`copy` first)."""
        first, numbers = self._spans[id(value.values)]
        return numbers[value.index - first]


SLAB_NUMBERS = 1 << 14
"""Places in one slab (`Slabs`): 128 KiB of float64, about a thousand updates' values at 14 a record."""


class Slabs:
    """Per device, one float64 tensor that update after update is packed into (`pack`) until it is full; then a
    new one. A CPU's heap then holds one block for many updates instead of one (and its tensor's two) for each;
    a slab is freed when the last record packed into it is flushed."""

    def __init__(self, numbers: int | None = None) -> None:
        self.numbers = SLAB_NUMBERS if numbers is None else numbers
        self._open: dict[torch.device, tuple[torch.Tensor, int]] = {}

    def take(self, device: torch.device, count: int) -> tuple[torch.Tensor, int]:
        """`count` consecutive places on `device`: the slab that holds them and the first one's index."""
        slab, used = self._open.get(device, (None, 0))
        if slab is None or used + count > slab.numel():
            slab, used = torch.empty(max(self.numbers, count), dtype=torch.float64, device=device), 0
        self._open[device] = (slab, used + count)
        return slab, used


def pack(holders: Sequence[tuple[Any, str]], slabs: Slabs | None = None) -> None:
    """Replace each one-number tensor held at `holder.name` (a record's value, a probe's result) by its place in a
    float64 tensor of its device (`Packed`), copied there on the device with no sync: into `slabs`, shared by the
    updates packed after each other, else into one tensor of their own.

    Why: a CPU tensor is two small blocks of glibc's heap (the tensor and its storage), and a flush holds
    thousands of them. Held across steps among a training step's large blocks, which glibc trims and faults in
    again every step, they slow the step down measurably (`bench/overhead.py`); one slab shared by many updates
    is a few large blocks. On a GPU the caching allocator keeps its blocks; a slab is also fewer tensors for the
    flush to stack.
    """
    slabs = slabs if slabs is not None else Slabs(numbers=0)
    by_device: dict[torch.device, list[tuple[Any, str, torch.Tensor]]] = {}
    for holder, name in holders:
        value = getattr(holder, name)
        if (
            isinstance(value, torch.Tensor)
            and value.numel() == 1
            and value.dtype in _PACKABLE
            and not value.requires_grad
        ):
            by_device.setdefault(value.device, []).append((holder, name, value))
    with torch.no_grad():
        for device, held in by_device.items():
            if device.type == "mps":
                continue  # no float64 there: the values stay tensors of their own
            slab, start = slabs.take(device, len(held))
            # each converted to float64, written into the slab's places start … start + len(held) − 1
            torch.cat([value.reshape(1) for _, _, value in held], out=slab.narrow(0, start, len(held)))
            for index, (holder, name, _) in enumerate(held, start):
                setattr(holder, name, Packed(slab, index))


def to_host(values: Sequence[Value | Packed], dtype: torch.dtype, packed: PackedHost | None = None) -> list[Any]:
    """One device→host copy per device for a whole column, instead of one per record. Tensors of one
    device, shape and dtype are stacked as they are and converted once (no torch call per value, whose
    overhead dominates a flush of thousands of records). Packed values are read from
    `packed`, the flush's packs on the host, and converted to `dtype` as a tensor of their dtype would be."""
    out: list[Any] = list(values)
    groups: dict[tuple[torch.device, tuple[int, ...], torch.dtype], list[int]] = {}
    in_packs: list[int] = []
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            groups.setdefault((value.device, tuple(value.shape), value.dtype), []).append(index)
        elif isinstance(value, Packed):
            in_packs.append(index)
    with torch.no_grad():
        for indices in groups.values():
            stacked = torch.stack([values[i] for i in indices]).reshape(-1).to(dtype)  # type: ignore[misc]
            for index, host_value in zip(indices, stacked.cpu().tolist()):
                out[index] = host_value
        if in_packs:
            host = packed if packed is not None else PackedHost()
            held = [value for value in values if isinstance(value, Packed)]  # in_packs' values, in order
            host.copy(held)
            numbers = [host.number(value) for value in held]
            # float64 → dtype as the value's own tensor converts: every packed value is exact in float64
            typed = numbers if dtype == torch.float64 else torch.tensor(numbers, dtype=torch.float64).to(dtype).tolist()
            for index, host_value in zip(in_packs, typed):
                out[index] = host_value
    return out


def check_arguments(step: object, micro: object, skipped: object, **values: object) -> tuple[int | None, int | None]:
    """`record()`'s arguments: one number per value, `skipped` a bool or None, and the step and microbatch index as
    the non-negative ints they hold (a numpy or tensor integer too, as `begin_step` takes them), or None."""
    for name, value in values.items():
        check_scalar(name, value)
    if skipped is not None and not isinstance(skipped, bool):
        raise ValueError(f"skipped must be True, False or None, got {skipped!r}")
    return _index("step", step), _index("micro", micro)


def _index(name: str, number: object) -> int | None:
    """The non-negative whole number of 64 bits a step or microbatch index holds (None: None)."""
    if number is None:
        return None
    try:
        whole = operator.index(number)  # type: ignore[arg-type]
    except TypeError:
        whole = -1
    if not 0 <= whole <= INT64_MAX:
        raise ValueError(f"{name} must be a non-negative int, got {number!r}")
    return whole


def check_scalar(name: str, value: object) -> None:
    """One number per value, checked without touching the device: a wrong type costs one record,
    never a shard."""
    if value is None or isinstance(value, bool | float):
        return
    if isinstance(value, int):
        if abs(value) > INT64_MAX:
            raise ValueError(f"{name}={value} does not fit in 64 bits")
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one number, got a tensor of shape {tuple(value.shape)}")
        if value.is_complex():
            raise ValueError(f"{name} must be real, got {value.dtype}")
        return
    if hasattr(value, "item") and getattr(value, "size", 1) == 1 and not isinstance(value, str | bytes):
        if getattr(getattr(value, "dtype", None), "kind", "f") not in "biuf":  # (complex, a date: no number of ours)
            raise ValueError(f"{name} must be a real number, got {value.dtype}")  # type: ignore[attr-defined]
        return  # a numpy scalar
    raise ValueError(f"{name} must be a number or a one-element tensor, got {type(value).__name__}")


def scalar_problem(name: str, value: object) -> str | None:
    """Why `check_scalar` refuses a value (None where it takes it)."""
    try:
        check_scalar(name, value)
    except ValueError as error:
        return str(error)
    return None


def plain(value: object) -> Any:
    """A numpy scalar or one-element array as the Python number it holds (Arrow takes no 0-d array); any other
    value as it is. Called on `check_scalar`'s values."""
    if value is None or isinstance(value, bool | int | float | torch.Tensor):
        return value
    return value.item()  # type: ignore[attr-defined]


def writable_rows(columns: dict[str, Any], probed: list[bool]) -> tuple[list[bool], int]:
    """Rows the auditor accepts, and how many of them had their positions cleared. A row needs a
    count n of 0 to 2³¹ − 1, a loss sum, a backward scalar unless the probe measured the weights, and a
    grad_scale that is not NaN. A T the auditor would refuse the whole file for (negative, not whole, past
    2³¹ − 1, or below n: T counts the positions the n valid tokens are among) is written as null and the
    record kept. Whole floats in integer columns become ints."""
    keep = []
    cleared = 0
    for i in range(len(probed)):
        tokens = _count(columns["valid_tokens"][i])
        ok = tokens is not None
        if ok:
            columns["valid_tokens"][i] = tokens
        ok = ok and columns["loss_sum"][i] is not None
        ok = ok and (columns["backward_scalar"][i] is not None or probed[i])
        scale = columns["grad_scale"][i]
        ok = ok and not (isinstance(scale, float) and math.isnan(scale))
        keep.append(ok)
        positions = columns["positions"][i]
        if positions is not None:
            length = _count(positions)
            usable = length is not None and (tokens is None or length >= tokens)
            columns["positions"][i] = length if usable else None
            cleared += ok and not usable  # a record left out is counted there, not here
    return keep, cleared


def _count(value: Any) -> int | None:
    """A count the auditor reads (an int or a whole float within the log format's bounds of valid_tokens and
    positions, `schema.Column`), as an int; None otherwise."""
    if isinstance(value, float):
        if not value.is_integer():
            return None
        value = int(value)
    return value if value is not None and _COUNT_LOW <= value <= _COUNT_HIGH else None


_COUNT_LOW, _COUNT_HIGH = COLUMNS_BY_NAME["valid_tokens"].low[0], COLUMNS_BY_NAME["valid_tokens"].high[0]  # type: ignore[index]


def ranges(counts: dict[int, int]) -> list[tuple[int, int, int]]:
    """{step: records} as runs of consecutive steps: (first, last, records)."""
    ranges: list[tuple[int, int, int]] = []
    for step in sorted(counts):
        if ranges and ranges[-1][1] == step - 1:
            first, _, records = ranges[-1]
            ranges[-1] = (first, step, records + counts[step])
        else:
            ranges.append((step, step, counts[step]))
    return ranges


def positive(value: object, default: float, name: str, warn: Callable[[str, str], None], whole: bool = False) -> float:
    """A setting that must be a positive number (a whole one of at least 1 where `whole`): `value`, or `default`
    with one warning."""
    fits = (
        (isinstance(value, int) and value >= 1)
        if whole
        else (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0)
    )
    if fits:
        return float(value)  # type: ignore[arg-type]
    kind = "an int of at least 1" if whole else "a positive number of seconds"
    warn(name, f"tokaudit: {name} must be {kind}, got {value!r}; using {default:g}")
    return default
