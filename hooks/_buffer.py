"""The records a recorder holds until its next flush: in order, by update, and packed once nothing changes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokaudit.hooks._columns import Packed, Slabs, Value, pack
from tokaudit.hooks._output import holders
from tokaudit.hooks._record import Record


class RecordBuffer:
    """Records in the order they were made, and by update."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.unpacked: list[Record] = []
        """Records whose values are still tensors of their own (`pack`)."""
        self.slabs = Slabs()
        """Where the updates' values are packed (`pack`)."""
        self.by_step: dict[int, list[Record]] = {}
        """The records by update, in order: a reported loss or a skip touches one update's records, not the
        thousands a flush holds (a scan of them at every update would cost the training time)."""

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: Record) -> None:
        self.records.append(record)
        self.by_step.setdefault(record.step, []).append(record)
        self.unpacked.append(record)

    def at(self, step: int) -> list[Record]:
        return self.by_step.get(step, [])

    def move(self, record: Record, step: int) -> None:
        """`record` belongs to update `step` after all (its backward had not run when its update was closed)."""
        held = self.by_step[record.step]
        held[:] = [r for r in held if r is not record]
        record.step, record.skipped = step, None
        self.by_step.setdefault(step, []).append(record)

    def carry_over(self, records: list[Record], step: int, micro_next: dict[str, int]) -> int:
        """Those of `records` whose backward has not run move to update `step`, numbered on from `micro_next`
        (a trainer that clears the gradients before the first backward); how many moved."""
        moved = 0
        for record in records:
            if not record.backpropagated:
                record.carried_from = (record.step, record.micro)
                self.move(record, step)
                if record.micro >= 0:  # a captured call is numbered when its backward runs
                    record.micro = micro_next.get(record.term, 0)
                    micro_next[record.term] = record.micro + 1
                moved += 1
        return moved

    def set_value(self, record: Record, name: str, value: Value) -> None:
        """`record.name = value`, set after the record may have been packed: a tensor set on a packed record
        waits for the next pack (`unpacked`), once, rather than stay a tensor of its own until the flush."""
        if record.packed and isinstance(value, torch.Tensor) and not isinstance(getattr(record, name), torch.Tensor):
            self.unpacked.append(record)  # (a tensor already there: the record is waiting already)
        setattr(record, name, value)

    def mark_skipped(self, step: int, skipped: bool | torch.Tensor, over: bool = False) -> None:
        """The records of `step` that say nothing of it yet (`over`: all) say whether it was skipped."""
        for record in self.at(step):
            if over or record.skipped is None:
                self.set_value(record, "skipped", skipped)  # a scaler's found_inf is a tensor

    def rescale(self, step: int, factor: Value) -> None:
        """g ← g·factor for every record of update `step` whose backward has run (the gradients it left were
        multiplied by `factor` after backward)."""
        if factor is None:
            return
        for record in self.at(step):
            if record.backpropagated:
                scale = record.grad_scale
                held = scale.tensor() if isinstance(scale, Packed) else scale  # packed only where a step reopened
                self.set_value(record, "grad_scale", factor if held is None else held * factor)

    def take(self, ready: Callable[[Record], bool]) -> list[Record]:
        """The records `ready` accepts, in order, let go of; the others stay."""
        taken: list[Record] = []
        waiting: list[Record] = []
        for record in self.records:
            (taken if ready(record) else waiting).append(record)
        self.records = waiting
        self.by_step = {}
        for record in waiting:
            self.by_step.setdefault(record.step, []).append(record)
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
        done: list[Record] = []
        waiting: list[Record] = []
        try:
            for record in self.unpacked:
                ready = record.backpropagated and record.step != open_step
                (done if ready else waiting).append(record)
                if ready:
                    record.packed = True
            held = [holder for record in done for holder in holders(record)]
            self.unpacked = waiting
            pack(held, self.slabs)
        except Exception:
            self.unpacked = []
            raise
