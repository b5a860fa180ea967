"""The correct construction, ready to drop in: N for the whole update, then W·S/N (or S/N).

N = global_valid_tokens([labels for labels in step_labels])   # before the first backward
for batch in step_batches:
    loss_sum = (per_token * valid).sum()                         # stays connected when empty
    token_mean_loss(loss_sum, N).backward()                      # W·S_r/N into DDP's average
if is_empty_update(N): skip optimizer.step() (every rank sees the same N)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

Count = int | torch.Tensor


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _device(counts: list[Count], group: Any) -> torch.device:
    for count in counts:
        if isinstance(count, torch.Tensor):
            return count.device
    if _distributed() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_valid_tokens(
    counts: Iterable[Count] | Count, group: Any = None, ignore_index: int = -100, device: torch.device | None = None
) -> torch.Tensor:
    """N: the valid tokens of the whole optimizer update, over every microbatch of every rank.

    `counts` holds this rank's microbatches: ints, 0-d count tensors, or label tensors (any tensor
    with a dimension is counted as `labels != ignore_index`). One all-reduce over `group` (the
    gradient-averaging group; default: the world), which every rank must call, zero-count ranks
    included. Returns an int64 0-d tensor on the counts' device: no host sync.
    """
    items = [counts] if isinstance(counts, int | torch.Tensor) else list(counts)
    device = device or _device(items, group)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() > 0:
            item = (item != ignore_index).sum()
        total = total + (item.to(device=device, dtype=torch.int64) if isinstance(item, torch.Tensor) else int(item))
    if _distributed():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def token_mean_loss(
    loss_sum: torch.Tensor,
    global_tokens: torch.Tensor | int,
    reduction: str = "mean",
    group: Any = None,
    world_size: int | None = None,
) -> torch.Tensor:
    """The backward scalar of the token-mean objective L = ΣS/N for this rank's microbatch.

    reduction="mean" (DDP's default average, D = W): W·S/N. reduction="sum" (a summing comm hook,
    FSDP2 with divide factor 1, D = 1): S/N. W is the size of `group`, the group that averages.
    The result is float32 (float64 for a float64 loss). N is clamped to 1, so an update without
    valid tokens gives an exact 0; a rank with none still backpropagates a 0 connected to the
    graph, provided `loss_sum` is built from the per-token losses (`(per_token * valid).sum()`),
    never a Python 0.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' (the gradient reduction averages) or 'sum', got {reduction!r}")
    if world_size is None:
        world_size = dist.get_world_size(group) if _distributed() else 1
    # The division runs in float32 or wider: in float16 N > 65504 is inf (a silent zero gradient),
    # in bfloat16 N itself is rounded (N = 1001 becomes 1000).
    dtype = torch.promote_types(loss_sum.dtype, torch.float32)
    tokens = torch.as_tensor(global_tokens, device=loss_sum.device).clamp(min=1).to(dtype)
    # b = W·S_r/N with an average (D = W), S_r/N with a sum (D = 1): e = b/S·1/D = 1/N either way.
    scale = world_size if reduction == "mean" else 1
    return loss_sum.to(dtype) * scale / tokens


def is_empty_update(global_tokens: torch.Tensor | int) -> bool:
    """N = 0: every rank gets the same answer from the same all-reduced N, so all skip together.
    (One host sync per step, outside the microbatch loop.)"""
    return int(global_tokens) == 0


def reported_token_mean(loss_sum: torch.Tensor, global_tokens: torch.Tensor | int, group: Any = None) -> torch.Tensor:
    """The loss to log: all_reduce(Σ S) / N from detached sums (0 when N = 0). Every rank calls it."""
    total = loss_sum.detach().to(torch.float64).clone()
    if _distributed():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total / torch.as_tensor(global_tokens, device=total.device).clamp(min=1)
