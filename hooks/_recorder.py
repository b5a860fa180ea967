"""Recorder: per-rank, per-microbatch, per-term records of S, n, b, W, D, g, sync and step, written to Parquet shards."""

from __future__ import annotations

import atexit
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from tokaudit.hooks._attach import AccelerateWatch, from_accelerator, torch_optimizer, version_of
from tokaudit.hooks._buffer import RecordBuffer
from tokaudit.hooks._record import UNTRAINED, Record, detached, never_trained, new_record
from tokaudit.hooks._columns import Value, check_arguments, check_scalar, plain, positive, scalar_problem
from tokaudit.hooks._identity import Placement, fsdp1_modules
from tokaudit.hooks._output import ShardOutput, Stamp
from tokaudit.hooks._capture import capture_cross_entropy, probe_into
from tokaudit.hooks._pipeline import watch_schedule
from tokaudit.hooks._probe import ProbeResult, Recomputations, in_backward, unprobed
from tokaudit.hooks._signals import made_here, on_termination, run_deferred
from tokaudit.hooks._terms import CapturedCalls, Footprint, OpenCall, term_weight
from tokaudit.hooks._recorder_steps import UpdateTracking
from tokaudit.hooks.trackers import AuditLoop, announcing, start_line

DEFAULT_FLUSH_EVERY = 4096
DEFAULT_FLUSH_SECONDS = 60.0


class Recorder(UpdateTracking):
    """Records what decides the token-loss objective, per rank and per microbatch (docs/recording.md): per
    microbatch `rec.probe(per_token_loss, valid)` then `rec.record(loss_sum=, valid_tokens=, backward_scalar=)`.

    Nothing here calls a collective or synchronizes the device: values stay tensors until a
    shard is flushed. A failure warns once and training goes on.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        run_id: str | None = None,
        model: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        group: Any = None,
        grad_divisor: float | None = None,
        grad_scale: float | None = None,
        scaler: Any = None,
        flush_every: int = DEFAULT_FLUSH_EVERY,
        accelerator: Any = None,
        trackers: Any = None,
        audit_every: int | None = None,
        announce: bool = True,
        schedule: Any = None,
        flush_seconds: float | None = DEFAULT_FLUSH_SECONDS,
    ) -> None:
        self._closed = False
        self._paused = 0
        self.flushing = False  # a flush is writing (a signal handler then waits for it instead of starting another)
        self._warned: set[str] = set()
        self._init_buffer()
        self._capture: AbstractContextManager[None] | None = None
        self._handles: list[Any] = []
        self._init_flushes(flush_every, flush_seconds)
        model, optimizer, scaler = from_accelerator(accelerator, model, optimizer, scaler)
        self._accelerator = accelerator
        self._accelerate: AccelerateWatch | None = None
        self._model = model
        self._optimizer = torch_optimizer(optimizer)
        if optimizer is not None and self._optimizer is None:
            self.warn_once(
                "optimizer",
                f"tokaudit: cannot hook the optimizer {type(optimizer).__name__} (no "
                "torch.optim.Optimizer inside it); every backward is recorded as its own "
                "update unless you call rec.begin_step()/rec.end_step()",
            )
        self._init_steps(grad_scale)
        self._scaler = None
        announce = announcing(announce)  # global rank 0 says where the shards go, and the verdict at close()
        self._init_output(log_dir, run_id, group, model, grad_divisor, announce)
        if accelerator is not None:
            self.provenance.update(trainer="accelerate", trainer_version=version_of("accelerate"))
        # Global rank 0 audits the run for experiment trackers in a background thread (tokaudit.hooks.trackers).
        self._audits = AuditLoop.create(
            self.log_dir, self.run_id, trackers, audit_every, accelerator, self.warn_once, announce
        )
        self._attach(scaler, schedule)
        atexit.register(self._close_at_exit)
        on_termination(self)

    def _init_flushes(self, flush_every: int, flush_seconds: float | None) -> None:
        """When a shard is written: every `flush_every` records, and every `flush_seconds` while records wait."""
        self._flush_every = int(positive(flush_every, DEFAULT_FLUSH_EVERY, "flush_every", self.warn_once, whole=True))
        # A shard at least every flush_seconds while records wait, so that a live audit sees the run (None: never).
        self._flush_seconds = (
            None
            if flush_seconds is None
            else positive(flush_seconds, DEFAULT_FLUSH_SECONDS, "flush_seconds", self.warn_once)
        )
        self._flush_due = math.inf if self._flush_seconds is None else time.monotonic() + self._flush_seconds

    def _init_output(
        self,
        log_dir: str | os.PathLike[str],
        run_id: str | None,
        group: Any,
        model: Any,
        grad_divisor: float | None,
        announce: bool,
    ) -> None:
        """Where the shards go, and who writes them: the rank, W and D, read at the first record."""
        self._output = ShardOutput(log_dir, run_id, self._flush_every, self.warn_once)
        self._placement = Placement(
            group,
            model,
            grad_divisor,
            self.warn_once,
            start_line(self._output.log_dir, self._output.run_id) if announce else None,
        )
        self._closed = self._closed or not self._output.usable
        self._closed_here = False  # by close(): a record after it is said
        self.log_dir: Path | str = self._output.log_dir
        """Where the shards go: a local folder, or a URL on object storage (s3://bucket/runs/exp1)."""
        self.run_id: str = self._output.run_id
        self.provenance = self._output.provenance  # in every shard's footer; integrations name their trainer

    def _attach(self, scaler: Any, schedule: Any) -> None:
        """Hook the model, the optimizer, the GradScaler, the accelerator and the pipeline schedule."""
        # Nothing the recorder cannot hook stops the training: each hook that fails warns and the
        # recording goes on without it.
        for name, attach in (
            ("model", self._hook_model),
            ("optimizer", self._hook_optimizer),
            ("scaler", lambda: self._hook_scaler(scaler)),
            ("accelerator", self._hook_accelerator),
            ("pipeline schedule", lambda: self._handles.extend(watch_schedule(self, schedule))),
        ):
            try:
                attach()
            except Exception as error:
                self.warn_once(
                    f"hook-{name}", f"tokaudit: cannot hook the {name} ({error!r}); recording goes on without it"
                )

    def _init_buffer(self) -> None:
        """The records held until the next flush, and where their values are packed."""
        self._buffer = RecordBuffer()
        self._packs_at_zero_grad = False  # the optimizer's zero_grad is watched: packing waits for it (grads freed)
        self._pending_probes: dict[str | None, ProbeResult] = {}  # by the loss_term() block they were made in
        self._calls = CapturedCalls()
        self._recomputed = Recomputations()

    @property
    def rank(self) -> int:
        """Rank inside the averaging group (read at the first record, so after init_process_group)."""
        return self._placement.who().rank

    @property
    def world_size(self) -> int:
        """W: the size of the averaging group."""
        return self._placement.who().world_size

    @property
    def group(self) -> str:
        """Id of the averaging group ("0": the whole world)."""
        return self._placement.who().group

    @property
    def grad_divisor(self) -> float | None:
        """D, what the group's gradient reduction divides by: given, or seen at the first record (None before,
        and where it cannot be seen)."""
        return self._placement.grad_divisor

    # ---------------------------------------------------------------- public API

    def probe(self, per_token_loss: torch.Tensor, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Return `per_token_loss` unchanged; backward records ∂b/∂ℓᵢ for this microbatch's record."""
        if self._closed or self._paused:
            return per_token_loss
        if (unmeasured := unprobed(per_token_loss)) is not None:
            self.warn_once(*unmeasured)
            return per_token_loss
        if not per_token_loss.requires_grad or in_backward():  # activation checkpointing (`Recomputations`)
            result = self._recomputed.result(per_token_loss.requires_grad)
            return per_token_loss if result is None else probe_into(self, per_token_loss, valid_mask, result)
        self._recomputed.asked = False
        # a probe goes to the next record of its loss_term() block; one outside any block, to the next record
        pending = self._pending_probes.setdefault(self._active_term, ProbeResult())
        return probe_into(self, per_token_loss, valid_mask, pending)

    def record(
        self,
        loss_sum: Value,
        valid_tokens: Value,
        backward_scalar: Value,
        step: int | None = None,
        micro: int | None = None,
        positions: Value = None,
        reported_loss: Value = None,
        skipped: bool | None = None,
        grad_scale: Value = None,
        term: str | None = None,
        _captured: bool = False,
    ) -> None:
        """Store one backward pass of one loss term. Tensors are kept (detached) until the next flush.

        `term` names the loss term when a microbatch's objective has several (an auxiliary head,
        the heads of multi-token prediction), each its own token mean; default "0", or the name
        of an enclosing `loss_term()`. Under a GradScaler, `backward_scalar` is the loss before
        `scaler.scale()` (or the scaled tensor itself): the log holds b = scale·loss, g = 1/scale.
        """
        if self._closed or self._paused:
            if self._closed_here:
                self.warn_once("closed", "tokaudit: record() after close(): the recorder writes no more records")
            return
        self._audit_if_due(step)
        try:
            self._placement.resolve(self._model, lambda: self._accelerate is not None and self._accelerate.wraps_ddp())
            term = str(term) if term is not None else (self._active_term or "0")
            # the probe made for it: in its loss_term() block, else outside any block (dropped with it on an error)
            probe = self._pending_probes.pop(term, None) or self._pending_probes.pop(None, None)
            values: dict[str, Value] = dict(
                loss_sum=loss_sum,
                valid_tokens=valid_tokens,
                backward_scalar=backward_scalar,
                positions=positions,
                reported_loss=reported_loss,
                grad_scale=grad_scale,
            )
            step, micro = check_arguments(step, micro, skipped, **values)
            values = {name: plain(value) for name, value in values.items()}
            if step is None and self._recorded_already(term, backward_scalar):
                return
            deferred = micro is None and _captured and probe is not None
            step, micro = self._numbered(term, step, micro, deferred)
            entry = self._entry(step, micro, term, skipped, probe, _captured, **values)
            entry.term_weight = self._term_weights.get(term)
            self._note_sync(term, entry.sync)
            self._hold(entry, probe, deferred)
        except Exception as error:
            self._output.note_dropped(step if isinstance(step, int) else self._step, 1)
            self.warn_once(
                "record",
                f"tokaudit: a record was dropped ({error}); it is noted in the log as a "
                "dropped record, and training goes on",
            )

    def _audit_if_due(self, step: int | None) -> None:
        """Start rank 0's audit for the trackers where one is due at this record."""
        if self._audits is not None:
            at = step if isinstance(step, int) else self._step
            if self._audits.due(at):
                self.flush(wait_for_backward=True)  # every rank: the audit reads the steps before this one whole
                self._audits.start(at)

    def _entry(
        self,
        step: int,
        micro: int,
        term: str,
        skipped: bool | None,
        probe: ProbeResult | None,
        captured: bool,
        *,
        loss_sum: Value,
        valid_tokens: Value,
        backward_scalar: Value,
        positions: Value,
        reported_loss: Value,
        grad_scale: Value,
    ) -> Record:
        """One record as held until its shard is written: each value a snapshot, the loss scale and sync now."""
        scaler = self._scaler if self._scaler is not None and self._scaler.enabled() else None
        sync = self._sync_now()
        return new_record(
            step=step,
            micro=micro,
            term=term,
            loss_sum=loss_sum,
            valid_tokens=valid_tokens,
            backward_scalar=backward_scalar,
            positions=positions,
            reported_loss=reported_loss,
            skipped=skipped,
            grad_scale=grad_scale if grad_scale is not None else self._grad_scale,
            loss_scale=scaler.current() if scaler is not None else None,
            prescaled=scaler is not None and scaler.is_scaled(backward_scalar),
            sync=sync,
            probe=probe,
            captured=captured,
            accelerate=self._accelerate,
        )

    def _hold(self, entry: Record, probe: ProbeResult | None, deferred: bool) -> None:
        """Buffer `entry` until its shard is written, and write one when it is due."""
        if deferred:
            assert probe is not None
            entry.call_group, entry.named = self._calls.group, self._active_term is not None
            probe.on_fill = lambda: self._calls.filled(entry)
        self._buffer.add(entry)
        self._recomputed.recorded(entry)
        if self._scaler is not None and self._scaler.enabled() and entry.loss_scale is None:
            self._scaler.await_scale(entry)  # before the scaler's first scale(): filled then
        if len(self._buffer) >= self._flush_every or time.monotonic() >= self._flush_due:
            self.flush(wait_for_backward=True)

    @contextmanager
    def loss_term(self, name: str, weight: object = None) -> Iterator[None]:
        """Records, probes and captured calls inside belong to loss term `name` (an auxiliary head,
        MTP head k): each term is audited as its own token mean. `weight`: λ, the coefficient the objective
        gives the term on purpose (L = ΣS/N + λ·ΣS_aux/N_aux): its tokens are judged against λ/N, and every
        record of the term from now on carries it (a number, `term_weight`: a changed λ holds from the next record)."""
        if isinstance(taken := term_weight(name, weight), str):
            self.warn_once("term-weight", taken)
        elif taken is not None:
            self._term_weights[str(name)] = taken
        previous, self._active_term = self._active_term, str(name)
        try:
            yield
        finally:
            self._active_term = previous

    @contextmanager
    def capture_cross_entropy(self) -> Iterator[None]:
        """While active, every cross-entropy call with grad (F.cross_entropy, nn.CrossEntropyLoss)
        is recorded with its probe; it returns exactly what it would have. See `tokaudit.hooks._capture`."""
        self._capturing += 1
        try:
            with capture_cross_entropy(self):
                yield
        finally:
            self._capturing -= 1

    def captured_call(
        self, footprint: Footprint, loss_sum: torch.Tensor, valid_tokens: torch.Tensor, positions: int
    ) -> ProbeResult:
        """One captured cross-entropy call (`tokaudit.hooks._capture`): added to an open record of its microbatch
        (`CapturedCalls.merged`), or a record of its own; the probe its backward fills."""
        if self._paused:
            return ProbeResult()  # filled or not, never written
        merged = self._calls.merged(footprint, self._active_term, loss_sum, valid_tokens, positions)
        if merged is not None:
            return merged
        term = self._calls.next_term(self._active_term)
        probe = self._pending_probes[term] = ProbeResult()
        self.record(
            loss_sum=loss_sum,
            valid_tokens=valid_tokens,
            backward_scalar=None,
            positions=positions,
            term=term,
            _captured=True,
        )
        records = self._buffer.records
        if records and records[-1].probe is probe:
            self._calls.open.append(OpenCall(records[-1], probe, term, self._active_term is not None, [footprint]))
        return probe

    def start_capture(self) -> None:
        """`capture_cross_entropy()` without a `with` block: active until `close()` (trainer callbacks)."""
        if self._capture is None:
            self._capture = self.capture_cross_entropy()
            self._capture.__enter__()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing inside is recorded: a loss of no update (a pipeline schedule's shape inference, an evaluation)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def scale_grads(self, factor: Value) -> None:
        """Gradients multiplied by `factor` after backward (torchtune's `training.scale_grads`, a pipeline schedule's,
        `p.grad.mul_`; not clipping): each backpropagated token of the open update now weighs ∂b/∂ℓᵢ·g·factor."""
        try:
            check_scalar("factor", factor)
            if isinstance(number := plain(factor), float) and not math.isfinite(number):
                raise ValueError(f"factor {number} is no finite number")
            self._buffer.rescale(self._step, detached(number))
        except Exception as error:
            said = (
                f"tokaudit: could not record a gradient rescale ({error!r}); its update's weights are judged without it"
            )
            self.warn_once("scale_grads", said)

    def next_microbatch(self) -> None:
        """The next captured call opens a microbatch, whatever came before it (a pipeline schedule's loss_fn)."""
        self._calls.open = []

    def report_loss(self, value: Value, step: int | None = None) -> None:
        """The loss the trainer reported for `step`, stamped on its buffered records as `reported_loss`.
        Default: the update under way when it holds records already (a loss logged after backward, before
        `optimizer.step()`), else the update just closed (logged after the step)."""
        if step is None:
            step = self._step if self._buffer.at(self._step) else self._step - 1
        if (problem := scalar_problem("reported loss", value)) is not None:
            return self.warn_once("report_loss", f"tokaudit: report_loss() left out ({problem}); the records keep none")
        snapshot = detached(plain(value))  # one copy for the update's records
        for record in self._buffer.at(step):
            self._buffer.set_value(record, "reported_loss", snapshot)

    def flush(self, wait_for_backward: bool = False) -> None:
        """Write buffered records to a new shard. With `wait_for_backward` (the automatic flush), the current
        update's records and those whose probe has not yet seen its backward stay buffered for the next shard."""
        if self.flushing or (not self._buffer.records and not self._output.backlog) or not made_here(self):
            return  # (a forked child's copy of the records is the parent's to write)
        self.flushing = True
        if self._flush_seconds is not None:
            self._flush_due = time.monotonic() + self._flush_seconds
        try:
            self._flush(wait_for_backward)
        finally:
            self.flushing = False
            run_deferred()  # a SIGTERM that arrived meanwhile acts now, on whole shards

    def _flush(self, wait_for_backward: bool) -> None:
        def still_open(record: Record) -> bool:
            return self._step_records > 0 and record.step == self._step

        if wait_for_backward and len(self._buffer) < 2 * self._flush_every:
            # the open update's records and those whose backward is still to come wait for the next shard
            ready = self._buffer.take(lambda record: record.backpropagated and not still_open(record))
        elif wait_for_backward:
            # past twice a shard: every closed update goes, its backwards run or not; the open update's records
            # wait still (a microbatch recorded before its backward is no record that never trained)
            ready = self._buffer.take(lambda record: not still_open(record))
        else:
            ready = self._buffer.take(lambda record: True)
        # A captured loss that never reached backward (computed with grad, then unused) is no record.
        ready, untrained = never_trained([r for r in ready if not (r.captured and not r.backpropagated)])
        if untrained:
            self.warn_once("untrained", UNTRAINED.format(step=untrained[0].step))
        self._calls.number(ready)
        if not ready and not self._output.backlog:
            return
        stamp = self._stamp()
        if ready:
            self._output.add(ready, stamp)
        self._output.write(stamp)

    def close(self) -> None:
        """Stop a started capture, flush everything and detach the hooks. Safe to call twice. Called by the training
        code (not at exit, nor while an error is in flight: a `finally`), it is a deliberate end, which the last
        shard's footer says ("closed"): a rank whose records end before the others' is then missing, not killed."""
        self._close(deliberate=sys.exc_info()[0] in (None, StopIteration, StopAsyncIteration))  # data ran out: no error

    def _close_at_exit(self) -> None:
        self._close(deliberate=False)

    def _close(self, deliberate: bool) -> None:
        if self._closed or not made_here(self):  # a forked child's copy of the records is the parent's to write
            return
        if deliberate:
            self.provenance["closed"] = True
        self.note_unfinished()  # the update under way, if any, is never stepped now
        if self._capture is not None:
            self._capture.__exit__(None, None, None)
            self._capture = None
        self.flush()
        self._output.close()  # the last upload tried whatever failed before; what is left unwritten is said
        self._closed = self._closed_here = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._scaler is not None:
            self._scaler.close()
        atexit.unregister(self._close_at_exit)
        if self._audits is not None:
            self._audits.close()  # rank 0: the final audit, logged to the trackers (a bounded wait)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        self._close(deliberate=kind is None)

    # ---------------------------------------------------------------- internals: identity, shards
    def _hook_model(self) -> None:
        if self._model is not None and hasattr(self._model, "require_backward_grad_sync"):
            self._watch_ddp_forward(self._model)
        elif self._model is not None and (modules := fsdp1_modules(self._model)):
            self._watch_fsdp1_forward(self._model, modules)

    def _hook_accelerator(self) -> None:
        if self._accelerator is not None:
            self._accelerate = AccelerateWatch(self._accelerator, lambda: self._buffer.at(self._step), self.warn_once)
            self._handles.append(self._accelerate.handle)

    def probe_failed(self, error: BaseException) -> None:  # a probe's backward failed: the captures say so here
        self.warn_once("probe-backward", f"tokaudit: probe could not read a backward ({error!r})")

    def _stamp(self) -> Stamp:
        who, placement = self._placement.who(), self._placement
        return Stamp(who.rank, who.world_size, who.group, self.run_id, placement.grad_divisor, placement.divisor_known)
