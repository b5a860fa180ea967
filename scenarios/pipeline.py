"""A two-stage `torch.distributed.pipelining` run on two gloo processes: rank 0 holds the embedding, rank 1 the
LM head and the loss, recorded with `Recorder(..., schedule=schedule)` inside the schedule's `loss_fn`.

Each job trains a float64 model and returns, per update, its stage's parameters before the update and the
gradients the optimizer saw, so a test can compare them with a single-process float64 reference of the token
mean over the update's tokens (every microbatch of every `step()` call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scenarios.strategies import loaded
from tokaudit.hooks import Recorder

VOCAB, WIDTH, SEQ, ROWS, IGNORE_INDEX = 13, 8, 6, 4, -100
"""Vocabulary, width, sequence length, rows per step() call (split into the schedule's microbatches)."""
UPDATES = 2


@dataclass(frozen=True)
class PipelineSetup:
    name: str
    schedule: str
    """gpipe or 1f1b."""
    scale_grads: bool
    """The schedule divides every gradient by its microbatches after each step() (torch's default)."""
    calls: int
    """step() calls per optimizer update (gradient accumulation over calls)."""
    loss: str
    """sum_over_n: S_m/N, N the update's valid tokens; scaled: M·S_m/N (undone by scale_grads); captured_mean:
    F.cross_entropy's own mean over the microbatch, captured (a local mean)."""
    microbatches: int = 2
    grouped: bool = True
    """The Recorder given the loss's data-parallel group (the last stage alone); False: none, so W is the world's."""


def make_model() -> tuple[nn.Embedding, nn.Linear]:
    torch.manual_seed(0)
    return nn.Embedding(VOCAB, WIDTH, dtype=torch.float64), nn.Linear(WIDTH, VOCAB, dtype=torch.float64)


def batch(update: int, call: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels of one step() call; labels ignored unevenly, so microbatches hold different counts."""
    generator = torch.Generator().manual_seed(1000 * update + call)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    cut = torch.arange(SEQ).expand(ROWS, SEQ) >= torch.tensor([SEQ, 1, SEQ - 2, 3]).unsqueeze(1)
    return tokens, labels.masked_fill(cut | (labels % 4 == 0), IGNORE_INDEX)


def update_tokens(update: int, calls: int) -> int:
    return sum(int((batch(update, call)[1] != IGNORE_INDEX).sum()) for call in range(calls))


def reference_gradient(params: list[torch.Tensor], update: int, calls: int) -> list[torch.Tensor]:
    """Single process, float64: ∇ ΣS/N over every token of the update."""
    embedding, head = make_model()
    model = loaded(nn.Sequential(embedding, head), params)
    objective = torch.zeros((), dtype=torch.float64)
    for call in range(calls):
        tokens, labels = batch(update, call)
        objective = objective + F.cross_entropy(
            model(tokens).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
    (objective / update_tokens(update, calls)).backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def job(rank: int, world_size: int, setup: PipelineSetup, out: str) -> list[dict[str, Any]]:
    """One set-up on both stages; per update, this stage's parameters before it and its gradients."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    module: nn.Module = make_model()[rank]
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    last_group = dist.new_group([1])  # the loss's data-parallel group: the last stage alone
    tokens_now = [0]
    recorder: Recorder | None = None

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert recorder is not None
        flat, targets = logits.reshape(-1, VOCAB), labels.reshape(-1)
        if setup.loss == "captured_mean":
            with recorder.capture_cross_entropy():
                return F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX)
        valid = targets != IGNORE_INDEX
        per_token = recorder.probe(F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="none"), valid)
        loss_sum = per_token.sum()
        scale = setup.microbatches if setup.loss == "scaled" else 1
        backward_scalar = scale * loss_sum / tokens_now[0]
        recorder.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=backward_scalar)
        return backward_scalar

    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    schedule = kinds[setup.schedule](
        stage, n_microbatches=setup.microbatches, loss_fn=loss_fn, scale_grads=setup.scale_grads
    )
    if rank == 1:
        recorder = Recorder(
            out,
            run_id=setup.name,
            optimizer=optimizer,
            group=last_group if setup.grouped else None,
            schedule=schedule,
            announce=False,
        )
    history = []
    for update in range(UPDATES):
        before = [p.detach().clone() for p in module.parameters()]
        tokens_now[0] = update_tokens(update, setup.calls)
        for call in range(setup.calls):
            tokens, labels = batch(update, call)
            if rank == 0:
                schedule.step(tokens)
            else:
                schedule.step(target=labels)
        history.append({"before": before, "grads": [p.grad.detach().clone() for p in module.parameters()]})
        optimizer.step()
        optimizer.zero_grad()
    if recorder is not None:
        recorder.close()
    dist.barrier()
    return history
