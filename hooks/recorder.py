"""Recorder: per-rank, per-microbatch records of S, n, b, W, D, g, sync and step, written to Parquet shards."""

from __future__ import annotations

import atexit
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from tokaudit.schema import SCHEMA_VERSION, WRITER_SCHEMA

Number = int | float | bool
Value = Number | torch.Tensor | None

DEFAULT_FLUSH_EVERY = 4096


class ProbeResult:
    """Per-microbatch weights that backward gave the per-token losses, kept on the device.

    Filled by `_TokenProbe.backward`; several probes in one microbatch accumulate.
    """

    __slots__ = ("weight_sum", "weight_min", "weight_max", "masked_abs_sum", "valid_count", "filled")

    def __init__(self) -> None:
        self.weight_sum: torch.Tensor | None = None
        self.weight_min: torch.Tensor | None = None
        self.weight_max: torch.Tensor | None = None
        self.masked_abs_sum: torch.Tensor | None = None
        self.valid_count: torch.Tensor | None = None
        self.filled = False

    def add(self, grad: torch.Tensor, valid: torch.Tensor) -> None:
        # grad = ∂b/∂ℓᵢ for every position; reductions stay on the device (no host sync) and
        # accumulate in float64, the per-token values stay in the gradient's own dtype.
        weight = grad.detach()
        inf = float("inf")  # Python scalars: no host-to-device copy inside backward
        weight_sum = torch.where(valid, weight, 0).sum(dtype=torch.float64)
        weight_min = torch.where(valid, weight, inf).amin().double()
        weight_max = torch.where(valid, weight, -inf).amax().double()
        masked_abs_sum = torch.where(valid, 0, weight.abs()).sum(dtype=torch.float64)
        self._accumulate(weight_sum, weight_min, weight_max, masked_abs_sum, valid.sum())

    def add_uniform(self, weight: torch.Tensor, valid_count: torch.Tensor) -> None:
        """Every valid token got the same weight (a reduced loss); positions that are not valid got 0."""
        weight = weight.detach().to(torch.float64).reshape(())
        inf = float("inf")
        has_tokens = valid_count > 0
        self._accumulate(weight * valid_count, torch.where(has_tokens, weight, inf),
                         torch.where(has_tokens, weight, -inf), torch.zeros_like(weight), valid_count)

    def _accumulate(self, weight_sum: torch.Tensor, weight_min: torch.Tensor, weight_max: torch.Tensor,
                    masked_abs_sum: torch.Tensor, valid_count: torch.Tensor) -> None:
        if self.weight_sum is None:
            self.weight_sum, self.weight_min, self.weight_max = weight_sum, weight_min, weight_max
            self.masked_abs_sum, self.valid_count = masked_abs_sum, valid_count
        else:
            assert self.weight_min is not None and self.weight_max is not None
            assert self.masked_abs_sum is not None and self.valid_count is not None
            self.weight_sum = self.weight_sum + weight_sum
            self.weight_min = torch.minimum(self.weight_min, weight_min)
            self.weight_max = torch.maximum(self.weight_max, weight_max)
            self.masked_abs_sum = self.masked_abs_sum + masked_abs_sum
            self.valid_count = self.valid_count + valid_count
        self.filled = True


class _TokenProbe(torch.autograd.Function):
    """Identity in forward; in backward it reads ∂b/∂ℓᵢ and passes the gradient on unchanged."""

    @staticmethod
    def forward(ctx: Any, per_token_loss: torch.Tensor, valid: torch.Tensor, result: ProbeResult,
                on_error: Callable[[BaseException], None]) -> torch.Tensor:
        ctx.save_for_backward(valid)
        ctx.result = result
        ctx.on_error = on_error
        return per_token_loss.view_as(per_token_loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (valid,) = ctx.saved_tensors
        try:
            ctx.result.add(grad, valid)
        except Exception as error:  # the probe never breaks training
            ctx.on_error(error)
        return grad, None, None, None


def _group_id(process_group: Any) -> str:
    """A name every member of a group derives alike, with no collective: its global ranks."""
    if process_group is None or process_group is dist.group.WORLD:
        return "0"
    ranks = sorted(dist.get_process_group_ranks(process_group))
    if len(ranks) == dist.get_world_size():
        return "0"
    stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    if all(b - a == stride for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}:{ranks[-1] + 1}:{stride}"
    return "-".join(str(rank) for rank in ranks)


def _known_hook_divisor(hook: Callable[..., Any], world_size: int) -> float | None:
    """D for DDP comm hooks whose reduction is known: the default ones all-reduce then divide by W."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    averaging = {
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        getattr(default_hooks, "bf16_compress_hook", default_hooks.allreduce_hook),
    }
    return float(world_size) if hook in averaging else None


def _to_host(values: Sequence[Value], dtype: torch.dtype) -> list[Any]:
    """One device→host copy per device for a whole column, instead of one per record."""
    out: list[Any] = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(index)
    for indices in by_device.values():
        stacked = torch.stack([values[i].detach().reshape(()).to(dtype) for i in indices])  # type: ignore[union-attr]
        for index, host_value in zip(indices, stacked.cpu().tolist()):
            out[index] = host_value
    return out


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
                 grad_divisor: float | None = None, grad_scale: float | None = None,
                 flush_every: int = DEFAULT_FLUSH_EVERY) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be at least 1, got {flush_every}")
        self._closed = False
        self._warned: set[str] = set()
        self._records: list[dict[str, Any]] = []
        self._pending_probe: ProbeResult | None = None
        self._capture: AbstractContextManager[None] | None = None
        self._handles: list[Any] = []
        self._flush_every = flush_every
        self._model = model
        self._grad_divisor = None if grad_divisor is None else float(grad_divisor)
        self._divisor_resolved = grad_divisor is not None
        self._grad_scale = grad_scale
        self._forward_sync: bool | None = None
        self._step = 0
        self._micro_next: dict[int, int] = {}
        self._steps_known = optimizer is not None  # else until begin_step/end_step is called

        process_group = group if group is not None else getattr(model, "process_group", None)
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(process_group)
            self.rank = dist.get_rank(process_group)
            self.group = _group_id(process_group)
        else:
            self.world_size, self.rank, self.group = 1, 0, "0"

        base = Path(log_dir)
        self.log_dir = base / run_id if run_id else base
        self.run_id = run_id or self.log_dir.resolve().name
        self._prefix = f"rank-{self.rank:05d}"
        if self.group != "0":
            self._prefix = f"group-{re.sub(r'[^0-9A-Za-z]+', '_', self.group)}-{self._prefix}"
        self._sequence = 0
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._sequence = self._next_sequence()
        except OSError as error:
            self._warn_once("mkdir", f"tokaudit: cannot create {self.log_dir} ({error}); nothing will be recorded")

        if model is not None and hasattr(model, "require_backward_grad_sync"):
            # DDP decides at forward time whether this backward all-reduces, so read the flag there.
            self._handles.append(model.register_forward_pre_hook(self._capture_sync))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self.end_step()))
        atexit.register(self.close)

    # ---------------------------------------------------------------- public API

    def probe(self, per_token_loss: torch.Tensor, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Return `per_token_loss` unchanged; backward records ∂b/∂ℓᵢ for this microbatch's record."""
        if self._closed or not per_token_loss.requires_grad:
            return per_token_loss
        try:
            if valid_mask is None:
                valid = torch.ones_like(per_token_loss, dtype=torch.bool)
            else:
                valid = valid_mask.to(device=per_token_loss.device, dtype=torch.bool).expand_as(per_token_loss)
            if self._pending_probe is None:
                self._pending_probe = ProbeResult()
            result: torch.Tensor = _TokenProbe.apply(  # type: ignore[no-untyped-call]
                per_token_loss, valid, self._pending_probe, self._probe_failed)
            return result
        except Exception as error:
            self._warn_once("probe", f"tokaudit: probe disabled for this call ({error!r})")
            return per_token_loss

    def record(self, loss_sum: Value, valid_tokens: Value, backward_scalar: Value, step: int | None = None,
               micro: int | None = None, positions: Value = None, reported_loss: Value = None,
               skipped: bool | None = None, grad_scale: Value = None, _captured: bool = False) -> None:
        """Store one backward pass. Tensors are kept (detached) until the next flush."""
        if self._closed:
            return
        try:
            if not self._divisor_resolved:
                self._resolve_divisor()
            if step is None:
                step = self._step
                if not self._steps_known:
                    # No step boundaries known: every backward is its own update.
                    self._step += 1
            if micro is None:
                micro = self._micro_next.get(step, 0)
            self._micro_next = {step: micro + 1}
            self._records.append({
                "step": step,
                "micro": micro,
                "loss_sum": _detached(loss_sum),
                "valid_tokens": _detached(valid_tokens),
                "backward_scalar": _detached(backward_scalar),
                "positions": _detached(positions),
                "reported_loss": _detached(reported_loss),
                "skipped": skipped,
                "grad_scale": _detached(grad_scale if grad_scale is not None else self._grad_scale),
                "sync": self._forward_sync,
                "time": time.time_ns() // 1000,
                "probe": self._pending_probe,
                "captured": _captured,
            })
            self._pending_probe = None
            if len(self._records) >= self._flush_every:
                self.flush(wait_for_backward=True)
        except Exception as error:
            self._warn_once("record", f"tokaudit: a record was dropped ({error!r})")

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
        if step != self._step:
            self._step = step
            self._micro_next = {}

    def report_loss(self, value: Value, step: int | None = None) -> None:
        """The loss the trainer reported for `step` (default: the update just closed), stamped on its
        buffered records as `reported_loss`."""
        step = self._step - 1 if step is None else step
        for record in self._records:
            if record["step"] == step:
                record["reported_loss"] = _detached(value)

    def end_step(self, skipped: bool | None = None) -> None:
        """Close the current optimizer update (called by the optimizer's step hook when one is given).

        `skipped=True` marks the buffered records of this update as skipped by policy (e.g. N = 0).
        """
        self._steps_known = True
        if skipped is not None:
            for record in self._records:
                if record["step"] == self._step:
                    record["skipped"] = skipped
        self._step += 1
        self._micro_next = {}

    def flush(self, wait_for_backward: bool = False) -> None:
        """Write buffered records to a new shard. With `wait_for_backward`, records whose probe has
        not yet seen its backward stay buffered for the next shard."""
        if not self._records:
            return
        ready = self._records
        waiting: list[dict[str, Any]] = []
        if wait_for_backward and len(self._records) < 2 * self._flush_every:
            ready = []
            for record in self._records:
                (ready if record["probe"] is None or record["probe"].filled else waiting).append(record)
        self._records = waiting
        # A captured loss that never reached backward (computed with grad, then unused) is no record.
        ready = [r for r in ready if not (r["captured"] and not r["probe"].filled)]
        if not ready:
            return
        try:
            self._write(self._table(ready))
        except Exception as error:
            self._warn_once("write", f"tokaudit: could not write a shard to {self.log_dir} ({error!r}); "
                                     "training goes on without these records")

    def close(self) -> None:
        """Stop a started capture, flush everything and detach the hooks. Safe to call twice."""
        if self._closed:
            return
        if self._capture is not None:
            self._capture.__exit__(None, None, None)
            self._capture = None
        self.flush()
        self._closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        atexit.unregister(self.close)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _capture_sync(self, module: Any, args: Any) -> None:
        self._forward_sync = bool(module.require_backward_grad_sync)

    def _probe_failed(self, error: BaseException) -> None:
        self._warn_once("probe-backward", f"tokaudit: probe could not read a backward ({error!r})")

    def _resolve_divisor(self) -> None:
        self._divisor_resolved = True
        hooks = getattr(self._model, "_comm_hooks", None)
        if self._model is None or hooks is None:
            return
        if not hooks:
            self._grad_divisor = float(self.world_size)  # DDP's default: all-reduce, then divide by W
            return
        hook = hooks[-1][0]
        self._grad_divisor = _known_hook_divisor(hook, self.world_size)
        if self._grad_divisor is None:
            name = getattr(hook, "__qualname__", repr(hook))
            self._warn_once("divisor", f"tokaudit: DDP comm hook {name} is registered and its divisor cannot be "
                                       "seen; pass Recorder(grad_divisor=...) (1 for a summing hook, W for an "
                                       "average). Until then the audit assumes D = W.")

    def _next_sequence(self) -> int:
        # A resumed run never overwrites the shards of the run before it.
        pattern = re.compile(re.escape(self._prefix) + r"-(\d{6})\.parquet$")
        taken = [int(m.group(1)) for p in self.log_dir.iterdir() if (m := pattern.match(p.name))]
        return max(taken, default=-1) + 1

    def _table(self, records: list[dict[str, Any]]) -> pa.Table:
        count = len(records)
        probes = [r["probe"] for r in records]
        valid_tokens = _to_host([r["valid_tokens"] for r in records], torch.int64)
        columns: dict[str, Iterable[Any]] = {
            "step": [r["step"] for r in records],
            "micro": [r["micro"] for r in records],
            "rank": [self.rank] * count,
            "world_size": [self.world_size] * count,
            "loss_sum": _to_host([r["loss_sum"] for r in records], torch.float64),
            "valid_tokens": valid_tokens,
            "backward_scalar": _to_host([r["backward_scalar"] for r in records], torch.float64),
            "run_id": [self.run_id] * count,
            "group": [self.group] * count,
            "grad_divisor": [self._grad_divisor] * count,
            "grad_scale": _to_host([r["grad_scale"] for r in records], torch.float64),
            "positions": _to_host([r["positions"] for r in records], torch.int64),
            "reported_loss": _to_host([r["reported_loss"] for r in records], torch.float64),
            "sync": [r["sync"] for r in records],
            "skipped": [r["skipped"] for r in records],
            "time": [r["time"] for r in records],
            "schema_version": [SCHEMA_VERSION] * count,
        }
        for name in ("weight_sum", "weight_min", "weight_max", "masked_abs_sum"):
            values = [getattr(p, name) if isinstance(p, ProbeResult) and p.filled else None for p in probes]
            host = _to_host(values, torch.float64)
            if name in ("weight_min", "weight_max"):
                # min/max over an empty set of valid tokens is ±inf on the device: null in the log.
                host = [None if v is not None and abs(v) == float("inf") else v for v in host]
            columns["masked_weight_abs_sum" if name == "masked_abs_sum" else f"token_{name}"] = host
        arrays = {name: pa.array(list(values), type=WRITER_SCHEMA.field(name).type)
                  for name, values in columns.items()}
        return pa.table([arrays[field.name] for field in WRITER_SCHEMA], schema=WRITER_SCHEMA)

    def _write(self, table: pa.Table) -> None:
        final = self.log_dir / f"{self._prefix}-{self._sequence:06d}.parquet"
        temporary = self.log_dir / f".{final.name}.{os.getpid()}.tmp"
        pq.write_table(table, temporary)
        os.replace(temporary, final)  # atomic: a killed writer leaves only whole shards
        self._sequence += 1

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def _detached(value: Value) -> Value:
    return value.detach() if isinstance(value, torch.Tensor) else value
