"""The recorder's updates: which update and microbatch the next record belongs to, and when an update ends."""

from __future__ import annotations

import operator
import warnings
import weakref
from typing import Any

import torch

from tokaudit.hooks._amp import ScalerWatch
from tokaudit.hooks._attach import user_stacklevel, wrap_method
from tokaudit.hooks._buffer import RecordBuffer
from tokaudit.hooks._capture import NOTHING_CAPTURED
from tokaudit.hooks._identity import fsdp1_sync, fsdp2_param_groups, fsdp2_sync
from tokaudit.hooks._terms import CapturedCalls


class UpdateTracking:
    """The part of `Recorder` that follows the updates: told by the trainer (`begin_step`, `end_step`), or seen
    in the optimizer's step and zero_grad and in the GradScaler's update (a skipped update)."""

    _buffer: RecordBuffer
    _calls: CapturedCalls
    _packs_at_zero_grad: bool
    _optimizer: torch.optim.Optimizer | None
    _model: Any
    _scaler: ScalerWatch | None
    _accelerate: Any
    _handles: list[Any]
    _warned: set[str]
    provenance: dict[str, Any]

    def _init_steps(self, grad_scale: float | None) -> None:
        """Where the next record goes: the update and microbatch counters, the open calls and the scale."""
        self._grad_scale = grad_scale
        self._forward_sync: bool | None = None
        self._unforwarded_sync: bool | None = None  # a record's sync where no forward of the model said it
        self._fsdp_groups: list[Any] | None = None  # an FSDP2 model's parameter groups, found at the first record
        self._fsdp1: list[Any] = []  # an FSDP1 model's modules (`_watch_fsdp1_forward`)
        self._step = self._step_records = self._capturing = 0
        self._closed_step: int | None = None
        self._auto_closed: int | None = None
        self._micro_next: dict[str, int] = {}
        self._given: tuple[int | None, dict[str, int]] = (None, {})  # a step given to record() not the open one
        self._unsynced: set[str] = set()  # terms whose last record of the open update did not synchronize
        self._scalars: dict[str, weakref.ref[torch.Tensor]] = {}  # each term's last b of the open update
        self._active_term: str | None = None
        self._term_weights: dict[str, float] = {}  # λ of each term declared with one (`loss_term`)
        self._steps_known = self._optimizer is not None  # else until begin_step/end_step is called
        self._unsynced_in_update = False  # a backward of the open update ran under no_sync()
        # backwards that reached the optimizer's first or last parameter, and how many had when the open update began
        # (`_count_backwards`; None: not counted)
        self._backwards: int | None = None
        self._backwards_at_open = self._backwards_at_close = 0  # (and when zero_grad last closed one as skipped)
        self._other_stepped = False  # another optimizer stepped the model's parameters in the open update
        # per other optimizer (weakly: one made anew each epoch may take a freed one's id): whether it holds a
        # parameter of the model
        self._steps_model: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

    def _numbered(self, term: str, step: int | None, micro: int | None, deferred: bool) -> tuple[int, int]:
        """The update and microbatch of a new record of `term`: those given, else the open update's next."""
        if step is None:
            step = self._step
            if not self._steps_known and self._micro_next.get(term, 0) > 0 and term not in self._unsynced:
                # No step boundaries known: a backward of a term that synchronized gradients (DDP's; every one
                # where that is not known) ended its update, and one under no_sync() accumulates into the next.
                # An update none of whose backwards ran under no_sync() may be a microbatch of accumulation that
                # synchronized each time: a guess the footers say, which the audit cannot tell from its absence.
                if not self._unsynced_in_update:
                    self.provenance["steps_inferred"] = True
                self._advance()
                step = self._step
            self._step_records += 1  # records of the open update: its end may still mark them skipped
        if deferred:
            return step, -1  # a captured call takes its index when its backward runs (an evaluation never does)
        # the open update's microbatches are counted in _micro_next; those of a step given that is not the open
        # one (record(step=s) without begin_step, or a trainer's own numbering) in _given, the last such step's
        following = self._micro_next
        if step != self._step:
            if self._given[0] != step:
                self._given = (step, {})
            following = self._given[1]
        if micro is None:
            micro = following.get(term, 0)
        following[term] = micro + 1
        return step, micro

    def _watch_ddp_forward(self, model: Any) -> None:
        """DDP decides at forward time whether this backward all-reduces, so the flag is read there: in its
        `_pre_forward`, which `model(x)` and `model.forward(x)` both run (a forward pre-hook, where it has none). A
        backward no forward of the wrapper preceded (`model.module(x)`) all-reduces nothing: DDP's hooks expect none."""

        def read(module: Any, *_: Any) -> None:
            self._forward_sync = bool(module.require_backward_grad_sync)

        self._unforwarded_sync = False
        if callable(getattr(model, "_pre_forward", None)):

            def around(original: Any) -> Any:
                def pre_forward(*args: Any, **kwargs: Any) -> Any:
                    read(model)
                    return original(*args, **kwargs)

                return pre_forward

            self._handles.append(wrap_method(model, "_pre_forward", around))
        else:
            self._handles.append(model.register_forward_pre_hook(read))

    def _watch_fsdp1_forward(self, model: Any, modules: list[Any]) -> None:
        """FSDP1's no_sync() is a context its microbatch's forward and backward run in: the flag is read at the
        forward, so a record made after the context is left still says what its backward did."""

        def read(*_: Any) -> None:
            self._forward_sync = fsdp1_sync(modules)

        self._fsdp1 = modules  # (read at a record where no forward of it has run yet)
        self._handles.append(model.register_forward_pre_hook(read))

    def _sync_now(self) -> bool | None:
        """Whether the backward of a record made now synchronizes gradients: as the model's last forward said (DDP
        decides there), else as an FSDP2 model's parameter groups or an FSDP1 model's modules say now (both decide
        at the backward), else as Accelerate says, else False where the model is DDP's and no forward of it ran,
        else not known."""
        if self._forward_sync is not None:
            return self._forward_sync
        if self._fsdp_groups is None:
            self._fsdp_groups = fsdp2_param_groups(self._model) if self._model is not None else []
        if self._fsdp_groups:
            return fsdp2_sync(self._fsdp_groups)
        if self._fsdp1:
            return fsdp1_sync(self._fsdp1)
        return self._accelerate.sync() if self._accelerate is not None else self._unforwarded_sync

    def _recorded_already(self, term: str, scalar: Any) -> bool:
        """Whether `scalar` is the very tensor the term's last record of the open update holds (record() called
        twice for one backward: said once), else remember it as that record's."""
        if not isinstance(scalar, torch.Tensor):
            return False
        last = self._scalars.get(term)
        if last is not None and last() is scalar:
            self.warn_once(
                "recorded-twice",
                f"tokaudit: record() was given the same backward_scalar twice for one backward of term {term!r}; "
                "the second call is left out (one record a backward and term)",
            )
            return True
        self._scalars[term] = weakref.ref(scalar)
        return False

    def note_unfinished(self) -> None:
        """At close() or a terminating signal: records of an update the watched optimizer never stepped (a job
        stopped inside it, a loader that ended inside it) say so in the shards' footers ("unfinished"), and the
        audit does not judge that update on the microbatches it holds. A captured call whose backward never ran
        (numbered at its backward, micro −1 until then: an evaluation with gradients after the last step) is no
        microbatch of it, and never written."""
        held = self._buffer.at(self._step)
        if self._optimizer is not None and any(r.micro >= 0 or r.seen_in_backward for r in held):
            self.provenance["unfinished"] = self._step

    def _note_sync(self, term: str, sync: bool | None) -> None:
        """Whether the record of `term` just made synchronized gradients (`_numbered` reads it for the next)."""
        if sync is False:
            self._unsynced_in_update = True
            self._unsynced.add(term)
        else:
            self._unsynced.discard(term)

    def begin_step(self, step: int) -> None:
        """The next records belong to update `step` (a trainer's global step: a resumed run numbers on)."""
        number = update_number(step)
        if number is None:
            self.warn_once(
                "begin-step",
                f"tokaudit: begin_step({step!r}) is given no update number (a whole number of 64 bits, not negative); the "
                "update it begins is numbered after the last one",
            )
            number = self._step + 1 if self._step_records or self._micro_next else self._step
        self._steps_known = True
        self._auto_closed = None
        if number != self._step:
            self._open(number)
            self._pack()

    def end_step(self, skipped: bool | None = None) -> None:
        """Close the current optimizer update (the optimizer's step hook calls it when one is given).

        `skipped=True` marks this update's records as skipped: by policy (N = 0), or because an
        inf/NaN guard or the GradScaler did not step. With `optimizer=` or `scaler=`, skipped
        updates are found without this call. A skip said alone (a guard that clears the gradients itself) tells
        no other update's end: the recorder goes on reading them as before.
        """
        self._steps_known = self._steps_known or skipped is not True
        if self._auto_closed is not None and not self._step_records:
            # zero_grad or the scaler already closed this skipped update: say it, do not close another.
            if skipped is not None:
                self._buffer.mark_skipped(self._auto_closed, skipped)
            self._auto_closed = None
            return
        if skipped is not None:
            self._buffer.mark_skipped(self._step, skipped)
        self._advance()

    def warn_once(self, key: str, message: str) -> None:  # the integrations warn through it; training goes on
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())

    # ---------------------------------------------------------------- internals: steps

    def _close_skipped(self) -> None:
        closed, self._backwards_at_close = self._step, self._backwards or 0
        self.end_step(skipped=True)
        self._auto_closed = closed

    def _open(self, step: int) -> None:
        """Update `step` is the open one, nothing of it recorded yet."""
        self._step, self._step_records = step, 0
        self._micro_next, self._unsynced, self._scalars = {}, set(), {}
        self._backwards_at_open = self._backwards or 0
        self._other_stepped = False

    def _advance(self) -> None:
        self._auto_closed, self._unsynced_in_update = None, False
        self._open(self._step + 1)
        self._calls.open = []
        if not self._packs_at_zero_grad or len(self._buffer.unpacked) > PACK_AT_ADVANCE:
            self._pack()  # no optimizer's zero_grad to wait for (or one this loop never calls)

    def _pack(self) -> None:
        """Pack what no longer changes (`RecordBuffer.pack`). Called after the optimizer's zero_grad where it
        is watched (the gradients just freed, the heap at its lowest), else when an update closes."""
        try:
            self._buffer.pack(self._step)
        except Exception as error:  # the values stay tensors: nothing is lost
            self.warn_once(
                "pack",
                f"tokaudit: could not pack an update's values ({error!r}); they are kept as "
                "they are, and training goes on",
            )

    def _on_optimizer_step(self) -> None:
        if self._capturing and not self._step_records and "compiled" not in self._warned:  # no capture saw its loss
            self.warn_once("invisible", f"tokaudit: optimizer step {self._step}: {NOTHING_CAPTURED}")
        self._closed_step = self._step
        # the watched optimizer stepped the update its records are in: it was applied (a rank that skips it alone
        # then shows as the ranks disagreeing, skip_mismatch); under a watched scaler, its update() says (a fused
        # optimizer steps through an overflow)
        applied = bool(self._step_records) and self._scaler is None
        if self._auto_closed is not None and not self._step_records:
            # The zero_grad that closed this update as skipped came before a backward this step applies (a tutorial's
            # order, before any backward was counted): it was applied after all. A step on the cleared gradients
            # alone (no backward since) applies nothing. Either way the open update begins after this step.
            if self._scaler is None and (self._backwards or 0) > self._backwards_at_close:
                self._buffer.mark_skipped(self._auto_closed, False, over=True)
            self._backwards_at_open = self._backwards or 0
        self.end_step(skipped=False if applied else None)

    def _on_scaler_update(self, found_inf: torch.Tensor | None) -> None:
        """GradScaler.update(), once per update after step(): a step with records that no
        optimizer step closed was skipped; a fused optimizer steps anyway, and found_inf says it."""
        try:
            if self._step_records:
                self._close_skipped()
            elif self._closed_step is not None and found_inf is not None:
                self._buffer.mark_skipped(self._closed_step, found_inf > 0)
            self._closed_step = None
        except Exception as error:
            self.warn_once("scaler", f"tokaudit: could not read the GradScaler's update ({error!r})")

    def _watch_zero_grad(self, owner: Any) -> None:
        """The optimizer's zero_grad, or the model's: gradients cleared (`_on_zero_grad`)."""

        def around(original: Any) -> Any:
            def zero_grad(*args: Any, **kwargs: Any) -> Any:
                try:
                    self._on_zero_grad()
                except Exception as error:
                    self.warn_once("zero_grad", f"tokaudit: could not follow zero_grad ({error!r})")
                cleared = original(*args, **kwargs)
                self._pack()  # the gradients freed: the heap at its lowest in the step
                return cleared

            return zero_grad

        self._handles.append(wrap_method(owner, "zero_grad", around))  # close() gives it back
        self._packs_at_zero_grad = True

    def _on_zero_grad(self) -> None:
        """Gradients cleared while this update holds backpropagated records and no optimizer step
        closed it: the update was skipped (an inf/NaN guard). Records whose backward is still to
        come (a trainer that clears before the first backward) move to the next update."""
        if not self._step_records:
            return
        current = list(self._buffer.at(self._step))
        # A backward ran in this update: one reached the optimizer's first or last parameter since it began, or one of
        # its records was seen in backward. A b whose hook has not fired says nothing: recorded before its backward
        # (gradients cleared first, as tutorials do) or after it (hooked too late). Until a backward is counted (the
        # hooks may not work for these parameters), a record that cannot tell (a number, no probe) counts.
        counted = (self._backwards or 0) > self._backwards_at_open
        seen = any(r.seen_in_backward for r in current)
        if not (counted or seen or not self._backwards and any(r.seen_in_backward is None for r in current)):
            return
        if self._other_stepped:  # a second optimizer on the model stepped it: applied, by an optimizer not watched
            self.end_step(skipped=None)
            return
        self._close_skipped()
        self._step_records += self._buffer.carry_over(current, self._step, self._micro_next)

    def _hook_optimizer(self) -> None:
        if self._optimizer is None:
            return
        try:
            self._handles.append(self._optimizer.register_step_post_hook(lambda *_: self._on_optimizer_step()))
        except Exception:
            self._optimizer = None
            self._steps_known = False
            raise
        self._watch_zero_grad(self._optimizer)
        if callable(getattr(self._model, "zero_grad", None)):  # gradients cleared through the model (a guard's skip)
            self._watch_zero_grad(self._model)
            self._watch_other_optimizers()
        self._count_backwards(self._optimizer)

    def _watch_other_optimizers(self) -> None:
        """Every optimizer's step (torch's global hook): one other than the watched that steps a parameter of the model
        (a second optimizer on one model, as a GAN-like loop or a split learning rate has) applies the update whose
        gradients the model's zero_grad then clears, which would otherwise read as skipped."""
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._handles.append(register_optimizer_step_post_hook(self._on_any_step))
        except Exception:  # an older torch: a second optimizer's updates read as skipped
            pass

    def _on_any_step(self, optimizer: Any, *_: Any) -> None:
        # only a step of the open update's gradients: one after the watched step closed it (optA.step(); optB.step()),
        # or before its first record (a GAN's other phase), steps none of them
        if optimizer is self._optimizer or not self._step_records:
            return
        try:
            steps_model = self._steps_model.get(optimizer)
            if steps_model is None:
                mine = {id(p) for p in self._model.parameters()}
                steps_model = any(id(p) in mine for group in optimizer.param_groups for p in group["params"])
                self._steps_model[optimizer] = steps_model
            self._other_stepped = self._other_stepped or steps_model
        except Exception as error:
            self.warn_once("other-optimizer", f"tokaudit: could not follow another optimizer's step ({error!r})")

    def _count_backwards(self, optimizer: torch.optim.Optimizer) -> None:
        """Count the backwards that reach the optimizer's first or last parameter (a hook after each accumulates its
        gradient: two calls a backward, no sync); where that cannot be hooked, none are counted."""
        trained = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        try:
            for parameter in {id(p): p for p in trained[:1] + trained[-1:]}.values():
                self._handles.append(parameter.register_post_accumulate_grad_hook(lambda _: self._saw_backward()))
            self._backwards = 0 if trained else None
        except Exception:  # a parameter type without the hook: the records' own evidence decides
            self._backwards = None

    def _saw_backward(self) -> None:
        if self._backwards is not None:
            self._backwards += 1

    def _hook_scaler(self, scaler: Any) -> None:
        self._scaler = None if scaler is None else ScalerWatch(scaler, self._on_scaler_update)


def update_number(step: Any) -> int | None:
    """A step as begin_step takes it: an int, or a number that is one (2.0, a numpy or tensor integer); None for
    what is no whole number, a negative one, or one past 64 bits."""
    number: int | None
    try:
        number = int(step) if isinstance(step, float) and step.is_integer() else operator.index(step)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        try:  # a numpy float or a one-element float tensor that holds a whole number
            value = float(step)
            number = int(value) if value.is_integer() else None
        except (TypeError, ValueError, RuntimeError, OverflowError):
            number = None
    return number if number is not None and 0 <= number < 1 << 63 else None  # (a step is an int64)


PACK_AT_ADVANCE = 64
"""Records left unpacked after which an update's close packs them, where zero_grad is watched but not called."""
