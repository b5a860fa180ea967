"""A complete DDP training loop with the token-mean objective, recorded by tokaudit.

    torchrun --nproc-per-node 2 examples/torchrun_token_mean.py --log-dir runs --steps 20
    tokaudit check runs/token_mean          # → correct

Ranks get sequences of different lengths (padding) and different numbers of ignored labels, and
one rank sometimes gets only padding: exactly where a mean of local means goes wrong.
Runs on the CPU with gloo (or NCCL on GPUs: pass --backend nccl).
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tokaudit.hooks import Recorder, global_valid_tokens, is_empty_update, reported_token_mean, token_mean_loss

VOCAB, WIDTH, SEQ, BATCH, IGNORE = 64, 32, 16, 4, -100


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels with padding (IGNORE) after a random length; some microbatches are all padding."""
    generator = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    longest = 0 if (step + rank) % 5 == 0 and micro == 0 else SEQ
    lengths = torch.randint(0, longest + 1, (BATCH, 1), generator=generator)
    labels[torch.arange(SEQ)[None, :] >= lengths] = IGNORE
    return tokens, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--log-dir", default="runs")
    parser.add_argument("--run-id", default="token_mean")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument(
        "--mistake",
        choices=["none", "local-mean"],
        default="none",
        help="local-mean: backpropagate each microbatch's own mean, to see tokaudit catch it",
    )
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.backend == "nccl" else torch.device("cpu")
    )
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(args.log_dir, run_id=args.run_id, model=model, optimizer=optimizer)

    for step in range(args.steps):
        data = [batch(step, rank, micro) for micro in range(args.accumulation)]
        # N over every microbatch of every rank, before the first backward: one all-reduce.
        tokens_n = global_valid_tokens([labels for _, labels in data], device=device)
        local_sum = torch.zeros((), device=device)
        for micro, (tokens, labels) in enumerate(data):
            tokens, labels = tokens.to(device), labels.to(device)
            valid = labels != IGNORE
            last = micro == len(data) - 1
            with nullcontext() if last else model.no_sync():  # one all-reduce per step
                logits = model(tokens)
                per_token = F.cross_entropy(
                    logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none"
                ).view_as(labels)
                per_token = rec.probe(per_token, valid)
                loss_sum = (per_token * valid).sum()  # an all-padding microbatch gives 0, still connected
                if args.mistake == "local-mean":  # the common mistake: loss.mean() per microbatch
                    scalar = loss_sum / valid.sum().clamp(min=1) / len(data)
                else:
                    scalar = token_mean_loss(loss_sum, tokens_n)  # W·S/N into DDP's average
                scalar.backward()
            local_sum += loss_sum.detach()
            reported = reported_token_mean(local_sum, tokens_n) if last else None  # every rank joins
            rec.record(
                loss_sum=loss_sum,
                valid_tokens=valid.sum(),
                backward_scalar=scalar,
                positions=labels.numel(),
                reported_loss=reported,
            )
        if is_empty_update(tokens_n):  # the same N everywhere: every rank skips together
            optimizer.zero_grad()
            rec.end_step(skipped=True)
            continue
        optimizer.step()
        optimizer.zero_grad()
    rec.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
