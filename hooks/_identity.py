"""Who this process is in the gradient-averaging group, and what that group's reduction divides by."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class Identity:
    """Rank, W and group id of one recording process."""

    rank: int
    world_size: int
    group: str
    """"0" for the whole world, else the group's global ranks ("0:8:2" for 0, 2, 4, 6)."""
    announced_world_size: int | None = None
    """WORLD_SIZE from the environment when no process group exists (a launch without init)."""


def group_id(process_group: Any) -> str:
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


def resolve_identity(process_group: Any) -> Identity:
    """Read once the first record is made, not when the Recorder is built: a Recorder made before
    init_process_group still records the right rank and W."""
    if dist.is_available() and dist.is_initialized():
        return Identity(dist.get_rank(process_group), dist.get_world_size(process_group), group_id(process_group))
    announced = os.environ.get("WORLD_SIZE", "")
    size = int(announced) if announced.isdigit() else None
    if size is None or size < 2:
        return Identity(0, 1, "0")
    # A launcher started several processes but no process group exists: nothing averages, so each
    # process is its own group of one, named by the launcher's rank (its shards never collide).
    rank = os.environ.get("RANK", "")
    return Identity(0, 1, f"process-{rank if rank.isdigit() else 0}", size)


def known_hook_divisor(hook: Callable[..., Any], world_size: int) -> float | None:
    """D for DDP comm hooks whose reduction is known: the default ones all-reduce then divide by W."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    averaging = {
        default_hooks.allreduce_hook,
        default_hooks.fp16_compress_hook,
        getattr(default_hooks, "bf16_compress_hook", default_hooks.allreduce_hook),
        # PowerSGD all-reduces its factors (and, before it starts, the gradient) and divides them by W
        powerSGD_hook.powerSGD_hook,
        powerSGD_hook.batched_powerSGD_hook,
    }
    return float(world_size) if hook in averaging else None


def fsdp2_divisor(model: Any) -> float | None:
    """D of an FSDP2 module (`fully_shard`): the factor set by set_gradient_divide_factor, else the
    data-parallel size, reduce-scatter group × all-reduce group (HSDP); `force_sum_reduction_for_comms`
    moves the division out of the collective but keeps it (torch's _get_gradient_divide_factors).
    None when the parameter groups disagree or cannot be read."""
    factors = set()
    try:
        for group in fsdp2_param_groups(model):
            factor = group.gradient_divide_factor
            if factor is None:
                mesh = group.mesh_info  # HSDP adds a replicate (all-reduce) dimension to the shard one
                factor = mesh.shard_mesh_size * getattr(mesh, "replicate_mesh_size", 1)
            factors.add(float(factor))
    except Exception:
        return None
    return factors.pop() if len(factors) == 1 else None


def fsdp2_param_groups(model: Any) -> list[Any]:
    """The parameter groups of an FSDP2 module (`fully_shard`) and its FSDP2 submodules: what reduces each one's
    gradients, and whether it will ([] where there are none, or they cannot be read)."""
    groups: list[Any] = []
    try:
        for module in model.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is not None:
                state = get_state()
                single = getattr(state, "_fsdp_param_group", None)  # (torch before the list)
                groups.extend(getattr(state, "_fsdp_param_groups", None) or ([single] if single is not None else []))
    except Exception:
        return []
    return groups


def fsdp2_sync(groups: list[Any]) -> bool | None:
    """Whether the next backward of an FSDP2 module synchronizes its gradients over the data-parallel group: every
    parameter group reduce-scatters (set_requires_gradient_sync), and under HSDP all-reduces across replicas too
    (set_requires_all_reduce); None where that cannot be read."""
    try:
        return all(
            group.reduce_grads and (group.all_reduce_grads or not hasattr(group.mesh_info, "replicate_mesh_size"))
            for group in groups
        )
    except Exception:
        return None


def fsdp1_modules(model: Any) -> list[Any]:
    """The FullyShardedDataParallel (FSDP1) modules of a model ([] where there are none): each reduces its gradients
    at the backward where its `_sync_gradients` is set, which `no_sync()` clears on all of them."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return [module for module in model.modules() if isinstance(module, FullyShardedDataParallel)]
    except Exception:
        return []


def fsdp1_sync(modules: list[Any]) -> bool | None:
    """Whether the next backward of an FSDP1 model reduces its gradients (None where that cannot be read)."""
    try:
        return all(bool(module._sync_gradients) for module in modules)
    except Exception:
        return None


def fsdp2_process_group(model: Any) -> Any:
    """The group an FSDP2 module shards over, where it is one mesh dimension (its data-parallel group on a DP×TP
    mesh); None for HSDP's two (the world then) or where it cannot be read."""
    try:
        meshes = {id(g.mesh_info.mesh): g.mesh_info for g in fsdp2_param_groups(model)}
        if len(meshes) != 1:
            return None
        (info,) = meshes.values()
        return None if hasattr(info, "replicate_mesh_size") else info.shard_process_group
    except Exception:
        return None


_UNSEEN = "Until then the audit does not judge the gradient's scale."


def resolve_divisor(model: Any, world_size: int, accelerate_ddp: bool) -> tuple[float | None, str | None]:
    """D from what can be seen, and a warning where it cannot (D None: divisor_known = false). DDP without a
    comm hook averages (D = W); a known hook says its divisor; an FSDP2 module (fully_shard) says its divide
    factor; a model Accelerate wrapped in DDP averages; without a group there is nothing to divide by."""
    hooks = getattr(model, "_comm_hooks", None)
    if model is not None and hooks is not None:
        if not hooks:
            return float(world_size), None  # DDP's default: all-reduce, then divide by W
        hook = hooks[-1][0]
        divisor = known_hook_divisor(hook, world_size)
        if divisor is not None:
            return divisor, None
        name = getattr(hook, "__qualname__", repr(hook))
        return None, (
            f"tokaudit: DDP comm hook {name} is registered and its divisor cannot be seen; pass "
            "Recorder(grad_divisor=...) (1 for a summing hook, W for an average). " + _UNSEEN
        )
    if model is not None and hasattr(model, "_get_fsdp_state"):
        divisor = fsdp2_divisor(model)
        if divisor is not None:
            return divisor, None
        return None, (
            "tokaudit: the FSDP2 module's reduce-scatter divisor is not one number that can be read (its modules' "
            "divide factors differ, or none can be read); set one factor on every module, or pass "
            "Recorder(grad_divisor=...) (the divide factor, or the data-parallel size). " + _UNSEEN
        )
    if accelerate_ddp:
        # Accelerate wrapped the model in DDP (its comm hooks, fp16/bf16 compression and PowerSGD, all
        # average too): D = W.
        return float(world_size), None
    if world_size > 1 and model is not None and fsdp1_modules(model):
        return None, (
            "tokaudit: an FSDP (FullyShardedDataParallel) model's gradient divisor is not read; pass "
            "Recorder(grad_divisor=...) (W for its average, 1 for a summing hook). " + _UNSEEN
        )
    if world_size > 1:
        return None, (
            "tokaudit: the gradient reduction cannot be seen (no DDP model= given); pass "
            "Recorder(model=ddp_model) or grad_divisor=... (W for an average, 1 for a sum). " + _UNSEEN
        )
    return 1.0, None


class Placement:
    """Who one recorder is, read at its first record (so after init_process_group): rank, W and group of the
    averaging group (the model's, else `group`, else the world), and D, its reduction's divisor (given, or seen
    then; unknown where it cannot be seen, said once)."""

    def __init__(
        self,
        group: Any,
        model: Any,
        grad_divisor: float | None,
        warn: Callable[[str, str], None],
        announce: Callable[[Placement], None] | None = None,
    ) -> None:
        self.process_group = group
        self.announce = announce
        """Called once, when rank, W and D are first known (the Recorder's start line)."""
        if group is None:
            try:
                self.process_group = getattr(model, "process_group", None) or fsdp2_process_group(model)
            except Exception:  # a model whose attributes raise: the default group
                pass
        self.identity: Identity | None = None
        self.grad_divisor = None if grad_divisor is None else float(grad_divisor)
        self.divisor_known = True
        self.divisor_resolved = False
        self.warn = warn

    def who(self) -> Identity:
        if self.identity is None:
            self.identity = resolve_identity(self.process_group)
            if self.identity.announced_world_size:
                self.warn(
                    "identity",
                    f"tokaudit: WORLD_SIZE={self.identity.announced_world_size} but no process "
                    "group is initialized: each process is recorded as its own group of W=1 "
                    "(make the first record after init_process_group)",
                )
        return self.identity

    def resolve(self, model: Any, wraps_ddp: Callable[[], bool]) -> None:
        """Rank, W and D, where not yet known (`resolve_divisor`)."""
        identity = self.who()
        if not self.divisor_resolved:
            self.divisor_resolved = True
            if self.grad_divisor is not None:
                self._check_given(model, identity.world_size)
            else:
                self.grad_divisor, warning = resolve_divisor(model, identity.world_size, wraps_ddp())
                if warning is not None:
                    self.divisor_known = False
                    self.warn("divisor", warning)
        if self.announce is not None:
            announce, self.announce = self.announce, None
            announce(self)

    def _check_given(self, model: Any, world_size: int) -> None:
        """A given D against the one the model's reduction shows, where it shows one: two that differ cannot both be
        the divisor the gradients went through (a Megatron-style sum told with grad_divisor=1 into DDP's default
        average is W× too small), so D is recorded as unknown (null, W standing for it), said once. DDP's alone: an
        FSDP2 factor set anew at every step is read at the first record, and grad_divisor=1 stands over it
        (docs/integrations.md)."""
        if getattr(model, "_comm_hooks", None) is None:  # no DDP model seen: an average assumed is no divisor seen
            return
        seen, _ = resolve_divisor(model, world_size, False)
        given = self.grad_divisor
        if seen is None or given is None or math.isclose(seen, given, rel_tol=1e-9):
            return
        self.grad_divisor, self.divisor_known = None, False  # as a divisor no one can see: W stands for it
        self.warn(
            "divisor",
            f"tokaudit: grad_divisor={given:g} was given, but the model's reduction divides by {seen:g} (DDP's "
            "average divides by W; a known comm hook says its own); the records cannot say which the "
            "gradients went through: drop grad_divisor where the model's reduction is the one, or give "
            "grad_divisor without model= where the gradients are reduced another way. " + _UNSEEN,
        )
