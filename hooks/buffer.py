"""The records a recorder holds until its next flush: in order, by update, and packed once nothing changes."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tokaudit.hooks.columns import Slabs, Value, pack, significant_bits
from tokaudit.hooks.output import holders


def new_record(*, step: int, micro: int, term: str, loss_sum: Value, valid_tokens: Value, backward_scalar: Value,
               positions: Value, reported_loss: Value, skipped: bool | None, grad_scale: Value, loss_scale: Any,
               prescaled: bool, sync: bool | None, probe: Any, captured: bool, accelerate: Any) -> dict[str, Any]:
    """One record as held until its shard is written, each value a snapshot (`detached`)."""
    record = {
        "step": step, "micro": micro, "term": term,
        "loss_sum": detached(loss_sum), "valid_tokens": detached(valid_tokens),
        "backward_scalar": detached(backward_scalar), "positions": detached(positions),
        "reported_loss": detached(reported_loss), "skipped": skipped, "grad_scale": detached(grad_scale),
        "loss_scale": loss_scale, "prescaled": prescaled, "sync": sync, "time": time.time_ns() // 1000,
        "probe": probe, "captured": captured, "divide": 1, "bits": significant_bits(loss_sum, backward_scalar),
    }
    if accelerate is not None and isinstance(backward_scalar, torch.Tensor):
        # b recorded before accelerator.backward(b) is divided there; recorded after, here.
        record["scalar_ref"] = weakref.ref(backward_scalar)
        record["divide"] = accelerate.divide(backward_scalar)
    return record


def detached(value: Value) -> Value:
    """A snapshot: a device copy of a tensor (no sync), so an accumulator changed in place after
    `record()` is recorded with the value it had then."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def backpropagated(record: dict[str, Any]) -> bool:
    """Its backward has run (a record without a probe needs none)."""
    return record["probe"] is None or bool(record["probe"].filled)


class RecordBuffer:
    """Records (dicts of one backward's values) in the order they were made, and by update."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.unpacked: list[dict[str, Any]] = []
        """Records whose values are still tensors of their own (`pack`)."""
        self.slabs = Slabs()
        """Where the updates' values are packed (`pack`)."""
        self.by_step: dict[int, list[dict[str, Any]]] = {}
        """The records by update, in order: a reported loss or a skip touches one update's records, not the
        thousands a flush holds (a scan of them at every update would cost the training time)."""

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.by_step.setdefault(record["step"], []).append(record)
        self.unpacked.append(record)

    def at(self, step: int) -> list[dict[str, Any]]:
        return self.by_step.get(step, [])

    def move(self, record: dict[str, Any], step: int) -> None:
        """`record` belongs to update `step` after all (its backward had not run when its update was closed)."""
        held = self.by_step[record["step"]]
        held[:] = [r for r in held if r is not record]
        record["step"], record["skipped"] = step, None
        self.by_step.setdefault(step, []).append(record)

    def set_value(self, record: dict[str, Any], name: str, value: Value) -> None:
        """`record[name] = value`, set after the record may have been packed: a tensor set on a packed record
        waits for the next pack (`unpacked`), once, rather than stay a tensor of its own until the flush."""
        if record.get("packed") and isinstance(value, torch.Tensor) and not isinstance(record[name], torch.Tensor):
            self.unpacked.append(record)  # (a tensor already there: the record is waiting already)
        record[name] = value

    def mark_skipped(self, step: int, skipped: bool | torch.Tensor) -> None:
        for record in self.at(step):
            if record["skipped"] is None:
                self.set_value(record, "skipped", skipped)  # a scaler's found_inf is a tensor

    def take(self, ready: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        """The records `ready` accepts, in order, let go of; the others stay."""
        taken: list[dict[str, Any]] = []
        waiting: list[dict[str, Any]] = []
        for record in self.records:
            (taken if ready(record) else waiting).append(record)
        self.records = waiting
        self.by_step = {}
        for record in waiting:
            self.by_step.setdefault(record["step"], []).append(record)
        if self.unpacked:
            kept = {id(record) for record in waiting}
            self.unpacked = [record for record in self.unpacked if id(record) in kept]
        return taken

    def pack(self, open_step: int) -> None:
        """The values of every record whose update has closed (not `open_step`) and whose backward has run,
        packed into the slab of their device (`columns.pack`): nothing of them changes any more, and held as
        tensors of their own they are thousands of small blocks on a CPU's heap. Raises where packing fails;
        the values then stay tensors, and nothing is lost."""
        if not self.unpacked:
            return
        done: list[dict[str, Any]] = []
        waiting: list[dict[str, Any]] = []
        try:
            for record in self.unpacked:
                ready = backpropagated(record) and record["step"] != open_step
                (done if ready else waiting).append(record)
                if ready:
                    record["packed"] = True
            held = [holder for record in done for holder in holders(record)]
            self.unpacked = waiting
            pack(held, self.slabs)
        except Exception:
            self.unpacked = []
            raise
