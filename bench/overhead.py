"""Step-time overhead of Recorder + probe on a small transformer LM trained on the CPU.

One model, data and optimizer; steps rotate between the plain loop, the recorded loop and a control
loop that is the plain one again, so machine noise (a busy neighbour on 2 cores) hits all three alike.
The figure is the ratio of median step times, recorded over plain, then the same with the default shard
flush (every 4096 records) amortized, and the ratio of each fifth of the steps (how far noise moves it).
The control's ratio over plain is what two identical loops differ by in this process: under glibc's
default heap that is not 1 (the step re-faults its activations, by an amount the heap's layout decides).
`--processes K` runs the loops in K fresh processes and gives the mean of each ratio and its standard
error. Each part of the recorder is also timed alone, thousands of calls on one microbatch's tensors
(`parts`): what the recorder itself adds to a step, free of the noise between loops.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokaudit.hooks import Recorder
from tokaudit.hooks._columns import Slabs, pack
from tokaudit.hooks._probe import ProbeResult
from tokaudit.hooks._record import Record

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


class Phases:
    """Each part of a loop's steps, summed over the step's microbatches: where, in the loop, the recorder's time goes.
    Its parts timed alone (`parts`) run hot, thousands of calls in a row; here each runs once between the model's
    kernels, as in training."""

    NAMES = ("forward", "probe", "loss", "record", "backward", "optimizer", "zero_grad")

    def __init__(self) -> None:
        self.steps: dict[str, list[float]] = {name: [] for name in self.NAMES}
        self.current = dict.fromkeys(self.NAMES, 0.0)
        self.last = 0.0

    def start(self) -> None:
        self.current = dict.fromkeys(self.NAMES, 0.0)
        self.last = time.perf_counter()

    def mark(self, name: str) -> None:
        """The time since the last mark goes to `name`."""
        now = time.perf_counter()
        self.current[name] += now - self.last
        self.last = now

    def end(self) -> None:
        for name, took in self.current.items():
            self.steps[name].append(took)

    def medians_ms(self) -> dict[str, float]:
        return {name: statistics.median(took) * 1e3 for name, took in self.steps.items()}


def step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    rec: Recorder | None,
    phases: Phases | None = None,
) -> None:
    mark = phases.mark if phases is not None else (lambda name: None)
    if phases is not None:
        phases.start()
    step_tokens = sum((labels != -100).sum() for _, labels in data)  # N, counted before backward
    for tokens, labels in data:
        valid = labels != -100
        per_token = F.cross_entropy(
            model(tokens).reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="none"
        ).view_as(labels)
        mark("forward")
        if rec is not None:
            per_token = rec.probe(per_token, valid)
        mark("probe")
        loss_sum = (per_token * valid).sum()
        scalar = loss_sum / step_tokens
        mark("loss")
        if rec is not None:
            rec.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=scalar, positions=labels.numel())
        mark("record")
        torch.autograd.backward(scalar)
        mark("backward")
    optimizer.step()
    mark("optimizer")
    optimizer.zero_grad(set_to_none=True)  # the recorder packs the closed update here
    mark("zero_grad")
    if phases is not None:
        phases.end()


def measure(steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [batches(seed) for seed in range(8)]
    modes = ("plain", "recorded", "control")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    faults: dict[str, list[int]] = {mode: [] for mode in modes}  # pages first touched during the step
    phases = {mode: Phases() for mode in modes}
    with tempfile.TemporaryDirectory() as folder:
        rec = Recorder(folder, run_id="bench", optimizer=optimizer)
        for index in range(3):  # warm-up (first-call allocations, autograd caches, first shard write)
            step(model, optimizer, data[index % 8], None)
            step(model, optimizer, data[index % 8], rec)
        rec.flush()
        for index in range(len(modes) * steps):
            # each triple of steps (plain, recorded, control) runs on one batch, in an order that rotates so that
            # each loop takes each place in turn: P R C, R C P, C P R, ...
            triple, place = divmod(index, len(modes))
            mode = modes[(place + triple) % len(modes)]
            faulted = minor_faults()
            start = time.perf_counter()
            step(model, optimizer, data[triple % 8], rec if mode == "recorded" else None, phases[mode])
            times[mode].append(time.perf_counter() - start)
            faults[mode].append(minor_faults() - faulted)
        # The flush every 4096 records (default), amortized over the steps that filled it.
        records = steps * MICRO  # the recorded loop's, since the warm-up's flush
        start = time.perf_counter()
        rec.flush()
        flush_s = time.perf_counter() - start
        rec.close()
    plain, recorded = statistics.median(times["plain"]), statistics.median(times["recorded"])
    control = statistics.median(times["control"])
    amortized = flush_s / max(records, 1) * MICRO  # flush cost per record × records per step
    fifth = max(1, steps // 5)

    def fifths(loop: str) -> list[float]:
        return [
            statistics.median(times[loop][i : i + fifth]) / statistics.median(times["plain"][i : i + fifth])
            for i in range(0, fifth * 5, fifth)
        ]

    # The plain and the control loop are the same loop: recorded / ((plain + control) / 2) compares the recorded
    # loop with both, the recorder's cost with half the variance that one plain loop's heap layout adds.
    return {
        "plain_ms": plain * 1e3,
        "recorded_ms": recorded * 1e3,
        "ratio": recorded / plain,
        "ratio_to_both": recorded / ((plain + control) / 2),
        "flush_ms": flush_s * 1e3,
        "flush_records": records,
        "ratio_with_flush": (recorded + amortized) / plain,
        "block_ratios": fifths("recorded"),
        "control_ms": control * 1e3,
        "control_ratio": control / plain,
        "control_block_ratios": fifths("control"),
        "faults": {mode: statistics.fmean(counts) for mode, counts in faults.items()},
        "phases_ms": {mode: phases[mode].medians_ms() for mode in modes},
    }


def in_loop_line(result: dict[str, Any]) -> str:
    """What the recorder's own calls took in the loop (`measure`'s phases), as text: each part's median a step in
    the recorded loop less the plain loop's, and the step-time ratio the calls alone make. Forward and backward
    are shown beside the control loop's difference: there the heap's layout moves both loops."""
    phases = result["phases_ms"]
    more = {name: phases["recorded"][name] - phases["plain"][name] for name in Phases.NAMES}
    own = more["probe"] + more["record"] + more["zero_grad"]
    noise = {name: phases["control"][name] - phases["plain"][name] for name in ("forward", "backward")}
    return (
        f"in the loop, recorded − plain a step: probe {more['probe']:+.2f} ms, record {more['record']:+.2f} ms, "
        f"zero_grad (the update's pack) {more['zero_grad']:+.2f} ms: {own:.2f} ms, a ratio of "
        f"{1 + own / result['plain_ms']:.4f}; forward {more['forward']:+.2f} ms and backward "
        f"{more['backward']:+.2f} ms (the control loop's {noise['forward']:+.2f} and {noise['backward']:+.2f})"
    )


def minor_faults() -> int:
    """This process's minor page faults so far: each a fresh page the kernel maps and zeroes, what a step whose
    heap gave its blocks back pays to take them again."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _record_us(values: dict[str, Any], calls: int = 2000) -> float:
    """`Recorder.record` in µs per call, best of 5 loops of `calls` records into one open update (after one
    loop of warm-up), each loop on a recorder of its own: what one holds stays under a flush's worth."""
    best = math.inf
    for loop in range(6):
        with tempfile.TemporaryDirectory() as folder:
            with Recorder(folder, run_id="parts", flush_every=1 << 30, announce=False) as rec:
                rec.begin_step(0)
                start = time.perf_counter()
                for _ in range(calls):
                    rec.record(**values)
                took = (time.perf_counter() - start) / calls
        if loop:  # the first loop warms up
            best = min(best, took)
    return best * 1e6


def in_process(steps: int, keep_heap: bool) -> dict[str, Any]:
    """`measure` in a fresh process (`--json`); RuntimeError with its last line of stderr where it fails."""
    done = subprocess.run(
        [sys.executable, __file__, "--steps", str(steps), "--json", *(["--keep-heap"] if keep_heap else [])],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        raise RuntimeError(f"a process of the loops failed: {lines[-1]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def in_processes(processes: int, steps: int, keep_heap: bool) -> dict[str, Any]:
    """`measure` in `processes` fresh processes, one after the other: each ratio's mean over them and its
    standard error (s/√K), and every process's figures. A fresh process is a fresh heap layout: under glibc's
    defaults the control's ratio moves from process to process as much as the recorder's does."""
    runs = [in_process(steps, keep_heap) for _ in range(processes)]

    def mean_and_error(name: str) -> tuple[float, float]:
        values = [run[name] for run in runs]
        error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
        return statistics.fmean(values), error

    return {
        "processes": processes,
        "ratio": mean_and_error("ratio"),
        "control_ratio": mean_and_error("control_ratio"),
        "ratio_to_both": mean_and_error("ratio_to_both"),
        "runs": runs,
    }


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
    min, max of ∂b/∂ℓᵢ and the masked weight, on the device), `record` (values checked, kept
    detached on the device) and `pack` (its values and the probe's copied into the slab once the update
    closes)."""
    tokens, labels = batches(0)[0]
    valid = labels != -100
    logits = torch.randn(tokens.numel(), VOCAB, requires_grad=True)
    per_token = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="none").view_as(labels)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the last probe is left without its record
        with Recorder(folder, run_id="probe", flush_every=1 << 30, announce=False) as rec:
            rec.begin_step(0)  # step boundaries known, as an optimizer's hooks make them
            forward = _per_call_us(lambda: rec.probe(per_token, valid))
    grad, live = torch.randn(labels.shape), ~valid & (per_token.detach() != 0)
    backward = _per_call_us(lambda: ProbeResult().add(grad, valid, live))
    loss_sum = (per_token * valid).sum().detach()
    count, scalar = valid.sum(), loss_sum / 1000
    recorded = _record_us(
        {"loss_sum": loss_sum, "valid_tokens": count, "backward_scalar": scalar, "positions": labels.numel()}
    )
    probe = ProbeResult()
    probe.add(grad, valid, live)
    values: dict[str, Any] = {"loss_sum": loss_sum, "valid_tokens": count, "backward_scalar": scalar}
    held = [getattr(probe, name) for name in ProbeResult.VALUES]
    slabs = Slabs()

    def packed() -> None:
        # one microbatch's record and probe, packed as an update's close packs them (`Recorder._pack`)
        entry = Record(
            step=0,
            micro=0,
            term="0",
            **values,
            positions=None,
            reported_loss=None,
            skipped=None,
            grad_scale=None,
            loss_scale=None,
            prescaled=False,
            sync=None,
            time=0,
            probe=None,
            captured=False,
            bits=None,
        )
        result = ProbeResult()
        for name, value in zip(ProbeResult.VALUES, held):
            setattr(result, name, value)
        pack([(entry, name) for name in values] + [(result, name) for name in ProbeResult.VALUES], slabs)

    return {
        "probe_forward_us": forward,
        "probe_backward_us": backward,
        "record_us": recorded,
        "pack_us": _per_call_us(packed),
    }


def parts_per_step(cost: dict[str, float], plain_ms: float) -> tuple[float, float]:
    """The parts' ms per step of MICRO microbatches (each microbatch's probe and record, the pack once an
    update), and the step-time ratio they make on a plain step."""
    per_step = (MICRO * sum(us for name, us in cost.items() if name != "pack_us") + cost.get("pack_us", 0.0)) / 1e3
    return per_step, 1 + per_step / plain_ms


def faults_line(result: dict[str, Any]) -> str:
    """Each loop's mean minor page faults a step (`measure`), as text."""
    faults = result["faults"]
    return f"page faults a step: plain {faults['plain']:.0f}, recorded {faults['recorded']:.0f}, control {faults['control']:.0f}"


def keep_large_blocks() -> bool:
    """glibc's mallopt: blocks up to 16 MiB come from the heap and go back to it, and the heap keeps up to
    64 MiB free at its top, so that neither loop's step faults in fresh pages. False off glibc or where a
    MALLOC_* variable tunes it."""
    import ctypes
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        return bool(libc.mallopt(m_mmap_threshold, 16 << 20)) and bool(libc.mallopt(m_trim_threshold, 64 << 20))
    except (OSError, AttributeError):
        return False


def _in_fresh_processes(processes: int, steps: int, keep_heap: bool, as_json: bool) -> None:
    """The loops in fresh processes: each ratio, then their mean and standard error."""
    try:
        summary = in_processes(processes, steps, keep_heap)
    except RuntimeError as error:
        raise SystemExit(f"overhead.py: {error}") from None
    if as_json:
        print(json.dumps(summary))
        return
    for run in summary["runs"]:
        print(
            f"process: recorded/plain {run['ratio']:.4f}, control/plain {run['control_ratio']:.4f}, "
            f"recorded/both {run['ratio_to_both']:.4f} (plain {run['plain_ms']:.1f} ms; {faults_line(run)})"
        )
    (ratio, ratio_error), (control, control_error) = summary["ratio"], summary["control_ratio"]
    both, both_error = summary["ratio_to_both"]
    print(
        f"mean of {processes} processes: recorded/plain {ratio:.4f} ± {ratio_error:.4f}, "
        f"control/plain {control:.4f} ± {control_error:.4f}, recorded/both plain loops {both:.4f} ± "
        f"{both_error:.4f} (± one standard error)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150, help="steps per loop")
    parser.add_argument(
        "--keep-heap",
        action="store_true",
        help="glibc's heap set to keep large blocks rather than map and unmap them at every step (steadier step times)",
    )
    parser.add_argument("--json", action="store_true", help="the loops' figures as one JSON object, no parts")
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        metavar="K",
        help="run the loops in K fresh processes and print each ratio's mean and standard error",
    )
    args = parser.parse_args()
    if args.processes:
        if args.processes < 2:
            parser.error("--processes takes 2 or more (a standard error needs two runs)")
        _in_fresh_processes(args.processes, args.steps, args.keep_heap, args.json)
        return
    if args.keep_heap:
        # Under glibc's defaults this CPU step maps and unmaps its activations: 6,000–8,000 page faults a
        # step in either loop, and step times that swing with the heap's layout, which the recorder's own
        # small tensors move. Kept, neither loop faults.
        if not keep_large_blocks():
            parser.error("glibc's heap cannot be set here (not glibc, or a MALLOC_* variable set)")
    torch.set_num_threads(2)
    result = measure(args.steps)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"median step: plain {result['plain_ms']:.1f} ms, recorded {result['recorded_ms']:.1f} ms, "
        f"ratio {result['ratio']:.4f} (with flushes amortized {result['ratio_with_flush']:.4f}; "
        f"per fifth of the steps {', '.join(f'{r:.3f}' for r in result['block_ratios'])}); "
        f"control (the plain loop again) {result['control_ratio']:.4f}; recorded against both plain loops "
        f"{result['ratio_to_both']:.4f}; {faults_line(result)}"
    )
    print(in_loop_line(result))
    cost = parts()
    per_step, ratio = parts_per_step(cost, result["plain_ms"])
    print(
        ", ".join(f"{name[:-3]} {value:.0f} µs" for name, value in cost.items())
        + f" per microbatch: {per_step:.2f} ms per step of {MICRO} microbatches, ratio {ratio:.4f}"
    )


if __name__ == "__main__":
    main()
