"""A `torch.distributed.pipelining` schedule seen by the recorder: what it does to the loss besides the loop.

Three things a schedule does that the loop never shows:

- at its first `step()` the last stage calls `loss_fn` once more, on a stand-in output, to infer the
  shapes of the backward (`_prepare_backward_infra`); that loss is no microbatch of any update, so
  nothing recorded inside it counts;
- it calls `loss_fn` once per microbatch, all forwards first under GPipe: each call is a microbatch of
  its own, however the captured cross-entropy calls of consecutive forwards look;
- with `scale_grads=True` (the default) it divides every gradient by its number of microbatches M
  after the backwards of each `step()` (`stage.scale_grads(M)`): every token's weight is then
  ∂b/∂ℓᵢ · 1/M, recorded as a factor of g (`Recorder.scale_grads`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from tokaudit.hooks._attach import Restore, wrap_method


class Recorder(Protocol):
    """What the schedule's hooks ask of the recorder (`hooks.recorder.Recorder`)."""

    provenance: dict[str, Any]

    def paused(self) -> AbstractContextManager[None]: ...

    def scale_grads(self, factor: Any) -> None: ...

    def next_microbatch(self) -> None: ...


INFERENCE_METHODS = ("_prepare_backward_infra", "_shape_inference")
"""A stage's methods that call `loss_fn` to infer shapes (torch 2.13; earlier releases)."""


def stages_of(schedule: Any) -> list[Any]:
    """The pipeline stages this rank runs: one (`_stage`) or several (`_stages`, interleaved schedules)."""
    stages = getattr(schedule, "_stages", None)
    if stages:
        return list(stages)
    stage = getattr(schedule, "_stage", None)
    if stage is None:
        raise TypeError(
            f"{type(schedule).__name__} holds no pipeline stage (_stage or _stages): not a "
            "torch.distributed.pipelining schedule"
        )
    return [stage]


def watch_schedule(recorder: Recorder, schedule: Any) -> list[Restore]:
    """Hook `schedule` (None: nothing) for `recorder`; the handles give the schedule and its stages their own
    methods back."""
    handles: list[Restore] = []
    if schedule is None:
        return handles

    def wrap(owner: Any, name: str, around: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        handles.append(wrap_method(owner, name, around))

    def paused(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with recorder.paused():
                return original(*args, **kwargs)

        return call

    def rescaling(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(grad_scale_factor: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(grad_scale_factor, *args, **kwargs)
            if grad_scale_factor != 1:
                recorder.scale_grads(1 / grad_scale_factor)  # p.grad.div_(M) on every parameter of the stage
            return result

        return call

    def new_microbatch(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            recorder.next_microbatch()
            return original(*args, **kwargs)

        return call

    stages = stages_of(schedule)
    for stage in stages:
        for name in INFERENCE_METHODS:
            if hasattr(stage, name):
                wrap(stage, name, paused)
    # Every stage of the rank divides its own parameters by the same M: one of them says it for the loss.
    last = [stage for stage in stages if getattr(stage, "is_last", False)] or stages[-1:]
    wrap(last[0], "scale_grads", rescaling)
    if hasattr(schedule, "_compute_loss"):
        wrap(schedule, "_compute_loss", new_microbatch)
    recorder.provenance["pipeline"] = {
        "schedule": type(schedule).__name__,
        "microbatches": int(getattr(schedule, "_n_microbatches", 0) or 0),
        "scale_grads": bool(getattr(schedule, "scale_grads", False)),
    }
    return handles
