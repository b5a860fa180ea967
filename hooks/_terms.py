"""Which captured loss calls of one microbatch are one loss term, from their targets alone.

Chunks of one cross-entropy (over disjoint slices of the sequence) read disjoint elements of the
same label storage: one term, whose S, n and probe add up. Where each chunk's labels are a copy
(torchtune's `labels.chunk(k, dim=1)` then `.reshape(-1)`), the logits say it: each chunk's come from
one part of a tensor split along the sequence (`split_origin`). A second head over the same tokens
(an auxiliary loss) or the shifted labels of multi-token prediction read overlapping elements, or
other storage, and no such split: another term. Computed from shapes, strides and the autograd graph
on the host: no device sync.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokaudit.hooks._probe import ProbeResult
from tokaudit.hooks._record import Record

EXACT_LIMIT = 1 << 22
"""Views larger than this whose address ranges overlap are taken as overlapping, not enumerated."""

SPLITS = ("SplitBackward0", "SplitWithSizesBackward0")
"""Autograd nodes of torch.chunk and torch.split: each output is one part of their input."""

GRAPH_DEPTH = 16
"""Nodes walked up from a call's logits to the split they were cut from (views, casts, the output layer)."""


def term_weight(name: str, weight: object) -> float | str | None:
    """λ as `loss_term(name, weight=…)` takes it (None: none declared), or why it cannot: a number (a Python or numpy
    number, a one-element numpy array, a one-element tensor on the CPU: read there with no device sync), finite and
    ≥ 0 (0: the term switched off on purpose, as a warm-up starts, whose tokens the audit then does not judge)."""
    if weight is None:
        return None
    number = _number(weight)
    if number is not None and math.isfinite(number) and number >= 0:
        return number
    if number is not None:
        why = "a weight is finite and ≥ 0"
    elif isinstance(weight, torch.Tensor) and weight.numel() == 1 and weight.device.type != "cpu":
        why = f"a tensor on {weight.device} would cost a device sync at each call: pass λ as a number"
    else:
        why = f"a weight is a number (Python, numpy, or a one-element tensor on the CPU), not {type(weight).__name__}"
    return (
        f"tokaudit: loss_term({name!r}, weight={weight!r}): {why}; this one is left out, and the term is judged as a "
        "token mean"
    )


def _number(weight: object) -> float | None:
    """The real number a weight holds, None where it holds none (a bool is no weight)."""
    if isinstance(weight, bool | np.bool_):
        return None
    if isinstance(weight, numbers.Real):
        return float(weight)
    if isinstance(weight, np.ndarray) and weight.size == 1 and weight.dtype.kind in "iuf":
        return float(weight.reshape(()))
    if (
        isinstance(weight, torch.Tensor)
        and weight.numel() == 1
        and weight.device.type == "cpu"
        and (weight.dtype.is_floating_point or weight.dtype in _INTEGERS)
    ):
        return float(weight.detach().reshape(()))
    return None


_INTEGERS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def split_origin(logits: torch.Tensor) -> tuple[int, int] | None:
    """(the split node, which part) when `logits` come from one part of a tensor split along a dimension other
    than its last (a sequence chunk, not a slice of the classes), through ops with one input that is not a
    parameter (views, casts, the output layer); None otherwise (another head over the same hidden state meets
    an op of two such inputs first). The graph lives on the host: no device sync."""
    node, part = logits.grad_fn, logits.output_nr
    for _ in range(GRAPH_DEPTH):
        if node is None:
            return None
        if type(node).__name__ in SPLITS:
            dim, sizes = int(getattr(node, "_saved_dim")), tuple(getattr(node, "_saved_self_sym_sizes"))
            dim = dim - (1 << 64) if dim >= 1 << 63 else dim  # a negative dim is saved as an unsigned
            return (id(node), int(part)) if sizes and dim % len(sizes) != len(sizes) - 1 else None
        data = [
            (parent, index) for parent, index in node.next_functions if parent is not None and not _parameter(parent)
        ]
        if len(data) != 1:
            return None
        node, part = data[0]
    return None


def _parameter(node: Any) -> bool:
    """A parameter's gradient sink, or reached through a few one-input nodes (a transposed weight), with no split
    on the way (a chunk of a leaf tensor is data)."""
    for _ in range(4):
        name = type(node).__name__
        if name in SPLITS:
            return False
        if name == "AccumulateGrad":
            return True
        parents = [parent for parent, _ in node.next_functions if parent is not None]
        if len(parents) != 1:
            return False
        node = parents[0]
    return False


@dataclass(frozen=True, slots=True)
class Footprint:
    """Where a target tensor's elements live: its storage, offset, sizes and strides."""

    storage: int
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    origin: tuple[int, int] | None = None
    """The split its call's logits are one part of (`split_origin`)."""

    @classmethod
    def of(cls, tensor: torch.Tensor, logits: torch.Tensor | None = None) -> Footprint:
        return cls(
            tensor.untyped_storage().data_ptr(),
            int(tensor.storage_offset()),
            tuple(int(n) for n in tensor.shape),
            tuple(int(s) for s in tensor.stride()),
            None if logits is None else split_origin(logits),
        )

    def _span(self) -> tuple[int, int]:
        # [first, last] element index; strides of views may be 0 or negative only in odd cases
        low = self.offset + sum((n - 1) * s for n, s in zip(self.sizes, self.strides) if s < 0 and n > 0)
        high = self.offset + sum((n - 1) * s for n, s in zip(self.sizes, self.strides) if s > 0 and n > 0)
        return low, high

    def _elements(self) -> np.ndarray:
        index = np.full((1,), self.offset, dtype=np.int64)
        for n, s in zip(self.sizes, self.strides):
            index = (index[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
        return index

    def disjoint(self, other: Footprint) -> bool:
        """True when the two views share no element of one storage, or their logits are two parts of one split
        (chunks of one sequence)."""
        if self.origin is not None and other.origin is not None and self.origin[0] == other.origin[0]:
            return self.origin[1] != other.origin[1]
        if self.storage != other.storage or self.storage == 0:
            return False
        if 0 in self.sizes or 0 in other.sizes:
            return True
        (a_low, a_high), (b_low, b_high) = self._span(), other._span()
        if a_high < b_low or b_high < a_low:
            return True
        if max(np.prod(self.sizes), np.prod(other.sizes)) > EXACT_LIMIT:
            return False
        return not np.intersect1d(self._elements(), other._elements(), assume_unique=False).size


@dataclass(eq=False)
class OpenCall:
    """A captured call of the current microbatch whose backward has not run yet."""

    record: Record
    probe: ProbeResult
    term: str
    named: bool
    footprints: list[Footprint]
    """The targets of every call merged into it (the chunks of one term)."""


class CapturedCalls:
    """The captured calls of the open microbatch, and the numbering of captured records once their backward ran.

    Calls since the last backward belong to one microbatch: a call over slices disjoint from an open record's
    (a chunk) or inside the same `loss_term()` adds into that record; any other call (another head over the
    same tokens, an MTP head) opens the next term."""

    def __init__(self) -> None:
        self.open: list[OpenCall] = []
        self.group = 0
        """Which microbatch's calls a record belongs to (counted since the recorder began)."""
        self._micro: dict[tuple[int, str], int] = {}
        self._fills = 0

    def merged(
        self,
        footprint: Footprint,
        active_term: str | None,
        loss_sum: torch.Tensor,
        valid_tokens: torch.Tensor,
        positions: int,
    ) -> ProbeResult | None:
        """The probe of the open record this call adds into (its S, n and T added), or None: a record of its own."""
        if not self.open or any(c.probe.filled for c in self.open):
            # A backward ran since the open calls: a new microbatch. Calls it never reached (an
            # evaluation with grad) are left behind and never written.
            self.open = []
            self.group += 1
        for call in self.open:
            same = (
                (call.named and call.term == active_term)
                if active_term is not None
                else (not call.named and all(seen.disjoint(footprint) for seen in call.footprints))
            )
            if same:
                record = call.record
                # an open call's update has not closed: its values are still the tensors and count it was given
                assert isinstance(record.loss_sum, torch.Tensor) and isinstance(record.valid_tokens, torch.Tensor)
                assert isinstance(record.positions, int)
                record.loss_sum = record.loss_sum + loss_sum.detach()
                record.valid_tokens = record.valid_tokens + valid_tokens.detach()
                record.positions = record.positions + positions
                call.footprints.append(footprint)  # a later call must miss every chunk, not only the last
                return call.probe
        return None

    def next_term(self, active_term: str | None) -> str:
        """The term of a call that opens a record: the enclosing `loss_term()`, else the next unnamed one."""
        if active_term is not None:
            return active_term
        return str(len({c.term for c in self.open if not c.named}))

    def filled(self, record: Record) -> None:
        """`record`'s backward ran: the order in which backwards ran numbers the microbatches."""
        self._fills += 1
        record.filled_at = self._fills

    def number(self, records: list[Record]) -> None:
        """Final terms and microbatch indices of captured calls, once their backward has run: among
        the calls of one microbatch that reached backward, unnamed terms are numbered in call order
        (an evaluation call with grad in between takes no term), and each term's microbatches in the
        order their backward ran."""
        groups: dict[tuple[int, int], list[Record]] = {}
        for record in records:
            if record.captured and record.micro < 0:
                groups.setdefault((record.step, record.call_group), []).append(record)
        for members in groups.values():
            unnamed = sorted({int(r.term) for r in members if not r.named})
            relabel = {str(t): str(i) for i, t in enumerate(unnamed)}
            for record in members:
                if not record.named:
                    record.term = relabel[record.term]
        for record in sorted((r for m in groups.values() for r in m), key=lambda r: r.filled_at):
            key = (record.step, record.term)
            record.micro = self._micro.get(key, 0)
            self._micro[key] = record.micro + 1
