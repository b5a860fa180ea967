"""Class-weighted cross-entropy (`F.cross_entropy(weight=…)`) captured in real DDP: the weighted token mean
Σ_r Σ w_y·ℓ / Σ_r Σ w_y over every rank and microbatch (right), or each rank's own weighted mean averaged by DDP
(wrong). Each job returns, per step, the parameters before it and the gradient."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from scenarios.strategies import IGNORE_INDEX, VOCAB, loaded, make_model, microbatch
from tokaudit.hooks import Recorder

COUNTS = (((2, 7), (5, 3)), ((3, 3), (8, 1)), ((6, 2), (1, 4)))  # counts[step][rank][micro]

CLASS_WEIGHTS = torch.linspace(0.25, 3.0, VOCAB, dtype=torch.float64)
"""A class's weight w_y: every class its own, so that Σw over a microbatch is never its count."""


def variant_weights(variant: str) -> torch.Tensor:
    """The class weights a variant of `job` passes."""
    fill = {"ones_without_w": 1.0, "every_class_two": 2.0}.get(variant)
    return CLASS_WEIGHTS if fill is None else torch.full_like(CLASS_WEIGHTS, fill)


def weight_mass(step: int, rank: int, micro: int, count: int, weights: torch.Tensor = CLASS_WEIGHTS) -> torch.Tensor:
    """Σ w_y over the microbatch's valid labels (float64)."""
    _, labels, valid = microbatch(step, rank, micro, count)
    return weights[labels[valid]].sum()


def job(rank: int, world_size: int, variant: str, out: str) -> dict[str, Any]:
    """`variant`: global (b = W·Σw·ℓ / Σ_global w, the weighted token mean), local (each microbatch's own
    `reduction="mean"` over its Σw, divided by the microbatches: what DDP averages is each rank's weighted mean),
    ones_without_w (weights of 1, b = Σℓ / N: the W left out, half the token mean under W = 2), every_class_two (weights
    of 2, b = W·Σ2ℓ / Σ_global w: the plain token mean, with its losses doubled)."""
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    weights = variant_weights(variant)
    with Recorder(out, run_id=f"class_weights_{variant}", model=model, optimizer=optimizer, announce=False) as rec:
        with rec.capture_cross_entropy():
            for step, per_rank in enumerate(COUNTS):
                before = [p.detach().clone() for p in model.parameters()]
                micros = per_rank[rank]
                # Σw over every microbatch of every rank, by one all-reduce before the first backward
                mass = sum(
                    (weight_mass(step, rank, m, c, weights) for m, c in enumerate(micros)),
                    torch.zeros((), dtype=torch.float64),
                )
                dist.all_reduce(mass)
                for micro, count in enumerate(micros):
                    last = micro == len(micros) - 1
                    with contextlib.nullcontext() if last else model.no_sync():
                        tokens, labels, _ = microbatch(step, rank, micro, count)
                        flat, target = model(tokens).reshape(-1, VOCAB), labels.reshape(-1)
                        if variant == "ones_without_w":
                            loss = F.cross_entropy(
                                flat, target, weight=weights, ignore_index=IGNORE_INDEX, reduction="sum"
                            )
                            scalar = loss / sum(sum(counts) for counts in per_rank)
                        elif variant in ("global", "every_class_two"):
                            loss = F.cross_entropy(
                                flat, target, weight=weights, ignore_index=IGNORE_INDEX, reduction="sum"
                            )
                            scalar = world_size * loss / mass
                        else:
                            loss = F.cross_entropy(flat, target, weight=weights, ignore_index=IGNORE_INDEX)
                            scalar = loss / len(micros)
                        scalar.backward()
                history.append({"before": before, "grads": [p.grad.detach().clone() for p in model.parameters()]})
                optimizer.step()
                optimizer.zero_grad()
    return {"history": history}


def reference_gradient(
    before: list[torch.Tensor], step: int, weights: torch.Tensor = CLASS_WEIGHTS
) -> list[torch.Tensor]:
    """The weighted token mean's gradient over every rank and microbatch of the step, in one float64 process."""
    model = loaded(make_model(), before)
    total, mass = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for rank, counts in enumerate(COUNTS[step]):
        for micro, count in enumerate(counts):
            tokens, labels, _ = microbatch(step, rank, micro, count)
            logits = model(tokens).reshape(-1, VOCAB)
            total = total + F.cross_entropy(
                logits, labels.reshape(-1), weight=weights, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            mass = mass + weight_mass(step, rank, micro, count, weights)
    (total / mass).backward()
    return [p.grad.detach().clone() for p in model.parameters()]
