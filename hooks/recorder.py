"""Recorder: per-rank, per-microbatch, per-term records of S, n, b, W, D, g, sync and step, written to Parquet shards."""

from __future__ import annotations

import atexit
import os
import re
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from tokaudit.hooks.amp import ScalerWatch
from tokaudit.hooks.columns import (INT64_MAX, Packed, PackedHost, Slabs, Value, check_scalar, held_value, pack, ranges,
                                    to_host, writable_rows)
from tokaudit.hooks.identity import Identity, fsdp2_divisor, known_hook_divisor, resolve_identity
from tokaudit.hooks.probe import ProbeResult, TokenProbe
from tokaudit.hooks.shards import ShardWriter, StoreShardWriter
from tokaudit.hooks.signals import on_termination, run_deferred
from tokaudit.hooks.terms import Footprint
from tokaudit.hooks.trackers import AuditLoop
from tokaudit.schema import SCHEMA_VERSION, WRITER_SCHEMA, dropped_metadata
from tokaudit.storage import is_url

DEFAULT_FLUSH_EVERY = 4096
STORE_RETRY_S = 30.0
"""After a failed write to object storage, the next attempt waits this long (or for close())."""
BACKLOG_SHARDS = 8
"""Shards' worth of records kept in memory while writes fail (a full disk); older ones are dropped
and written down as dropped steps in the next shard that can be written."""


class Recorder:
    """Records what decides the token-loss objective, per rank and per microbatch.

    Typical use, one microbatch::

        per_token = rec.probe(per_token_loss, labels != -100)
        loss_sum = per_token[valid].sum()
        b = world_size * loss_sum / global_tokens
        rec.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=b)
        b.backward()

    Nothing here calls a collective or synchronizes the device: values stay tensors until a
    shard is flushed. A failure warns once and training goes on.
    """

    def __init__(self, log_dir: str | os.PathLike[str], run_id: str | None = None, model: Any = None,
                 optimizer: torch.optim.Optimizer | None = None, group: Any = None,
                 grad_divisor: float | None = None, grad_scale: float | None = None, scaler: Any = None,
                 flush_every: int = DEFAULT_FLUSH_EVERY, accelerator: Any = None, trackers: Any = None,
                 audit_every: int | None = None) -> None:
        self._closed = False
        self.flushing = False
        """A flush is writing (a signal handler then waits for it instead of starting another)."""
        self._warned: set[str] = set()
        self._records: list[dict[str, Any]] = []
        self._unpacked: list[dict[str, Any]] = []
        """Records whose values are still tensors of their own (`_pack`)."""
        self._slabs = Slabs()
        """Where the updates' values are packed (`_pack`)."""
        self._by_step: dict[int, list[dict[str, Any]]] = {}
        """The buffered records by step, in order: a reported loss or a skip touches one update's records, not
        the thousands a flush holds (a scan of 4,096 records is about 0.2 ms, at every update)."""
        self._packs_at_zero_grad = False
        """The optimizer's zero_grad is watched: packing waits for it (the gradients freed)."""
        self._pending_probe: ProbeResult | None = None
        self._capture: AbstractContextManager[None] | None = None
        self._open_calls: list[_OpenCall] = []
        self._handles: list[Any] = []
        self._flush_every = DEFAULT_FLUSH_EVERY
        if isinstance(flush_every, int) and flush_every >= 1:
            self._flush_every = flush_every
        else:
            self._warn_once("flush_every", f"tokaudit: flush_every must be an int of at least 1, got "
                                           f"{flush_every!r}; using {DEFAULT_FLUSH_EVERY}")
        self._accelerator = accelerator
        self._accelerate_losses: list[tuple[weakref.ref[torch.Tensor], int]] = []
        """Tensors passed to accelerator.backward() in the open update, with the steps it divided them by."""
        if accelerator is not None:
            # Accelerate holds what the recorder needs: the prepared (DDP) model, its wrapped optimizer
            # and, under fp16, its GradScaler. What the caller passes wins.
            models = list(getattr(accelerator, "_models", []))
            optimizers = list(getattr(accelerator, "_optimizers", []))
            model = model if model is not None else (models[0] if len(models) == 1 else None)
            optimizer = optimizer if optimizer is not None else (optimizers[0] if len(optimizers) == 1 else None)
            scaler = scaler if scaler is not None else getattr(accelerator, "scaler", None)
        self._model = model
        self._optimizer = _torch_optimizer(optimizer)
        if optimizer is not None and self._optimizer is None:
            self._warn_once("optimizer", f"tokaudit: cannot hook the optimizer {type(optimizer).__name__} (no "
                                         "torch.optim.Optimizer inside it); every backward is recorded as its own "
                                         "update unless you call rec.begin_step()/rec.end_step()")
        self._grad_divisor = None if grad_divisor is None else float(grad_divisor)
        self._divisor_known = True
        self._divisor_resolved = grad_divisor is not None
        self._grad_scale = grad_scale
        self._forward_sync: bool | None = None
        self._step = 0
        self._step_records = 0
        self._closed_step: int | None = None
        self._auto_closed: int | None = None
        self._micro_next: dict[str, int] = {}
        self._active_term: str | None = None
        self._awaiting_scale: list[dict[str, Any]] = []
        self._captured_micro: dict[tuple[int, str], int] = {}
        self._capturing = 0
        self._call_group = 0
        self._fills = 0
        self._steps_known = self._optimizer is not None  # else until begin_step/end_step is called

        self._process_group = group
        if group is None:
            try:
                self._process_group = getattr(model, "process_group", None)
            except Exception:  # a model whose attributes raise: the default group
                pass
        self._identity: Identity | None = None
        self._writer: ShardWriter | StoreShardWriter | None = None
        self._backlog: list[pa.Table] = []
        self._dropped: dict[int, int] = {}  # step → records that could not be kept
        self._scaler: ScalerWatch | None = None
        self._store_retry_at = 0.0
        self.log_dir: Path | str
        """Where the shards go: a local folder, or a URL on object storage (s3://bucket/runs/exp1)."""
        if is_url(log_dir):
            # Opened at the first flush (a store that cannot be reached then warns and retries).
            url = str(log_dir).rstrip("/")
            self.log_dir = f"{url}/{run_id}" if run_id else url
            self.run_id = run_id or self.log_dir.rsplit("/", 1)[-1]
        else:
            try:
                base = Path(log_dir)
                self.log_dir = base / run_id if run_id else base
            except TypeError as error:
                self._warn_once("log_dir", f"tokaudit: log_dir {log_dir!r} is not a path ({error}); nothing is "
                                           "recorded")
                self.log_dir, self._closed = Path(os.devnull), True
            try:
                if not self._closed:
                    self.log_dir.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                self._warn_once("mkdir", f"tokaudit: cannot create {self.log_dir} ({error}); records are kept in "
                                         "memory and written when it can be created")
            self.run_id = run_id or self.log_dir.absolute().name
        # Global rank 0 audits the run for experiment trackers in a background thread (tokaudit.hooks.trackers).
        self._audits = AuditLoop.create(self.log_dir, self.run_id, trackers, audit_every, accelerator, self._warn_once)
        # Nothing the recorder cannot hook stops the training: each hook that fails warns and the
        # recording goes on without it.
        for name, attach in (("model", self._hook_model), ("optimizer", self._hook_optimizer),
                             ("scaler", lambda: self._hook_scaler(scaler)), ("accelerator", self._hook_accelerator)):
            try:
                attach()
            except Exception as error:
                self._warn_once(f"hook-{name}", f"tokaudit: cannot hook the {name} ({error!r}); recording goes "
                                                "on without it")
        atexit.register(self.close)
        on_termination(self)

    @property
    def rank(self) -> int:
        """Rank inside the averaging group (read at the first record, so after init_process_group)."""
        return self._resolve_identity().rank

    @property
    def world_size(self) -> int:
        """W: the size of the averaging group."""
        return self._resolve_identity().world_size

    @property
    def group(self) -> str:
        """Id of the averaging group ("0": the whole world)."""
        return self._resolve_identity().group

    # ---------------------------------------------------------------- public API

    def probe(self, per_token_loss: torch.Tensor, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Return `per_token_loss` unchanged; backward records ∂b/∂ℓᵢ for this microbatch's record."""
        if self._closed or not per_token_loss.requires_grad:
            return per_token_loss
        if self._pending_probe is None:
            self._pending_probe = ProbeResult()
        return self._probe_into(per_token_loss, valid_mask, self._pending_probe)

    def record(self, loss_sum: Value, valid_tokens: Value, backward_scalar: Value, step: int | None = None,
               micro: int | None = None, positions: Value = None, reported_loss: Value = None,
               skipped: bool | None = None, grad_scale: Value = None, term: str | None = None,
               _captured: bool = False) -> None:
        """Store one backward pass of one loss term. Tensors are kept (detached) until the next flush.

        `term` names the loss term when a microbatch's objective has several (an auxiliary head,
        the heads of multi-token prediction), each its own token mean; default "0", or the name
        of an enclosing `loss_term()`. Under a GradScaler, `backward_scalar` is the loss before
        `scaler.scale()` (or the scaled tensor itself): the log holds b = scale·loss, g = 1/scale.
        """
        if self._closed:
            return
        if self._audits is not None:
            at = step if isinstance(step, int) else self._step
            if self._audits.due(at):
                self.flush(wait_for_backward=True)  # every rank: the audit reads the steps before this one whole
                self._audits.start(at)
        try:
            self._resolve_identity()
            if not self._divisor_resolved:
                self._resolve_divisor()
            term = str(term) if term is not None else (self._active_term or "0")
            for name, value in (("loss_sum", loss_sum), ("valid_tokens", valid_tokens),
                                ("backward_scalar", backward_scalar), ("positions", positions),
                                ("reported_loss", reported_loss), ("grad_scale", grad_scale)):
                check_scalar(name, value)
            for name, number in (("step", step), ("micro", micro)):
                if number is not None and not (isinstance(number, int) and 0 <= number <= INT64_MAX):
                    raise ValueError(f"{name} must be a non-negative int, got {number!r}")
            if step is None:
                step = self._step
                if not self._steps_known and self._micro_next.get(term, 0) > 0:
                    # No step boundaries known: every backward of a term is its own update.
                    self._advance()
                    step = self._step
                self._step_records += 1  # records of the open update: its end may still mark them skipped
            probe = self._pending_probe
            deferred = micro is None and _captured and probe is not None
            if deferred:
                micro = -1  # a captured call takes its index when its backward runs (an evaluation never does)
            else:
                if micro is None:
                    micro = self._micro_next.get(term, 0) if step == self._step else 0
                if step == self._step:
                    self._micro_next[term] = micro + 1
            scale = None
            prescaled = False
            if self._scaler is not None and self._scaler.enabled():
                scale = self._scaler.current()
                prescaled = self._scaler.is_scaled(backward_scalar)
            entry = {
                "step": step,
                "micro": micro,
                "term": term,
                "loss_sum": _detached(loss_sum),
                "valid_tokens": _detached(valid_tokens),
                "backward_scalar": _detached(backward_scalar),
                "positions": _detached(positions),
                "reported_loss": _detached(reported_loss),
                "skipped": skipped,
                "grad_scale": _detached(grad_scale if grad_scale is not None else self._grad_scale),
                "loss_scale": scale,
                "prescaled": prescaled,
                "sync": self._forward_sync if self._forward_sync is not None else self._accelerate_sync(),
                "time": time.time_ns() // 1000,
                "probe": probe,
                "captured": _captured,
                "divide": 1,
            }
            if self._accelerator is not None and isinstance(backward_scalar, torch.Tensor):
                # b recorded before accelerator.backward(b) is divided there; recorded after, here.
                entry["scalar_ref"] = weakref.ref(backward_scalar)
                entry["divide"] = next((n for ref, n in self._accelerate_losses if ref() is backward_scalar), 1)
            if deferred:
                assert probe is not None
                entry.update(call_group=self._call_group, named=self._active_term is not None, filled_at=-1)
                probe.on_fill = lambda: self._filled(entry)
            self._records.append(entry)
            self._by_step.setdefault(step, []).append(entry)
            self._unpacked.append(entry)
            if self._scaler is not None and self._scaler.enabled() and scale is None:
                self._awaiting_scale.append(entry)  # before the scaler's first scale(): filled then
            self._pending_probe = None
            if len(self._records) >= self._flush_every:
                self.flush(wait_for_backward=True)
        except Exception as error:
            self._pending_probe = None
            self._note_dropped(step if isinstance(step, int) else self._step, 1)
            self._warn_once("record", f"tokaudit: a record was dropped ({error}); it is noted in the log as a "
                                      "dropped record, and training goes on")

    @contextmanager
    def loss_term(self, name: str) -> Iterator[None]:
        """Records, probes and captured calls inside belong to loss term `name` (an auxiliary head,
        MTP head k): each term is audited as its own token mean."""
        previous, self._active_term = self._active_term, str(name)
        try:
            yield
        finally:
            self._active_term = previous

    def capture_cross_entropy(self) -> AbstractContextManager[None]:
        """While active, every cross-entropy call with grad (F.cross_entropy, nn.CrossEntropyLoss)
        is recorded with its probe; it returns exactly what it would have. See `tokaudit.hooks.capture`."""
        from tokaudit.hooks.capture import capture_cross_entropy

        return capture_cross_entropy(self)

    def start_capture(self) -> None:
        """`capture_cross_entropy()` without a `with` block: active until `close()` (trainer callbacks)."""
        if self._capture is None:
            self._capture = self.capture_cross_entropy()
            self._capture.__enter__()

    def begin_step(self, step: int) -> None:
        """The next records belong to optimizer update `step` (a trainer's global step, so a resumed
        run continues its numbering instead of starting at 0 again)."""
        self._steps_known = True
        self._auto_closed = None
        if step != self._step:
            self._step = step
            self._micro_next = {}
            self._step_records = 0
            self._pack()

    def report_loss(self, value: Value, step: int | None = None) -> None:
        """The loss the trainer reported for `step`, stamped on its buffered records as `reported_loss`.
        Default: the update under way when it holds records already (a loss logged after backward, before
        `optimizer.step()`), else the update just closed (logged after the step)."""
        if step is None:
            step = self._step if self._by_step.get(self._step) else self._step - 1
        snapshot = _detached(value)  # one copy for the update's records
        for record in self._by_step.get(step, ()):
            self._set_value(record, "reported_loss", snapshot)

    def end_step(self, skipped: bool | None = None) -> None:
        """Close the current optimizer update (the optimizer's step hook calls it when one is given).

        `skipped=True` marks this update's records as skipped: by policy (N = 0), or because an
        inf/NaN guard or the GradScaler did not step. With `optimizer=` or `scaler=`, skipped
        updates are found without this call.
        """
        self._steps_known = True
        if self._auto_closed is not None and not self._step_records:
            # zero_grad or the scaler already closed this skipped update: say it, do not close another.
            if skipped is not None:
                self._mark_skipped(self._auto_closed, skipped)
            self._auto_closed = None
            return
        if skipped is not None:
            self._mark_skipped(self._step, skipped)
        self._advance()

    def flush(self, wait_for_backward: bool = False) -> None:
        """Write buffered records to a new shard. With `wait_for_backward` (the automatic flush),
        the current update's records and those whose probe has not yet seen its backward stay
        buffered for the next shard."""
        if self.flushing or (not self._records and not self._backlog):
            return
        self.flushing = True
        try:
            self._flush(wait_for_backward)
        finally:
            self.flushing = False
            run_deferred()  # a SIGTERM that arrived meanwhile acts now, on whole shards

    def _flush(self, wait_for_backward: bool) -> None:
        ready = self._records
        waiting: list[dict[str, Any]] = []
        if wait_for_backward and len(self._records) < 2 * self._flush_every:
            ready = []
            for record in self._records:
                done = record["probe"] is None or record["probe"].filled
                still_open = self._step_records > 0 and record["step"] == self._step
                (ready if done and not still_open else waiting).append(record)
        self._records = waiting
        self._by_step = {}
        for record in waiting:
            self._by_step.setdefault(record["step"], []).append(record)
        if self._unpacked:
            kept = {id(record) for record in waiting}
            self._unpacked = [record for record in self._unpacked if id(record) in kept]
        # A captured loss that never reached backward (computed with grad, then unused) is no record.
        ready = [r for r in ready if not (r["captured"] and not r["probe"].filled)]
        self._number_captured(ready)
        if not ready and not self._backlog:
            return
        try:
            if ready:
                self._backlog.append(self._table(ready))
        except Exception as error:
            self._note_dropped_records(ready)
            self._warn_once("table", f"tokaudit: {len(ready)} record(s) could not be read back ({error!r}); "
                                     "they are noted in the log as dropped")
        self._write_backlog()

    def close(self) -> None:
        """Stop a started capture, flush everything and detach the hooks. Safe to call twice."""
        if self._closed:
            return
        if self._capture is not None:
            self._capture.__exit__(None, None, None)
            self._capture = None
        self._store_retry_at = 0.0  # the last flush tries the store whatever failed before
        self.flush()
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._scaler is not None:
            self._scaler.close()
        atexit.unregister(self.close)
        if self._audits is not None:
            self._audits.close()  # rank 0: the final audit, logged to the trackers (a bounded wait)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals: steps

    def _close_skipped(self) -> None:
        closed = self._step
        self.end_step(skipped=True)
        self._auto_closed = closed

    def _advance(self) -> None:
        self._auto_closed = None
        self._step += 1
        self._micro_next = {}
        self._step_records = 0
        self._open_calls = []
        if not self._packs_at_zero_grad or len(self._unpacked) > PACK_AT_ADVANCE:
            self._pack()  # no optimizer's zero_grad to wait for (or one this loop never calls)

    def _pack(self) -> None:
        """The values of every record whose update has closed and whose backward has run, packed into the
        slab of their device (`columns.pack`): nothing of them changes any more, and held as tensors of their
        own they are thousands of small blocks on a CPU's heap. Called after the optimizer's zero_grad where
        it is watched (the gradients just freed, the heap at its lowest: 1.006 ± 0.003 on the benchmark,
        against 1.011 ± 0.005 packed at the optimizer's step), else when an update closes."""
        if not self._unpacked:
            return
        try:
            done: list[dict[str, Any]] = []
            waiting: list[dict[str, Any]] = []
            for record in self._unpacked:
                probe = record["probe"]
                ready = (probe is None or probe.filled) and record["step"] != self._step
                (done if ready else waiting).append(record)
                if ready:
                    record["packed"] = True
            holders = [holder for record in done for holder in _holders(record)]
            self._unpacked = waiting
            pack(holders, self._slabs)
        except Exception as error:  # the values stay tensors: nothing is lost
            self._unpacked = []
            self._warn_once("pack", f"tokaudit: could not pack an update's values ({error!r}); they are kept as "
                                    "they are, and training goes on")

    def _set_value(self, record: dict[str, Any], name: str, value: Value) -> None:
        """`record[name] = value`, set after the record may have been packed: a tensor set on a packed record
        waits for the next pack (`_unpacked`), once, rather than stay a tensor of its own until the flush."""
        if record.get("packed") and isinstance(value, torch.Tensor) and not isinstance(record[name], torch.Tensor):
            self._unpacked.append(record)  # (a tensor already there: the record is waiting already)
        record[name] = value

    def _mark_skipped(self, step: int, skipped: bool | torch.Tensor) -> None:
        for record in self._by_step.get(step, ()):
            if record["skipped"] is None:
                self._set_value(record, "skipped", skipped)  # a scaler's found_inf is a tensor

    def _on_optimizer_step(self) -> None:
        if self._capturing and not self._step_records:
            # The optimizer stepped on a loss that never went through F.cross_entropy.
            self._warn_once("invisible", f"tokaudit: no cross-entropy call was captured in optimizer step "
                                         f"{self._step}: the loss is computed by a kernel tokaudit cannot see (a "
                                         "fused or vocab-parallel cross-entropy such as Liger's, cut-cross-entropy "
                                         "or Megatron's); record it with rec.probe(per_token_loss, valid) and "
                                         "rec.record(...) around that loss")
        self._closed_step = self._step
        self.end_step()

    def _on_scaler_update(self, found_inf: torch.Tensor | None) -> None:
        """GradScaler.update(), once per update after step(): a step with records that no
        optimizer step closed was skipped; a fused optimizer steps anyway, and found_inf says it."""
        try:
            if self._step_records:
                self._close_skipped()
            elif self._closed_step is not None and found_inf is not None:
                self._mark_skipped(self._closed_step, found_inf > 0)
            self._closed_step = None
        except Exception as error:
            self._warn_once("scaler", f"tokaudit: could not read the GradScaler's update ({error!r})")

    def _on_scale(self) -> None:
        if self._awaiting_scale and self._scaler is not None:
            scale = self._scaler.current()
            for record in self._awaiting_scale:
                record["loss_scale"] = scale
            self._awaiting_scale = []

    def _watch_zero_grad(self, optimizer: Any) -> None:
        original = optimizer.zero_grad

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            try:
                self._on_zero_grad()
            except Exception as error:
                self._warn_once("zero_grad", f"tokaudit: could not follow zero_grad ({error!r})")
            cleared = original(*args, **kwargs)
            self._pack()  # the gradients freed: the heap at its lowest in the step
            return cleared

        optimizer.zero_grad = zero_grad
        self._packs_at_zero_grad = True
        self._handles.append(_Restore(optimizer, "zero_grad", zero_grad))  # close() gives it back

    def _on_zero_grad(self) -> None:
        """Gradients cleared while this update holds backpropagated records and no optimizer step
        closed it: the update was skipped (an inf/NaN guard). Records whose backward is still to
        come (a trainer that clears before the first backward) move to the next update."""
        if not self._step_records:
            return
        current = list(self._by_step.get(self._step, ()))
        done = [r for r in current if r["probe"] is None or r["probe"].filled]
        if not done:
            return
        self._close_skipped()
        for record in current:
            if not (record["probe"] is None or record["probe"].filled):
                held = self._by_step[record["step"]]
                held[:] = [r for r in held if r is not record]
                record["step"], record["skipped"] = self._step, None
                self._by_step.setdefault(self._step, []).append(record)
                if record["micro"] >= 0:  # a captured call is numbered when its backward runs
                    record["micro"] = self._micro_next.get(record["term"], 0)
                    self._micro_next[record["term"]] = record["micro"] + 1
                self._step_records += 1

    # ---------------------------------------------------------------- internals: capture

    def _probe_into(self, per_token_loss: torch.Tensor, valid_mask: torch.Tensor | None,
                    result: ProbeResult) -> torch.Tensor:
        try:
            if valid_mask is None:
                valid = torch.ones_like(per_token_loss, dtype=torch.bool)
            else:
                valid = valid_mask.to(device=per_token_loss.device, dtype=torch.bool).expand_as(per_token_loss)
            probed: torch.Tensor = TokenProbe.apply(  # type: ignore[no-untyped-call]
                per_token_loss, valid, result, self._probe_failed)
            return probed
        except Exception as error:
            self._warn_once("probe", f"tokaudit: probe disabled for this call ({error!r})")
            return per_token_loss

    def _captured_call(self, loss_sum: torch.Tensor, valid_tokens: torch.Tensor, positions: int,
                       target: torch.Tensor) -> ProbeResult:
        """Where one captured cross-entropy call goes. Calls since the last backward belong to one
        microbatch: a call over slices disjoint from an open record's (a chunk) or inside the same
        `loss_term()` adds into that record; any other call (another head over the same tokens,
        an MTP head) opens the next term."""
        if not self._open_calls or any(c.probe.filled for c in self._open_calls):
            # A backward ran since the open calls: a new microbatch. Calls it never reached (an
            # evaluation with grad) are left behind and never written.
            self._open_calls = []
            self._call_group += 1
        footprint = Footprint.of(target)
        for call in self._open_calls:
            same = (call.named and call.term == self._active_term) if self._active_term is not None else \
                (not call.named and all(seen.disjoint(footprint) for seen in call.footprints))
            if same:
                record = call.record
                record["loss_sum"] = record["loss_sum"] + loss_sum.detach()
                record["valid_tokens"] = record["valid_tokens"] + valid_tokens.detach()
                record["positions"] = record["positions"] + positions
                call.footprints.append(footprint)  # a later call must miss every chunk, not only the last
                return call.probe
        term = self._active_term
        if term is None:
            term = str(len({c.term for c in self._open_calls if not c.named}))
        probe = ProbeResult()
        self._pending_probe = probe
        self.record(loss_sum=loss_sum, valid_tokens=valid_tokens, backward_scalar=None, positions=positions,
                    term=term, _captured=True)
        if self._records and self._records[-1]["probe"] is probe:
            self._open_calls.append(_OpenCall(self._records[-1], probe, term, self._active_term is not None,
                                              [footprint]))
        return probe

    # ---------------------------------------------------------------- internals: identity, shards

    def _hook_model(self) -> None:
        if self._model is not None and hasattr(self._model, "require_backward_grad_sync"):
            # DDP decides at forward time whether this backward all-reduces, so read the flag there.
            self._handles.append(self._model.register_forward_pre_hook(self._capture_sync))

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

    def _hook_scaler(self, scaler: Any) -> None:
        if scaler is not None:
            self._scaler = ScalerWatch(scaler, self._on_scaler_update, self._on_scale)

    def _hook_accelerator(self) -> None:
        """accelerator.backward(loss) backpropagates loss / gradient_accumulation_steps (DeepSpeed's
        engine divides the same way): a recorded b that went through it is divided in the log too."""
        accelerator = self._accelerator
        if accelerator is None:
            return
        original = accelerator.backward

        def backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                self._on_accelerate_backward(loss, int(getattr(accelerator, "gradient_accumulation_steps", 1)))
            except Exception as error:
                self._warn_once("accelerate", f"tokaudit: could not follow accelerator.backward ({error!r})")
            return original(loss, *args, **kwargs)

        accelerator.backward = backward
        self._handles.append(_Restore(accelerator, "backward", backward))

    def _accelerate_sync(self) -> bool | None:
        """Under `accelerator.accumulate`, whether this backward synchronizes gradients."""
        if self._accelerator is None:
            return None
        sync = getattr(self._accelerator, "sync_gradients", None)
        return sync if isinstance(sync, bool) else None

    def _on_accelerate_backward(self, loss: Any, steps: int) -> None:
        if not isinstance(loss, torch.Tensor):
            return
        for record in reversed(self._records):
            if record["step"] != self._step:
                break
            source = record.get("scalar_ref")
            if source is not None and source() is loss:
                record["divide"] = steps
        self._accelerate_losses = [(ref, n) for ref, n in self._accelerate_losses if ref() is not None]
        self._accelerate_losses.append((weakref.ref(loss), steps))

    def _accelerate_ddp(self) -> bool:
        """Accelerate prepared the model with DistributedDataParallel (`prepare` returns the DDP
        wrapper and keeps the bare module, so the wrapper itself may not have been given)."""
        kind = getattr(getattr(self._accelerator, "distributed_type", None), "value", "")
        return isinstance(kind, str) and kind.startswith("MULTI_")

    def _capture_sync(self, module: Any, args: Any) -> None:
        self._forward_sync = bool(module.require_backward_grad_sync)

    def _probe_failed(self, error: BaseException) -> None:
        self._warn_once("probe-backward", f"tokaudit: probe could not read a backward ({error!r})")

    def _resolve_divisor(self) -> None:
        """D from what can be seen: DDP without a comm hook averages (D = W); a known hook says its
        divisor; an FSDP2 module (fully_shard) says its divide factor; otherwise D is unknown and the
        log says so (divisor_known = false)."""
        self._divisor_resolved = True
        hooks = getattr(self._model, "_comm_hooks", None)
        if self._model is not None and hooks is not None:
            if not hooks:
                self._grad_divisor = float(self.world_size)  # DDP's default: all-reduce, then divide by W
                return
            hook = hooks[-1][0]
            self._grad_divisor = known_hook_divisor(hook, self.world_size)
            if self._grad_divisor is None:
                self._divisor_known = False
                name = getattr(hook, "__qualname__", repr(hook))
                self._warn_once("divisor", f"tokaudit: DDP comm hook {name} is registered and its divisor cannot "
                                           "be seen; pass Recorder(grad_divisor=...) (1 for a summing hook, W for "
                                           "an average). Until then the audit does not judge the gradient's scale.")
            return
        if self._model is not None and hasattr(self._model, "_get_fsdp_state"):
            self._grad_divisor = fsdp2_divisor(self._model)
            if self._grad_divisor is not None:
                return
            self._divisor_known = False
            self._warn_once("divisor", "tokaudit: the FSDP2 module's reduce-scatter divisor cannot be read; pass "
                                       "Recorder(grad_divisor=...) (the divide factor, or the data-parallel size). "
                                       "Until then the audit does not judge the gradient's scale.")
            return
        if self._accelerate_ddp():
            # Accelerate wrapped the model in DDP (its comm hooks, fp16/bf16 compression and PowerSGD,
            # all average too): D = W.
            self._grad_divisor = float(self.world_size)
            return
        if self.world_size > 1:
            self._divisor_known = False
            self._warn_once("divisor", "tokaudit: the gradient reduction cannot be seen (no DDP model= given); "
                                       "pass Recorder(model=ddp_model) or grad_divisor=... (W for an average, 1 "
                                       "for a sum). Until then the audit does not judge the gradient's scale.")
        else:
            self._grad_divisor = 1.0

    def _resolve_identity(self) -> Identity:
        if self._identity is None:
            self._identity = resolve_identity(self._process_group)
            if self._identity.announced_world_size:
                self._warn_once("identity", f"tokaudit: WORLD_SIZE={self._identity.announced_world_size} but no "
                                            "process group is initialized: each process is recorded as its own "
                                            "group of W=1 (make the first record after init_process_group)")
        return self._identity

    def _filled(self, record: dict[str, Any]) -> None:
        self._fills += 1
        record["filled_at"] = self._fills

    def _number_captured(self, records: list[dict[str, Any]]) -> None:
        """Final terms and microbatch indices of captured calls, once their backward has run: among
        the calls of one microbatch that reached backward, unnamed terms are numbered in call order
        (an evaluation call with grad in between takes no term), and each term's microbatches in the
        order their backward ran."""
        groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for record in records:
            if record["captured"] and record["micro"] < 0:
                groups.setdefault((record["step"], record["call_group"]), []).append(record)
        for members in groups.values():
            unnamed = sorted({int(r["term"]) for r in members if not r["named"]})
            relabel = {str(t): str(i) for i, t in enumerate(unnamed)}
            for record in members:
                if not record["named"]:
                    record["term"] = relabel[record["term"]]
        for record in sorted((r for m in groups.values() for r in m), key=lambda r: r["filled_at"]):
            key = (record["step"], record["term"])
            record["micro"] = self._captured_micro.get(key, 0)
            self._captured_micro[key] = record["micro"] + 1

    def _note_dropped(self, step: int, count: int) -> None:
        self._dropped[step] = self._dropped.get(step, 0) + count

    def _note_dropped_records(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self._note_dropped(int(record["step"]), 1)

    def _write_backlog(self) -> None:
        """Write everything waiting, as one shard; on failure keep it (bounded) for the next flush."""
        if not self._backlog:
            return
        if isinstance(self.log_dir, str) and time.monotonic() < self._store_retry_at:
            # An object store that just failed (unreachable, denied) costs seconds of retries per try:
            # the records wait in the (bounded) backlog until STORE_RETRY_S have passed, or close().
            self._trim_backlog()
            return
        table = pa.concat_tables(self._backlog) if len(self._backlog) > 1 else self._backlog[0]
        try:
            if self._writer is None:
                identity = self._resolve_identity()
                prefix = f"rank-{identity.rank:05d}"
                if identity.group != "0":
                    prefix = f"group-{re.sub(r'[^0-9A-Za-z]+', '_', identity.group)}-{prefix}"
                self._writer = StoreShardWriter(self.log_dir, prefix) if isinstance(self.log_dir, str) else \
                    ShardWriter(self.log_dir, prefix)
            metadata = None
            if self._dropped:
                metadata = dropped_metadata(self.run_id, self.group, self.rank, ranges(self._dropped))
            self._writer.write(table, metadata)
            self._backlog.clear()
            self._dropped.clear()
        except Exception as error:
            self._warn_once("write", f"tokaudit: could not write a shard to {self.log_dir} ({error!r}); the "
                                     "records are kept and written at the next flush, training goes on")
            if isinstance(self.log_dir, str):
                self._store_retry_at = time.monotonic() + STORE_RETRY_S
            self._trim_backlog()

    def _trim_backlog(self) -> None:
        """Keep at most BACKLOG_SHARDS shards' worth of records waiting; older ones become dropped steps."""
        limit = BACKLOG_SHARDS * self._flush_every
        while sum(t.num_rows for t in self._backlog) > limit and len(self._backlog) > 1:
            lost = self._backlog.pop(0)
            for step in lost.column("step").to_pylist():
                self._note_dropped(int(step), 1)

    def _table(self, records: list[dict[str, Any]]) -> pa.Table:
        count = len(records)
        probes = [r["probe"] for r in records]
        packed = PackedHost()  # the places these records hold in their slabs, copied to the host at once
        packed.copy([value for record in records for value in _packed_values(record)])
        valid_tokens = to_host([r["valid_tokens"] for r in records], torch.int64, packed)
        backward = to_host([r["backward_scalar"] for r in records], torch.float64, packed)
        grad_scale = to_host([r["grad_scale"] for r in records], torch.float64, packed)
        loss_scale = to_host([r["loss_scale"] for r in records], torch.float64, packed)
        skipped = to_host([r["skipped"] for r in records], torch.bool, packed)
        for i, (record, scale) in enumerate(zip(records, loss_scale)):
            if backward[i] is not None and record["divide"] != 1:
                backward[i] = backward[i] / record["divide"]  # what accelerator.backward backpropagated
            if scale is not None:
                # The probe saw ∂(scale·loss)/∂ℓ: b is the scaled scalar, g = g_user/scale divides it out.
                grad_scale[i] = (1.0 if grad_scale[i] is None else grad_scale[i]) / scale
                if backward[i] is not None and not record["prescaled"]:
                    backward[i] = backward[i] * scale
        columns: dict[str, Iterable[Any]] = {
            "step": [r["step"] for r in records],
            "micro": [r["micro"] for r in records],
            "rank": [self.rank] * count,
            "world_size": [self.world_size] * count,
            "loss_sum": to_host([r["loss_sum"] for r in records], torch.float64, packed),
            "valid_tokens": valid_tokens,
            "backward_scalar": backward,
            "run_id": [self.run_id] * count,
            "group": [self.group] * count,
            "term": [r["term"] for r in records],
            "grad_divisor": [self._grad_divisor] * count,
            "divisor_known": [self._divisor_known] * count,
            "grad_scale": grad_scale,
            "positions": to_host([r["positions"] for r in records], torch.int64, packed),
            "reported_loss": to_host([r["reported_loss"] for r in records], torch.float64, packed),
            "sync": [r["sync"] for r in records],
            "skipped": [None if v is None else bool(v) for v in skipped],
            "time": [r["time"] for r in records],
            "schema_version": [SCHEMA_VERSION] * count,
        }
        for name in ("weight_sum", "weight_min", "weight_max", "masked_abs_sum"):
            values = [getattr(p, name) if isinstance(p, ProbeResult) and p.filled else None for p in probes]
            host = to_host(values, torch.float64, packed)
            if name in ("weight_min", "weight_max"):
                # min/max over an empty set of valid tokens is ±inf on the device: null in the log.
                host = [None if v is not None and abs(v) == float("inf") else v for v in host]
            columns["masked_weight_abs_sum" if name == "masked_abs_sum" else f"token_{name}"] = host
        keep, cleared = writable_rows(columns, [isinstance(p, ProbeResult) and p.filled for p in probes])
        if cleared:
            self._warn_once("positions", f"tokaudit: {cleared} record(s) with a number of positions no audit can use "
                                         "(negative, not whole, past 2³¹ − 1, or below the valid tokens) were "
                                         "written without it")
        if not all(keep):
            bad = [r for r, ok in zip(records, keep) if not ok]
            self._note_dropped_records(bad)
            self._warn_once("invalid", f"tokaudit: {len(bad)} record(s) with a value no audit can use (a null, "
                                       "negative or impossibly large count, a missing loss sum, a NaN scale) were "
                                       "left out and noted in the log as dropped")
            columns = {name: [v for v, ok in zip(values, keep) if ok] for name, values in columns.items()}
        arrays = {name: pa.array(list(values), type=WRITER_SCHEMA.field(name).type)
                  for name, values in columns.items()}
        return pa.table([arrays[field.name] for field in WRITER_SCHEMA], schema=WRITER_SCHEMA)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


@dataclass(eq=False)
class _OpenCall:
    """A captured call of the current microbatch whose backward has not run yet."""

    record: dict[str, Any]
    probe: ProbeResult
    term: str
    named: bool
    footprints: list[Footprint]
    """The targets of every call merged into it (the chunks of one term)."""


PACK_AT_ADVANCE = 64
"""Records left unpacked after which an update's close packs them, where zero_grad is watched but not called."""
_PACKED_VALUES = ("loss_sum", "valid_tokens", "backward_scalar", "positions", "reported_loss", "grad_scale",
                  "loss_scale", "skipped")
"""A record's values that may be one-number tensors, packed once its update closes (`Recorder._pack`)."""


def _holders(record: dict[str, Any]) -> Iterator[tuple[Any, str]]:
    """Where the values of `record` that may be one-number tensors are held: the record, and its probe's result
    (`columns.held_value`)."""
    for name in _PACKED_VALUES:
        yield record, name
    if record["probe"] is not None:
        for name in ProbeResult.VALUES:
            yield record["probe"], name


def _packed_values(record: dict[str, Any]) -> Iterator[Packed]:
    """The values of `record` and of its probe that were packed (`Recorder._pack`)."""
    for holder, name in _holders(record):
        if isinstance(value := held_value(holder, name), Packed):
            yield value


def _detached(value: Value) -> Value:
    """A snapshot: a device copy of a tensor (no sync), so an accumulator changed in place after
    `record()` is recorded with the value it had then."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a wrapper (Accelerate's AcceleratedOptimizer, and others that keep
    it as `.optimizer` without running Optimizer.__init__): the one whose step() runs once per update
    and whose step hooks exist."""
    try:
        for _ in range(8):
            if optimizer is None:
                return None
            if isinstance(optimizer, torch.optim.Optimizer) and "_optimizer_step_post_hooks" in vars(optimizer):
                return optimizer
            optimizer = getattr(optimizer, "optimizer", None)
    except Exception:  # a wrapper whose attributes raise: nothing to hook
        return None
    return None


class _Restore:
    """A removable handle that gives an object back its own method (an instance attribute we set)."""

    def __init__(self, owner: Any, name: str, ours: Any) -> None:
        self.owner, self.name, self.ours = owner, name, ours

    def remove(self) -> None:
        if vars(self.owner).get(self.name) is self.ours:
            delattr(self.owner, self.name)
