"""Step-time overhead of Recorder + probe on a small transformer LM trained on the CPU.

One model, data and optimizer; steps alternate between the plain and the recorded loop, so
machine noise (a busy neighbour on 2 cores) hits both alike. The figure is the ratio of
median step times, then the same with the default shard flush (every 4096 records) amortized,
and the ratio of each fifth of the steps (how far noise moves it). Each part of the recorder is
also timed alone, thousands of calls on one microbatch's tensors (`parts`): what the recorder
itself adds to a step, free of the noise between two loops.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokaudit.hooks import Recorder
from tokaudit.hooks.probe import ProbeResult

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH, MICRO = 2048, 128, 4, 2, 128, 8, 2


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens), mask=self.mask, is_causal=True))  # type: ignore[no-any-return]


def batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(MICRO):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.roll(tokens, -1, dims=1)
        lengths = torch.randint(SEQ // 4, SEQ, (BATCH, 1), generator=generator)
        labels[torch.arange(SEQ)[None, :] >= lengths] = -100  # padding
        out.append((tokens, labels))
    return out


def step(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[tuple[torch.Tensor, torch.Tensor]],
         rec: Recorder | None) -> None:
    step_tokens = sum((labels != -100).sum() for _, labels in data)  # N, counted before backward
    for tokens, labels in data:
        valid = labels != -100
        per_token = F.cross_entropy(model(tokens).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100,
                                    reduction="none").view_as(labels)
        if rec is not None:
            per_token = rec.probe(per_token, valid)
        loss_sum = (per_token * valid).sum()
        scalar = loss_sum / step_tokens
        if rec is not None:
            rec.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=scalar, positions=labels.numel())
        scalar.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [batches(seed) for seed in range(8)]
    times: dict[str, list[float]] = {"plain": [], "recorded": []}
    with tempfile.TemporaryDirectory() as folder:
        rec = Recorder(folder, run_id="bench", optimizer=optimizer)
        for index in range(3):  # warm-up (first-call allocations, autograd caches, first shard write)
            step(model, optimizer, data[index % 8], None)
            step(model, optimizer, data[index % 8], rec)
        rec.flush()
        for index in range(2 * steps):
            mode = ("plain", "recorded")[(index + index // 2) % 2]  # plain, recorded, recorded, plain, ...
            start = time.perf_counter()
            # each pair of steps (one plain, one recorded) runs on one batch: both loops see every batch alike
            step(model, optimizer, data[(index // 2) % 8], rec if mode == "recorded" else None)
            times[mode].append(time.perf_counter() - start)
        # The flush every 4096 records (default), amortized over the steps that filled it.
        records = len(rec._records)
        start = time.perf_counter()
        rec.flush()
        flush_s = time.perf_counter() - start
        rec.close()
    plain, recorded = statistics.median(times["plain"]), statistics.median(times["recorded"])
    amortized = flush_s / max(records, 1) * MICRO  # flush cost per record × records per step
    fifth = max(1, steps // 5)
    blocks = [statistics.median(times["recorded"][i:i + fifth]) / statistics.median(times["plain"][i:i + fifth])
              for i in range(0, fifth * 5, fifth)]
    return {"plain_ms": plain * 1e3, "recorded_ms": recorded * 1e3, "ratio": recorded / plain,
            "flush_ms": flush_s * 1e3, "flush_records": records,
            "ratio_with_flush": (recorded + amortized) / plain, "block_ratios": blocks}


def _per_call_us(call: Callable[[], object], calls: int = 2000) -> float:
    """Best of 5 loops of `calls` calls, in µs per call."""
    for _ in range(100):
        call()
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def parts() -> dict[str, float]:
    """µs per microbatch of each recorder part, on the benchmark's tensors (8×128 tokens): the
    probe's forward (mask of masked positions with a loss, the autograd node), its backward (Σ,
    min, max of ∂b/∂ℓᵢ and the masked weight, on the device) and `record` (values checked, kept
    detached on the device)."""
    tokens, labels = batches(0)[0]
    valid = labels != -100
    logits = torch.randn(tokens.numel(), VOCAB, requires_grad=True)
    per_token = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="none").view_as(labels)
    with tempfile.TemporaryDirectory() as folder:
        rec = Recorder(folder, run_id="parts", flush_every=1 << 30)
        forward = _per_call_us(lambda: rec.probe(per_token, valid))
        rec._pending_probe = None
        grad, live = torch.randn(labels.shape), ~valid & (per_token.detach() != 0)
        backward = _per_call_us(lambda: ProbeResult().add(grad, valid, live))
        loss_sum = (per_token * valid).sum().detach()
        count, scalar = valid.sum(), loss_sum / 1000

        def record() -> None:
            rec.record(loss_sum=loss_sum, valid_tokens=count, backward_scalar=scalar, positions=labels.numel())
            if len(rec._records) > 4096:
                rec._records.clear()

        recorded = _per_call_us(record)
        rec._records.clear()
        rec.close()
    return {"probe_forward_us": forward, "probe_backward_us": backward, "record_us": recorded}


def parts_per_step(cost: dict[str, float], plain_ms: float) -> tuple[float, float]:
    """The parts' ms per step of MICRO microbatches, and the step-time ratio they make on a plain step."""
    per_step = MICRO * sum(cost.values()) / 1e3
    return per_step, 1 + per_step / plain_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150, help="steps per loop")
    parser.add_argument("--keep-heap", action="store_true",
                        help="glibc's heap set as the tokaudit command line sets its own (tokaudit.heap): large "
                             "blocks kept rather than mapped and unmapped at every step")
    parser.add_argument("--json", action="store_true", help="the loops' figures as one JSON object, no parts")
    args = parser.parse_args()
    if args.keep_heap:
        # Under glibc's defaults this CPU step maps and unmaps its activations: 6,000–8,000 page faults a
        # step in either loop, and step times that swing with the heap's layout, which the recorder's own
        # small tensors move. Kept, neither loop faults.
        from tokaudit.heap import keep_large_blocks

        if not keep_large_blocks():
            parser.error("glibc's heap cannot be set here (not glibc, or a MALLOC_* variable set)")
    torch.set_num_threads(2)
    result = measure(args.steps)
    if args.json:
        print(json.dumps(result))
        return
    print(f"median step: plain {result['plain_ms']:.1f} ms, recorded {result['recorded_ms']:.1f} ms, "
          f"ratio {result['ratio']:.4f} (with flushes amortized {result['ratio_with_flush']:.4f}; "
          f"per fifth of the steps {', '.join(f'{r:.3f}' for r in result['block_ratios'])})")
    cost = parts()
    per_step, ratio = parts_per_step(cost, result["plain_ms"])
    print(", ".join(f"{name[:-3]} {value:.0f} µs" for name, value in cost.items())
          + f" per microbatch: {per_step:.2f} ms per step of {MICRO} microbatches, ratio {ratio:.4f}")


if __name__ == "__main__":
    main()
