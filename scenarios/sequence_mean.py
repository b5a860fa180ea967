"""A per-sequence mean, as GRPO-style losses are written: each sequence's loss is its own mean over its valid
tokens, the microbatch's loss the mean over its sequences, and DDP averages the ranks. With as many sequences on
every rank, every sequence weighs 1/(W·B) and each of its tokens 1/(W·B·n_s): a per-sequence objective, chosen on
purpose, not a token mean. Probed and recorded by hand in real DDP.

The job returns, per step, the parameters before it and the gradient the optimizer saw.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from scenarios.strategies import IGNORE_INDEX, VOCAB, loaded, make_model, microbatch
from tokaudit.hooks import Recorder

COUNTS = (((2, 7), (5, 3)), ((8, 1), (4, 6)))
"""counts[step][rank]: each sequence's valid tokens, two sequences a rank, one microbatch a step."""


def sequences(step: int, rank: int, counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's sequences as rows of one batch: tokens and labels (IGNORE_INDEX where not valid)."""
    rows = [microbatch(step, rank, row, count) for row, count in enumerate(counts)]
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


def per_token(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)


def reference_gradient(params: list[torch.Tensor], step: int, world_size: int) -> list[torch.Tensor]:
    """Single process, float64: ∇ Σ_seq S_seq/(n_seq·W·B), every sequence of the step weighed alike."""
    model = loaded(make_model(), params)
    total = torch.zeros((), dtype=torch.float64)
    for rank, counts in enumerate(COUNTS[step]):
        tokens, labels = sequences(step, rank, counts)
        losses = per_token(model, tokens, labels)
        for row, count in enumerate(counts):
            total = total + losses[row].sum() / (count * world_size * len(counts))
    total.backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def job(rank: int, world_size: int, out: str) -> list[dict[str, Any]]:
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    with Recorder(out, run_id="sequence_mean", model=model, optimizer=optimizer, announce=False) as rec:
        for step, per_rank in enumerate(COUNTS):
            before = [p.detach().clone() for p in model.parameters()]
            tokens, labels = sequences(step, rank, per_rank[rank])
            valid = labels != IGNORE_INDEX
            losses = rec.probe(per_token(model, tokens, labels), valid)
            # each sequence's mean, then the mean over the sequences
            loss = ((losses * valid).sum(dim=1) / valid.sum(dim=1)).mean()
            rec.record(loss_sum=(losses * valid).sum(), valid_tokens=valid.sum(), backward_scalar=loss)
            loss.backward()
            history.append({"before": before, "grads": [p.grad.detach().clone() for p in model.parameters()]})
            optimizer.step()
            optimizer.zero_grad()
    return history
