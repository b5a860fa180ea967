"""torchtune's full_finetune_distributed loop, in real DDP: the loss summed over chunks of the output
(`CEWithChunkedOutputLoss` times the microbatch's count is the microbatch's sum S), `backward()` on it, and
after the last microbatch N all-reduced and `training.scale_grads(model, W / N)`: every gradient multiplied
after backward. Recorded with the README's capture line and `rec.scale_grads`.

Each job returns, per step, the parameters before it and the gradient the optimizer saw, for a float64
reference of the token mean (`strategies.reference_gradient`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from scenarios.strategies import IGNORE_INDEX, VOCAB, Scenario, make_model, microbatch
from tokaudit.hooks import Recorder

CHUNKS = 2
COUNTS = (((1, 7), (5, 2)), ((3, 3), (8, 1)))  # counts[step][rank][micro]
EMPTY_MICRO = (((1, 7), (5, 0)), ((3, 3), (8, 1)))
"""Rank 1's second microbatch of step 0 has no valid label (a response truncated away): its chunked mean is 0/0."""


@dataclass(frozen=True)
class TuneSetup:
    name: str
    scale: str
    """"w_over_n": training.scale_grads(model, W/N) (torchtune's); "one_over_n": the W left out (a bug)."""
    told: bool
    """rec.scale_grads(factor) beside training.scale_grads."""
    before_shift: bool = False
    """N counted on the labels before the causal shift, as torchtune's recipe counts batch["labels"] before
    `_loss_step` shifts them: with the row's first label valid, one label per row more than the loss is over."""
    counts: tuple[tuple[tuple[int, ...], ...], ...] = COUNTS

    @property
    def scenario(self) -> Scenario:
        """The counts as the strategies' reference reads them."""
        return Scenario(
            name=self.name,
            strategy="torchtune",
            world_size=2,
            counts=self.counts,
            correct=True,
            description="torchtune recipe",
        )


def scale_grads(model: torch.nn.Module, scaler: torch.Tensor) -> None:
    """torchtune.training.scale_grads, as torchtune 0.6 writes it."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= scaler.to(p.device)


def job(rank: int, world_size: int, setup: TuneSetup, out: str) -> list[dict[str, Any]]:
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    with (
        Recorder(out, run_id=setup.name, model=model, optimizer=optimizer, announce=False) as rec,
        rec.capture_cross_entropy(),
    ):
        for step, per_rank in enumerate(setup.counts):
            before = [p.detach().clone() for p in model.parameters()]
            num_tokens = torch.zeros((), dtype=torch.int64)
            for micro, count in enumerate(per_rank[rank]):
                tokens, labels, _ = microbatch(step, rank, micro, count)
                counted = (labels != IGNORE_INDEX).sum() + (1 if setup.before_shift else 0)
                num_tokens += counted
                logits = model(tokens)
                # CEWithChunkedOutputLoss: a sum per chunk, over the total, then times the count: S
                chunks = zip(logits.chunk(CHUNKS, dim=1), labels.chunk(CHUNKS, dim=1))
                total = sum(
                    F.cross_entropy(lg.reshape(-1, VOCAB), lb.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
                    for lg, lb in chunks
                )
                elements = (labels != IGNORE_INDEX).sum()
                (total / elements * counted).backward()  # type: ignore[operator, union-attr]
            dist.all_reduce(num_tokens)
            factor = (world_size if setup.scale == "w_over_n" else 1) / num_tokens.to(torch.float64)
            scale_grads(model, factor)
            if setup.told:
                rec.scale_grads(factor)
            history.append({"before": before, "grads": [p.grad.detach().clone() for p in model.parameters()]})
            optimizer.step()
            optimizer.zero_grad()
    return history
