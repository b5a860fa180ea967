"""One record as the recorder holds it until its shard is written."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from tokaudit.hooks._columns import Packed, Value, significant_bits
from tokaudit.hooks._probe import ProbeResult

Held = Value | Packed
"""A value as held: a snapshot (a number or a tensor) until its update closes, then its place in a pack."""


@dataclass(eq=False, slots=True)
class Record:
    """One backward's values (`Recorder.record`). The numbers may be device tensors until the shard is written:
    recording never synchronizes the device."""

    step: int
    micro: int
    """The microbatch; −1 for a captured call, numbered when its backward runs (`terms.CapturedCalls.number`)."""
    term: str
    loss_sum: Held
    valid_tokens: Held
    backward_scalar: Held
    positions: Held
    reported_loss: Held
    skipped: Held
    grad_scale: Held
    loss_scale: Held
    """A GradScaler's scale when b was made (divided out of the weights when written)."""
    prescaled: bool
    """b is the scaled scalar already (`scaler.scale(loss)` recorded)."""
    sync: bool | None
    time: int
    """Microseconds since the epoch."""
    probe: ProbeResult | None
    captured: bool
    bits: int | None
    """The fewest significant bits of S and b (`significant_bits`)."""
    divide: int = 1
    """What accelerator.backward divided b by after it was recorded (its accumulation steps)."""
    scalar_ref: weakref.ref[torch.Tensor] | None = None
    """b itself, for an Accelerate adapter to see whether b is what went through accelerator.backward."""
    packed: bool = False
    call_group: int = -1
    """A captured call's microbatch of calls (`terms.CapturedCalls.group`)."""
    named: bool = False
    """A captured call inside `loss_term()`."""
    filled_at: int = -1
    """A captured call: the order in which its backward ran."""
    trained: bool | None = None
    """Whether a gradient has flowed through b (a hook on it); None where b is no tensor that requires grad."""
    term_weight: float | None = None
    """λ, the weight its term was declared with (`Recorder.loss_term(name, weight=λ)`); None: not declared."""
    carried_from: tuple[int, int] | None = None
    """The (update, microbatch) it was made in, where that update closed skipped before its backward ran and it
    moved to the next (`RecordBuffer.carry_over`): where it never trains, it goes back there."""

    @property
    def backpropagated(self) -> bool:
        """Its backward has run (a record without a probe needs none)."""
        return self.probe is None or bool(self.probe.filled)

    @property
    def seen_in_backward(self) -> bool | None:
        """A gradient flowed through b or its probe; None where neither can tell."""
        if self.trained is None and self.probe is None:
            return None
        return bool(self.trained) or (self.probe is not None and bool(self.probe.filled))


def new_record(
    *,
    step: int,
    micro: int,
    term: str,
    loss_sum: Value,
    valid_tokens: Value,
    backward_scalar: Value,
    positions: Value,
    reported_loss: Value,
    skipped: bool | None,
    grad_scale: Value,
    loss_scale: Any,
    prescaled: bool,
    sync: bool | None,
    probe: ProbeResult | None,
    captured: bool,
    accelerate: Any,
) -> Record:
    """A record whose values are snapshots (`detached`)."""
    record = Record(
        step=step,
        micro=micro,
        term=term,
        loss_sum=detached(loss_sum),
        valid_tokens=detached(valid_tokens),
        backward_scalar=detached(backward_scalar),
        positions=detached(positions),
        reported_loss=detached(reported_loss),
        skipped=skipped,
        grad_scale=detached(grad_scale),
        loss_scale=loss_scale,
        prescaled=prescaled,
        sync=sync,
        time=time.time_ns() // 1000,
        probe=probe,
        captured=captured,
        bits=significant_bits(loss_sum, backward_scalar),
    )
    if isinstance(backward_scalar, torch.Tensor) and backward_scalar.requires_grad:
        record.trained = False
        backward_scalar.register_hook(_seen(record))  # type: ignore[no-untyped-call]
    elif probe is None and not torch.is_grad_enabled():
        # made under no_grad (an evaluation in the loop): no gradient flows through b, and one that is a copy of a
        # trained loss logged there is kept with its update's others, as long as none of them was seen either
        record.trained = False
    if accelerate is not None and isinstance(backward_scalar, torch.Tensor):
        # b recorded before accelerator.backward(b) is divided there; recorded after, here.
        record.scalar_ref = weakref.ref(backward_scalar)
        record.divide = accelerate.divide(backward_scalar)
    return record


UNTRAINED = (
    "tokaudit: a record of step {step} never went through backward while the update's others did (a loss "
    "computed with gradients and recorded, never trained on: an evaluation inside the loop, a pipeline "
    "schedule's shape inference); such records are left out of the log, as they are of the update"
)


def _seen(record: Record) -> Any:
    def hook(grad: torch.Tensor) -> None:
        record.trained = True

    return hook


def never_trained(records: list[Record]) -> tuple[list[Record], list[Record]]:
    """(kept, left out): a record that never went through backward, in an update where another of its term did (a
    loss computed with gradients and recorded, never trained on: an evaluation inside the loop, a pipeline schedule's
    shape inference), is no microbatch of it; one carried out of a skipped update goes back there, kept. Where no
    record of the update's term can tell, or none was seen, all stay: a b recorded as a second copy of the loss that
    was trained on (after backward, under no_grad) is never seen itself."""
    seen = {(record.step, record.term) for record in records if record.seen_in_backward}
    left_out = [r for r in records if r.seen_in_backward is False and (r.step, r.term) in seen]
    for record in left_out:
        # moved out of an update that closed skipped before its backward ran (`RecordBuffer.carry_over`), and never
        # trained in the next: the skipped update's (a batch dropped on an error between record() and backward())
        if record.carried_from is not None:
            (record.step, record.micro), record.skipped = record.carried_from, True
    left_out = [record for record in left_out if record.carried_from is None]
    if not left_out:
        return records, []
    dropped = {id(record) for record in left_out}
    return [record for record in records if id(record) not in dropped], left_out


def detached(value: Value) -> Value:
    """A snapshot: a device copy of a tensor (no sync), so an accumulator changed in place after
    `record()` is recorded with the value it had then."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
