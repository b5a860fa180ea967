"""An Accelerate training loop, launched like `accelerate launch` does it (torchrun, 2 CPU processes,
gloo), with gradient accumulation 2, recorded with `Recorder(accelerator=...)`.

    torchrun --standalone --nproc-per-node 2 -m scenarios.accelerate_job --log-dir runs --variant token_mean

Variants:
- token_mean: GA·W·S/N, N the valid tokens of the whole update (both microbatches, both ranks),
  counted before the first backward; accelerator.backward divides by GA and DDP averages over W,
  so the reduced gradient is ∇ΣS/N.
- local_mean: Accelerate's usual `loss = per_token[valid].mean()`; accelerator.backward divides it
  by GA: each microbatch weighs the same whatever its count.
- manual_no_sync: docs/integrations.md's loop: GA·W·S/N, each update's microbatches drawn first and every one but
  the last under `accelerator.no_sync(model)`, one optimizer step per update, the last update short.
- all_no_sync: the same with every microbatch under `no_sync()`: each rank steps on its own gradient.

Rank 0 saves, per update, the parameters before it and the reduced gradient the optimizer saw
(float64) to `<log-dir>/<variant>.pt`, for the test's single-process reference.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path

import torch

from scenarios.strategies import microbatch, per_token_loss
from scenarios.strategies import make_model as make_tiny_lm
from tokaudit.hooks import Recorder, global_valid_tokens

# Valid tokens per step, rank and microbatch: uneven, so a local mean is not the token mean.
COUNTS = (((5, 1), (3, 7)), ((2, 6), (6, 1)), ((8, 4), (2, 8)))

MANUAL_COUNTS = (*COUNTS, ((3,), (5,)))
"""The loops that sync by hand end on a short update: one microbatch where GA is 2."""


def main() -> None:
    from accelerate import Accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--log-dir", required=True)
    parser.add_argument(
        "--variant", choices=("token_mean", "local_mean", "manual_no_sync", "all_no_sync"), required=True
    )
    args = parser.parse_args()
    if args.variant.endswith("no_sync"):
        return manual(args.log_dir, args.variant)

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = make_tiny_lm()  # float64, the same start in every process
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    recorder = Recorder(args.log_dir, run_id=f"accelerate_{args.variant}", accelerator=accelerator)

    rank, world_size = accelerator.process_index, accelerator.num_processes
    history = []
    for step, per_rank in enumerate(COUNTS):
        batches = [microbatch(step, rank, micro, count) for micro, count in enumerate(per_rank[rank])]
        global_tokens = global_valid_tokens([labels for _, labels, _ in batches])  # one all-reduce
        before = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
        grads: list[torch.Tensor] = []
        for tokens, labels, valid in batches:
            with accelerator.accumulate(model):
                per_token = recorder.probe(per_token_loss(model, tokens, labels), valid)
                loss_sum = (per_token * valid).sum()
                if args.variant == "token_mean":
                    loss = accelerator.gradient_accumulation_steps * world_size * loss_sum / global_tokens
                else:
                    loss = loss_sum / valid.sum()
                recorder.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=loss)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
                optimizer.step()  # steps the SGD only on the update's last microbatch
                optimizer.zero_grad()
        history.append({"before": before, "grads": grads})
    recorder.close()
    if rank == 0:
        torch.save(history, Path(args.log_dir) / f"{args.variant}.pt")
    accelerator.end_training()
    del model, optimizer


def manual(log_dir: str, variant: str) -> None:
    """The loop accumulating by hand: `no_sync()` on the model Accelerate prepared (its DDP wrapper), which the
    recorder finds from the bare module Accelerate keeps; one optimizer step per update."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    bare = make_tiny_lm()
    model, optimizer = accelerator.prepare(bare, torch.optim.SGD(bare.parameters(), lr=0.5))
    recorder = Recorder(log_dir, run_id=f"accelerate_{variant}", accelerator=accelerator)
    rank, world_size = accelerator.process_index, accelerator.num_processes
    history = []
    for step, per_rank in enumerate(MANUAL_COUNTS):
        batches = [microbatch(step, rank, micro, count) for micro, count in enumerate(per_rank[rank])]
        global_tokens = global_valid_tokens([labels for _, labels, _ in batches])
        before = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
        for micro, (tokens, labels, valid) in enumerate(batches):
            synced = micro == len(batches) - 1 and variant == "manual_no_sync"
            with nullcontext() if synced else accelerator.no_sync(model):
                per_token = recorder.probe(per_token_loss(model, tokens, labels), valid)
                loss_sum = (per_token * valid).sum()
                loss = accelerator.gradient_accumulation_steps * world_size * loss_sum / global_tokens
                recorder.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=loss)
                accelerator.backward(loss)
        history.append({"before": before, "grads": [p.grad.detach().clone() for p in model.parameters()]})
        optimizer.step()
        optimizer.zero_grad()
    recorder.close()
    if rank == 0:
        torch.save(history, Path(log_dir) / f"{variant}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
