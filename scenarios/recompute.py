"""Activation checkpointing with the probe inside the checkpointed function, in real DDP: the head and the
per-token loss are recomputed in backward (reentrant or not), `rec.record` is called before `backward()`.
The loss is the token mean W·S_r/N; each job returns, per step, the parameters before it and the gradient."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from scenarios.strategies import IGNORE_INDEX, VOCAB, make_model, microbatch
from tokaudit.hooks import Recorder

COUNTS = (((1, 7), (5, 2)), ((3, 3), (8, 2)))  # counts[step][rank][micro]


class Checkpointed(torch.nn.Module):
    """The strategies' TinyLM with its head and per-token loss checkpointed, the probe inside: forward returns
    the microbatch's loss sum S."""

    def __init__(self, recorder: Recorder | None, reentrant: bool, captured: bool = False) -> None:
        super().__init__()
        self.lm = make_model()
        self.recorder, self.reentrant, self.captured = recorder, reentrant, captured

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        valid = labels.reshape(-1) != IGNORE_INDEX
        per_token = F.cross_entropy(
            self.lm.head(torch.tanh(hidden)).reshape(-1, VOCAB),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        if self.captured:  # the cross-entropy call is the record (capture_cross_entropy)
            return per_token.sum()
        assert self.recorder is not None
        return self.recorder.probe(per_token, valid).sum()

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum: torch.Tensor = checkpoint(self.head_loss, self.lm.embed(tokens), labels, use_reentrant=self.reentrant)
        return loss_sum


def job(rank: int, world_size: int, variant: str, out: str) -> dict[str, Any]:
    """`variant`: reentrant, non_reentrant (the probe and rec.record), or captured (non-reentrant, the cross-entropy
    captured: the recomputation in backward runs it again and stops from inside the capture's own tensors)."""
    name = f"checkpoint_{variant}"
    history = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DDP(Checkpointed(None, variant == "reentrant", captured=variant == "captured"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        with Recorder(out, run_id=name, model=model, optimizer=optimizer, announce=False) as rec:
            model.module.recorder = rec
            capture = rec.capture_cross_entropy() if variant == "captured" else contextlib.nullcontext()
            with capture:
                _train(rank, world_size, model, optimizer, rec, variant == "captured", history)
    ours = [str(w.message) for w in caught if "tokaudit" in str(w.message)]
    return {"history": history, "warnings": ours}


def _train(
    rank: int, world_size: int, model: Any, optimizer: Any, rec: Recorder, captured: bool, history: list[Any]
) -> None:
    for step, per_rank in enumerate(COUNTS):
        before = [p.detach().clone() for p in model.parameters()]
        tokens_n = sum(sum(counts) for counts in per_rank)
        for micro, count in enumerate(per_rank[rank]):
            tokens, labels, valid = microbatch(step, rank, micro, count)
            loss_sum = model(tokens, labels)
            backward_scalar = world_size * loss_sum / tokens_n
            if not captured:
                rec.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=backward_scalar)
            backward_scalar.backward()
        history.append({"before": before, "grads": [p.grad.detach().clone() for p in model.parameters()]})
        optimizer.step()
        optimizer.zero_grad()
