"""What the recorder hooks into besides the loop itself: a wrapped optimizer, and Accelerate's accelerator."""

from __future__ import annotations

import functools
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tokaudit.hooks._record import Record


class Restore:
    """A removable handle that gives an object back its own method (an instance attribute we set)."""

    def __init__(self, owner: Any, name: str, ours: Any) -> None:
        self.owner, self.name, self.ours = owner, name, ours

    def remove(self) -> None:
        if vars(self.owner).get(self.name) is self.ours:
            delattr(self.owner, self.name)


class Wrapped:
    """`owner.name` with ours around it, held as an instance attribute of `owner`. Pickled or copied with it
    (`torch.save(model)`, `copy.deepcopy(model)` for an EMA copy), it is the copy's own method again: no closure
    to pickle, and nothing of ours, nor the original's bound method, in the copy."""

    def __init__(self, owner: Any, name: str, original: Callable[..., Any], call: Callable[..., Any]) -> None:
        self.owner, self.name, self.call = owner, name, call
        functools.update_wrapper(self, original)  # its name, doc and signature are the method's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        # (the copy's method, found on its class: its own attributes are not there yet while it is rebuilt)
        return getattr, (self.owner, self.name)


def wrap_method(owner: Any, name: str, around: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Restore:
    """`owner.name` replaced, as an instance attribute, by `around(owner.name)`; the handle gives it back."""
    original = getattr(owner, name)
    ours = Wrapped(owner, name, original, around(original))
    setattr(owner, name, ours)
    return Restore(owner, name, ours)


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
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


def from_accelerator(accelerator: Any, model: Any, optimizer: Any, scaler: Any) -> tuple[Any, Any, Any]:
    """Accelerate holds what the recorder needs: the prepared (DDP) model, its wrapped optimizer and, under
    fp16, its GradScaler. What the caller passes wins."""
    if accelerator is None:
        return model, optimizer, scaler
    models = list(getattr(accelerator, "_models", []))
    optimizers = list(getattr(accelerator, "_optimizers", []))
    if model is None and len(models) == 1:
        model = models[0]
        if not hasattr(model, "require_backward_grad_sync"):
            # Accelerate keeps the bare module of a DDP model: the wrapper decides whether a backward syncs
            model = ddp_around(model) or model
    optimizer = optimizer if optimizer is not None else (optimizers[0] if len(optimizers) == 1 else None)
    scaler = scaler if scaler is not None else getattr(accelerator, "scaler", None)
    return model, optimizer, scaler


def ddp_around(module: Any) -> Any:
    """The DistributedDataParallel that wraps `module`, found among what refers to it (the wrapper's `_modules`
    dict, its attribute dict, the wrapper: three levels, searched once), else None."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    level = [module]
    for _ in range(3):
        referrers = [r for held in level for r in gc.get_referrers(held) if r is not level]
        for holder in referrers:
            if isinstance(holder, DistributedDataParallel) and holder.module is module:
                return holder
        level = [r for r in referrers if isinstance(r, dict)]
    return None


class AccelerateWatch:
    """accelerator.backward(loss) backpropagates loss / gradient_accumulation_steps (DeepSpeed's engine divides
    the same way): a recorded b that went through it is divided in the log too. `open_records()` gives the
    records of the update under way: those made with a loss before it went through backward are marked then."""

    def __init__(
        self, accelerator: Any, open_records: Callable[[], Iterable[Record]], warn: Callable[[str, str], None]
    ) -> None:
        self.accelerator, self.open_records, self.warn = accelerator, open_records, warn
        self.losses: list[tuple[weakref.ref[torch.Tensor], int]] = []
        """Tensors passed to accelerator.backward() in the open update, with the steps it divided them by."""

        def around(original: Callable[..., Any]) -> Callable[..., Any]:
            def backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
                self._follow(loss)
                return original(loss, *args, **kwargs)

            return backward

        self.handle = wrap_method(accelerator, "backward", around)

    def _follow(self, loss: Any) -> None:
        """`loss` goes through accelerator.backward, which divides it by the accumulation steps: the open records
        whose b it is are marked divided, and it is kept to tell of b recorded after it (`divide`)."""
        try:
            if isinstance(loss, torch.Tensor):
                steps = int(getattr(self.accelerator, "gradient_accumulation_steps", 1))
                for record in self.open_records():  # b recorded before accelerator.backward(b): divided there
                    source = record.scalar_ref
                    if source is not None and source() is loss:
                        record.divide = steps
                self.losses = [(ref, n) for ref, n in self.losses if ref() is not None]
                self.losses.append((weakref.ref(loss), steps))
        except Exception as error:
            self.warn("accelerate", f"tokaudit: could not follow accelerator.backward ({error!r})")

    def divide(self, scalar: torch.Tensor) -> int:
        """What accelerator.backward divided `scalar` by, when it went through it already (else 1)."""
        return next((n for ref, n in self.losses if ref() is scalar), 1)

    def sync(self) -> bool | None:
        """Under `accelerator.accumulate`, whether this backward synchronizes gradients."""
        sync = getattr(self.accelerator, "sync_gradients", None)
        return sync if isinstance(sync, bool) else None

    def wraps_ddp(self) -> bool:
        """Accelerate prepared the model with DistributedDataParallel (`prepare` returns the DDP wrapper and
        keeps the bare module, so the wrapper itself may not have been given)."""
        kind = getattr(getattr(self.accelerator, "distributed_type", None), "value", "")
        return isinstance(kind, str) and kind.startswith("MULTI_")


def version_of(package: str) -> str | None:
    """An installed package's version, for the shards' provenance (None where it cannot be read)."""
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None


def trainer_run_id(run_name: Any) -> str | None:
    """A trainer integration's run id when none is given: the trainer's own run name (the same on every rank);
    else one per launch that every rank reads alike: torchrun's rendezvous id (a fresh one per --standalone
    launch), or the start time of a single process. None where neither exists (several processes started
    otherwise): the Recorder then names the run after its folder, and two launches there are told apart by the
    duplicate_records finding."""
    if isinstance(run_name, str) and run_name.strip():
        return run_name.strip()
    launch = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if launch and launch != "none":
        return f"run-{launch[:8]}"
    if int(os.environ.get("WORLD_SIZE", "1") or 1) == 1 and not _distributed():
        return time.strftime(f"run-%Y%m%d-%H%M%S-{os.getpid()}")
    return None


def _distributed() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


LIBRARIES = (
    "tokaudit",
    "torch",
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "trl",
    "warnings",
    "contextlib",
    "threading",
    "functools",
)
"""Packages whose frames a warning skips: it points at the training script's line that led to it."""


def user_stacklevel() -> int:
    """The `stacklevel` of the caller's caller's first frame outside tokaudit and the trainers it runs under (the
    user's line a warning names, not ours); a frame of a file outside any package counts as the user's."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None:
        top = frame.f_globals.get("__name__", "").split(".")[0]
        if top not in LIBRARIES and not top.startswith("_"):
            break
        frame, level = frame.f_back, level + 1
    return level
