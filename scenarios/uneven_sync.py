"""Ranks running different numbers of microbatches in real DDP, the token mean b = W·S/N over the step's N: each
rank synchronizing its last microbatch alone (the others under no_sync), or its last two. Each job returns, per step,
the parameters before it and the gradient, and the float64 reference is the token mean over every rank and
microbatch."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from scenarios.strategies import loaded, make_model, microbatch, per_token_loss
from tokaudit.hooks import Recorder

COUNTS = (((2, 7, 4), (5, 3)), ((3, 3), (8, 1, 2)), ((6, 2, 5), (1, 4)))  # counts[step][rank][micro]

SYNCED = {"last": 1, "last_two": 2}
"""How many of its last microbatches each rank runs outside no_sync: as many on every rank, so that DDP's
all-reduces pair off one for one whatever each rank's count."""


def job(rank: int, world_size: int, variant: str, out: str) -> dict[str, Any]:
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    with Recorder(out, run_id=f"uneven_{variant}", model=model, optimizer=optimizer, announce=False) as rec:
        for step, per_rank in enumerate(COUNTS):
            before = [p.detach().clone() for p in model.parameters()]
            micros = per_rank[rank]
            tokens_n = torch.tensor(float(sum(micros)), dtype=torch.float64)
            dist.all_reduce(tokens_n)  # N over every rank and microbatch
            for micro, count in enumerate(micros):
                synced = micro >= len(micros) - SYNCED[variant]
                with contextlib.nullcontext() if synced else model.no_sync():
                    tokens, labels, valid = microbatch(step, rank, micro, count)
                    loss_sum = per_token_loss(model, tokens, labels)[valid].sum()
                    scalar = world_size * loss_sum / tokens_n  # b = W·S/N
                    rec.record(loss_sum=loss_sum, valid_tokens=count, backward_scalar=scalar)
                    scalar.backward()
            history.append({"before": before, "grads": [p.grad.detach().clone() for p in model.parameters()]})
            optimizer.step()
            optimizer.zero_grad()
    return {"history": history}


def reference_gradient(before: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """The token mean's gradient over every rank and microbatch of the step, in one float64 process."""
    model = loaded(make_model(), before)
    total = torch.zeros((), dtype=torch.float64)
    for rank, counts in enumerate(COUNTS[step]):
        for micro, count in enumerate(counts):
            tokens, labels, valid = microbatch(step, rank, micro, count)
            total = total + per_token_loss(model, tokens, labels)[valid].sum()
    (total / sum(sum(counts) for counts in COUNTS[step])).backward()
    return [p.grad.detach().clone() for p in model.parameters()]
