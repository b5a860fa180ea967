"""A torchtitan-style loop recorded by tokaudit: FSDP2 with a summing reduce-scatter, the global
valid-token count all-reduced before the first backward, the per-token loss under torch.compile.

    torchrun --nproc-per-node 2 examples/torchtitan_style.py --log-dir runs --steps 8
    tokaudit check runs/torchtitan_style          # → correct

As torchtitan (PR #2206) does it: every microbatch of the step is fetched first, N = Σ valid tokens
over all microbatches and ranks is one all-reduce, each microbatch backpropagates S/N, and the
gradient reduction sums (set_gradient_divide_factor(1.0), D = 1). The compiled function returns the
per-token loss; the probe sits outside it, so compiling is not broken.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from tokaudit.hooks import Recorder, global_valid_tokens, reported_token_mean, token_mean_loss

VOCAB, WIDTH, SEQ, BATCH, IGNORE = 64, 32, 16, 4, -100


def batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token labels; SFT-style masking leaves each rank a different number of valid labels."""
    generator = torch.Generator().manual_seed(7_919 * step + 101 * rank + micro)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    prompt = torch.randint(1, SEQ, (BATCH, 1), generator=generator)  # the prompt is not supervised
    labels[torch.arange(SEQ)[None, :] < prompt] = IGNORE
    labels[:, -1] = IGNORE
    return tokens, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--log-dir", default="runs")
    parser.add_argument("--run-id", default="torchtitan_style")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile's backend (aot_eager: traced the same way, no C++ compiler needed)",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB))
    # gloo has no PREMUL_SUM, which FSDP2 uses for a custom divide factor in float32; in float64 it
    # divides before and after a plain SUM instead (on GPUs with NCCL keep float32/bf16).
    model = model.double()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    for module in model.modules():  # every FSDP module's reduce-scatter sums (torchtitan's
        if isinstance(module, FSDPModule):  # disable_fsdp_gradient_division): D = 1, so backpropagate S/N
            module.set_gradient_divide_factor(1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = Recorder(args.log_dir, run_id=args.run_id, model=model, optimizer=optimizer)  # D read from FSDP2

    def per_token_loss(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")

    loss_fn = per_token_loss if args.no_compile else torch.compile(per_token_loss, backend=args.compile_backend)
    for step in range(args.steps):
        data = [batch(step, rank, micro) for micro in range(args.accumulation)]
        # global_valid_tokens = Σ over every microbatch of every rank, before the first backward
        tokens_n = global_valid_tokens([labels for _, labels in data])
        local_sum = torch.zeros((), dtype=torch.float64)
        for micro, (tokens, labels) in enumerate(data):
            model.set_requires_gradient_sync(micro == len(data) - 1)  # reduce-scatter once per step
            valid = labels.flatten() != IGNORE
            per_token = rec.probe(loss_fn(tokens, labels), valid)
            loss_sum = (per_token * valid).sum()
            scalar = token_mean_loss(loss_sum, tokens_n, reduction="sum")  # S/N into a summing reduction
            scalar.backward()
            local_sum += loss_sum.detach()
            last = micro == len(data) - 1
            # global_avg_loss = Σ_r S_r / N, from detached sums (every rank joins the all-reduce)
            reported = reported_token_mean(local_sum, tokens_n) if last else None
            rec.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=scalar, reported_loss=reported)
        optimizer.step()
        optimizer.zero_grad()
    rec.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
