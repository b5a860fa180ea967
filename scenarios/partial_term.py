"""An auxiliary loss of data only one rank has, in real DDP: both ranks train the main loss, each token 1/N of the
step's N; rank 0 alone has auxiliary tokens (image tokens in its batch, say) and trains an auxiliary head on them,
each token 1/N_aux of its own count; rank 1 never runs that head (DDP's find_unused_parameters=True). Each job
returns, per step, the parameters before it and the gradient; the float64 reference is the main token mean plus the
auxiliary one, in one process."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scenarios.strategies import IGNORE_INDEX, VOCAB, WIDTH, TinyLM, loaded, microbatch
from tokaudit.hooks import Recorder

COUNTS = (((5, 1), (3, 7)), ((2, 6), (6, 2)), ((8, 4), (2, 8)))  # main: counts[step][rank][micro]
AUX = ((3, 4), (2, 5), (6, 1))  # rank 0's auxiliary tokens: aux[step][micro]; rank 1 has none


class WithAux(nn.Module):
    """TinyLM and an auxiliary head on the same features, run only where a microbatch has auxiliary tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TinyLM()
        self.aux = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, aux: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        features = torch.tanh(self.lm.embed(tokens))
        return self.lm.head(features), self.aux(features) if aux else None


def make_model() -> WithAux:
    torch.manual_seed(1234)
    return WithAux().double()


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")


def _aux_labels(step: int, micro: int) -> tuple[torch.Tensor, int]:
    """Rank 0's auxiliary labels of a microbatch (its own draw, the same in every process) and their count."""
    count = AUX[step][micro]
    _, labels, _ = microbatch(step, 7, micro, count)
    return labels, count


def job(rank: int, world_size: int, out: str) -> dict[str, Any]:
    model = DDP(make_model(), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    with Recorder(out, run_id="partial_term", model=model, optimizer=optimizer, announce=False) as rec:
        for step, per_rank in enumerate(COUNTS):
            before = [p.detach().clone() for p in model.parameters()]
            counts = torch.tensor([float(sum(per_rank[rank])), float(sum(AUX[step]) if rank == 0 else 0)])
            dist.all_reduce(counts)  # N and N_aux over every rank and microbatch
            tokens_n, aux_n = counts[0].double(), counts[1].double()
            for micro, count in enumerate(per_rank[rank]):
                last = micro == len(per_rank[rank]) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    tokens, labels, _ = microbatch(step, rank, micro, count)
                    logits, aux_logits = model(tokens, rank == 0)
                    loss_sum = _token_losses(logits, labels).sum()
                    scalar = world_size * loss_sum / tokens_n  # b = W·S/N
                    rec.record(loss_sum=loss_sum, valid_tokens=count, backward_scalar=scalar)
                    if aux_logits is not None:
                        aux_labels, aux_count = _aux_labels(step, micro)
                        aux_sum = _token_losses(aux_logits, aux_labels).sum()
                        aux_scalar = world_size * aux_sum / aux_n  # b = W·S_aux/N_aux
                        rec.record(loss_sum=aux_sum, valid_tokens=aux_count, backward_scalar=aux_scalar, term="aux")
                        scalar = scalar + aux_scalar
                    scalar.backward()
            history.append({"before": before, "grads": [p.grad.detach().clone() for p in model.parameters()]})
            optimizer.step()
            optimizer.zero_grad()
    return {"history": history}


def reference_gradient(before: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """The main token mean over every rank and microbatch plus the auxiliary one over rank 0's, in float64."""
    model = loaded(make_model(), before)
    main = torch.zeros((), dtype=torch.float64)
    aux = torch.zeros((), dtype=torch.float64)
    for rank, counts in enumerate(COUNTS[step]):
        for micro, count in enumerate(counts):
            tokens, labels, _ = microbatch(step, rank, micro, count)
            logits, aux_logits = model(tokens, rank == 0)
            main = main + _token_losses(logits, labels).sum()
            if aux_logits is not None:
                aux = aux + _token_losses(aux_logits, _aux_labels(step, micro)[0]).sum()
    (main / sum(sum(c) for c in COUNTS[step]) + aux / sum(AUX[step])).backward()
    return [p.grad.detach().clone() for p in model.parameters()]
