"""Training set-ups people run, in real DDP: mixed precision (GradScaler), skipped updates, several
loss terms (an auxiliary head, chunked cross-entropy, multi-token prediction), a comm hook the
recorder cannot see, an elastic resize that keeps a stale W.

Each job trains a float64 model and returns, per step, the parameters before it and the reduced
gradient the optimizer saw (unscaled), so a test can compare it with a single-process float64
reference of the intended objective. The recordings are then audited.
"""

from __future__ import annotations

import gc
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scenarios.strategies import IGNORE_INDEX, SEQ, VOCAB, WIDTH, Counts, _summing_hook, loaded, microbatch
from tokaudit.hooks import Recorder, global_valid_tokens


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One training set-up and how it is recorded."""

    name: str
    """Run id of its logs."""
    counts: Counts
    """Valid tokens per step, rank and microbatch."""
    correct: bool
    """Whether the gradient is the token mean of every term (the reference decides; the test checks)."""
    heads: int = 1
    """Loss terms: heads over the same tokens (`aux`), or MTP heads predicting token t+k (`mtp`)."""
    terms: str = "aux"
    """aux: every head predicts the same labels; mtp: head k predicts the labels shifted by k."""
    capture: bool = False
    """Record through capture_cross_entropy (terms guessed) instead of probe/record (terms named)."""
    chunks: int = 1
    """Cross-entropy computed over this many disjoint slices of the flattened sequence."""
    zero_grad_each_micro: bool = False
    """optimizer.zero_grad() before every microbatch, inside the accumulation window (a bug)."""
    chunking: str = "slices"
    """slices: views of the flattened logits and labels; copies: torchtune's `logits.chunk(k, dim=1)` with each
    chunk's labels a copy (`labels.chunk(k, dim=1)` then `.reshape(-1)` copies when a batch has several rows);
    chunk_means: those copies, each chunk's mean averaged (a chunk-local mean); named: probed and recorded by hand,
    each chunk a loss term of its own."""
    aux_local_mean: bool = False
    """The last head is a local mean (F.cross_entropy's default reduction) instead of a token mean."""
    aux_weight: float = 1.0
    """λ: the last head's token mean weighed λ on purpose (L = Σ_terms ΣS/N, the last one times λ)."""
    aux_weight_declared: bool = True
    """λ declared to the recorder (`loss_term(name, weight=λ)`); False: the loop weighs the term and says nothing."""
    aux_first_only: bool = False
    """The last head's loss on each update's first microbatch alone (an auxiliary loss computed once an update), its
    N the first microbatches' tokens over the ranks."""
    names: tuple[str, ...] = ()
    """Each head's loss term as recorded; empty: "0", then "head1", "head2"…"""
    scaler: str = "none"
    """none, told (Recorder(scaler=...)) or untold (a GradScaler the recorder is not given)."""
    overflow: tuple[int, int] | None = None
    """(step, rank) whose gradient overflows (inf): the update is skipped."""
    guard: bool = False
    """Skip optimizer.step() when a gradient is not finite (no GradScaler)."""
    summing_hook: bool = False
    """A DDP comm hook that sums (D = 1) and that the recorder cannot see."""
    factor: float | None = None
    """b = factor·S/N; None: W for an average, 1 for a summing hook."""
    first_step: int = 0
    """Step number of the first update (a resumed run)."""
    length: int = SEQ
    """Positions per microbatch."""
    near_miss: bool = False
    """A microbatch-local mean that counts one label too many per row (unshifted labels): S/(n + 1)."""
    masked_sum: str = "valid"
    """How S is summed: valid (Σ over valid positions), all (per_token.sum(): ignored positions hold
    an exact 0 loss) or padded (padding labelled as a real token, then per_token.sum(): its loss counts)."""
    reported: str = "none"
    """none, before or after: the loop reports term 0's token mean (all-reduced ΣS/N) with rec.report_loss()
    and no step, before or after optimizer.step()."""
    counted: str = "valid"
    """What the loop records as valid_tokens: valid (the labelled tokens its loss averages) or positions (every
    position, padding included: a count the probe contradicts while the training itself is right)."""
    evaluated: bool = False
    """After its microbatches each rank computes a loss with gradients on one more batch, through the model itself,
    and records it; it is never backpropagated (an evaluation inside the loop)."""
    steps_told: bool = True
    """The recorder is given the optimizer; False: neither it nor begin_step (the updates are seen from the
    backwards that synchronize)."""
    no_sync: bool = True
    """Every microbatch but the last under `ddp.no_sync()`; False: each backward all-reduces (the same gradient)."""
    forward: str = "call"
    """How the loop runs DDP's forward: call (`ddp(tokens)`), method (`ddp.forward(tokens)`: no module hook runs,
    DDP's reducer is prepared all the same) or module (`ddp.module(tokens)`, a bug: no backward all-reduces)."""
    world_size: int = 2
    description: str = ""
    """One line for people."""


class Heads(nn.Module):
    """Embedding → tanh → one linear head per loss term."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.heads = nn.ModuleList(nn.Linear(WIDTH, VOCAB) for _ in range(heads))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hidden = torch.tanh(self.embed(tokens))
        return tuple(head(hidden) for head in self.heads)


def make_heads(heads: int) -> Heads:
    torch.manual_seed(99)
    return Heads(heads).double()


def term_targets(
    setup: Setup, head: int, logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, labels) of one head: the same labels, or for MTP head k the labels k positions on,
    as views of the one label tensor."""
    if setup.terms == "mtp" and head > 0:
        return logits[:, : labels.shape[1] - head], labels[:, head:]
    return logits, labels


def term_sum(setup: Setup, head: int, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """S and n of one term of one microbatch, in float64, without the recorder (the reference)."""
    logits, labels = term_targets(setup, head, logits, labels)
    per_token = F.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return per_token.sum(), int((labels != IGNORE_INDEX).sum())


def computed(setup: Setup, head: int, micro: int) -> bool:
    """Whether a head's loss is computed on this microbatch of an update (`Setup.aux_first_only`)."""
    return micro == 0 or not (setup.aux_first_only and head == setup.heads - 1 and head > 0)


def step_counts(setup: Setup, step: int, members: list[int]) -> list[int]:
    """N per term over the members' microbatches."""
    totals = [0] * setup.heads
    for rank in members:
        for micro, count in enumerate(setup.counts[step][rank]):
            tokens, labels, _ = microbatch(step, rank, micro, count, setup.length)
            for head in range(setup.heads):
                if computed(setup, head, micro):
                    totals[head] += int((term_targets(setup, head, tokens, labels)[1] != IGNORE_INDEX).sum())
    return totals


def reference_gradient(setup: Setup, params: list[torch.Tensor], step: int, members: list[int]) -> list[torch.Tensor]:
    """Single process, float64: ∇ Σ_terms λ_term·ΣS_term/N_term over the group's tokens of one step (λ = 1 but
    for a weighed last head, `aux_weight`)."""
    model = loaded(make_heads(setup.heads), params)
    totals = step_counts(setup, step, members)
    objective = torch.zeros((), dtype=torch.float64)
    for rank in members:
        for micro, count in enumerate(setup.counts[step][rank]):
            tokens, labels, _ = microbatch(step, rank, micro, count, setup.length)
            for head, logits in enumerate(model(tokens)):
                if not computed(setup, head, micro):
                    continue
                loss_sum, _ = term_sum(setup, head, logits, labels)
                weight = setup.aux_weight if head == setup.heads - 1 and head > 0 else 1.0
                objective = objective + weight * loss_sum / max(totals[head], 1)
    objective.backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def _microbatch_loss(
    setup: Setup,
    recorder: Recorder | None,
    outputs: tuple[torch.Tensor, ...],
    labels: torch.Tensor,
    global_tokens: torch.Tensor,
    world_size: int,
    micro: int = 0,
) -> torch.Tensor:
    """The backward scalar b of one microbatch (every term computed on it), recorded as this set-up records it."""
    factor = setup.factor if setup.factor is not None else (1 if setup.summing_hook else world_size)
    total = torch.zeros((), dtype=torch.float64)
    for head, logits in enumerate(outputs):
        if not computed(setup, head, micro):
            total = total + 0.0 * logits.sum()  # the head still in the graph: DDP expects a gradient of every parameter
            continue
        logits, targets = term_targets(setup, head, logits, labels)
        valid = targets != IGNORE_INDEX
        local_mean = setup.aux_local_mean and head == setup.heads - 1
        if recorder is not None and setup.capture:
            # What a trainer does when tokaudit only captures its cross-entropy calls.
            flat_logits, flat_targets = logits.reshape(-1, VOCAB), targets.reshape(-1)
            if local_mean:
                term = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX)
            elif setup.chunking != "slices":
                pairs = [
                    (part.reshape(-1, VOCAB), target.reshape(-1).clone())
                    for part, target in zip(logits.chunk(setup.chunks, dim=1), targets.chunk(setup.chunks, dim=1))
                ]
                if setup.chunking == "chunk_means":  # each chunk's mean (0 for a chunk of padding alone)
                    term = sum(
                        F.cross_entropy(part, target, ignore_index=IGNORE_INDEX, reduction="sum")
                        / (target != IGNORE_INDEX).sum().clamp(min=1)
                        for part, target in pairs
                    )
                    term = term / setup.chunks
                else:
                    term = sum(
                        F.cross_entropy(part, target, ignore_index=IGNORE_INDEX, reduction="sum")
                        for part, target in pairs
                    )
                    term = factor * term / global_tokens[head].clamp(min=1)
            else:
                bounds = [len(flat_targets) * i // setup.chunks for i in range(setup.chunks + 1)]
                term = sum(
                    F.cross_entropy(flat_logits[a:b], flat_targets[a:b], ignore_index=IGNORE_INDEX, reduction="sum")
                    for a, b in zip(bounds, bounds[1:])
                )
                term = factor * term / global_tokens[head].clamp(min=1)
            total = total + term
            continue
        # Padding labelled as a real token (id 0) instead of IGNORE_INDEX: its loss is not 0.
        labelled = targets.masked_fill(~valid, 0) if setup.masked_sum == "padded" else targets
        per_token = F.cross_entropy(
            logits.reshape(-1, VOCAB), labelled.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(targets.shape)
        if setup.chunking == "named":
            total = total + _named_chunks(setup, recorder, per_token, valid, factor, global_tokens[head])
            continue
        name = setup.names[head] if setup.names else "0" if head == 0 else f"head{head}"
        weight = setup.aux_weight if head == setup.heads - 1 and head > 0 else 1.0
        declared = weight if weight != 1.0 and setup.aux_weight_declared else None
        context = recorder.loss_term(name, weight=declared) if recorder is not None else nullcontext()
        with context:
            if recorder is not None:
                per_token = recorder.probe(per_token, valid)
            loss_sum = (per_token * valid).sum() if setup.masked_sum == "valid" else per_token.sum()
            n = valid.sum()
            if setup.near_miss:
                term = loss_sum / (n + 1)
            else:
                term = loss_sum / n if local_mean else weight * factor * loss_sum / global_tokens[head].clamp(min=1)
            if recorder is not None:
                recorder.record(
                    loss_sum=loss_sum,
                    valid_tokens=n if setup.counted == "valid" else valid.numel(),
                    backward_scalar=term,
                )
        total = total + term
    return total


def _named_chunks(
    setup: Setup,
    recorder: Recorder | None,
    per_token: torch.Tensor,
    valid: torch.Tensor,
    factor: float,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """One token mean computed over `setup.chunks` slices of the sequence, each probed and recorded as a loss term
    of its own ("0", "chunk1", …): factor·S_k/N, N the whole update's count."""
    total = torch.zeros((), dtype=torch.float64)
    for k, (piece, mask) in enumerate(zip(per_token.chunk(setup.chunks, dim=1), valid.chunk(setup.chunks, dim=1))):
        context = recorder.loss_term("0" if k == 0 else f"chunk{k}") if recorder is not None else nullcontext()
        with context:
            if recorder is not None:
                piece = recorder.probe(piece, mask)
            loss_sum = (piece * mask).sum()
            term = factor * loss_sum / tokens.clamp(min=1)
            if recorder is not None:
                recorder.record(loss_sum=loss_sum, valid_tokens=mask.sum(), backward_scalar=term)
        total = total + term
    return total


def train(rank: int, world_size: int, setup: Setup, log_dir: str | None) -> list[dict[str, Any]]:
    """Train through the set-up's steps (one job); per step the parameters before it, the reduced
    gradient before the optimizer (unscaled), and whether the update was skipped."""
    model = make_heads(setup.heads)
    ddp = DDP(model)
    if setup.summing_hook:
        ddp.register_comm_hook(None, _summing_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if setup.scaler != "none" else None
    recorder = None
    if log_dir is not None:
        recorder = Recorder(
            log_dir,
            run_id=setup.name,
            model=ddp,
            optimizer=optimizer if setup.steps_told else None,
            scaler=scaler if setup.scaler == "told" else None,
        )
        if setup.first_step:
            recorder.begin_step(setup.first_step)
    capture = recorder.capture_cross_entropy() if recorder is not None and setup.capture else nullcontext()
    history = []
    with capture:
        for step, per_rank in enumerate(setup.counts):
            batches = [microbatch(step, rank, micro, count, setup.length) for micro, count in enumerate(per_rank[rank])]
            # N per term for the whole update, counted before the first backward (one all-reduce each).
            global_tokens = torch.stack(
                [
                    global_valid_tokens(
                        [
                            term_targets(setup, head, tokens, labels)[1]
                            for micro, (tokens, labels, _) in enumerate(batches)
                            if computed(setup, head, micro)
                        ]
                    )
                    for head in range(setup.heads)
                ]
            )
            before = [p.detach().clone() for p in model.parameters()]
            reported = torch.zeros((), dtype=torch.float64)  # ΣS of term 0 over this rank's microbatches
            for micro, (tokens, labels, _) in enumerate(batches):
                last = micro == len(batches) - 1
                if setup.zero_grad_each_micro:
                    optimizer.zero_grad()  # the earlier microbatches' gradients are gone
                with nullcontext() if last or not setup.no_sync else ddp.no_sync():
                    outputs = {"call": ddp, "method": ddp.forward, "module": ddp.module}[setup.forward](tokens)
                    if setup.overflow == (step, rank) and micro == 0:
                        outputs[0].register_hook(lambda grad: grad * math.inf)  # an fp16 overflow
                    scalar = _microbatch_loss(setup, recorder, outputs, labels, global_tokens, world_size, micro)
                    (scaler.scale(scalar) if scaler is not None else scalar).backward()
                    reported += term_sum(setup, 0, outputs[0].detach(), labels)[0]
            if recorder is not None and setup.evaluated:  # recorded, never trained on
                tokens, labels, _ = microbatch(step, rank, len(batches), 5 + 3 * rank, setup.length)
                evaluated, count = term_sum(setup, 0, model(tokens)[0], labels)
                recorder.record(evaluated, count, world_size * evaluated / global_tokens[0])
            if recorder is not None and setup.reported != "none":
                torch.distributed.all_reduce(reported)
                reported /= global_tokens[0].clamp(min=1)
            if recorder is not None and setup.reported == "before":
                recorder.report_loss(reported)  # the update under way
            if scaler is not None:
                scaler.unscale_(optimizer)
            grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
            finite = all(bool(torch.isfinite(g).all()) for g in grads)
            if scaler is not None:
                scaler.step(optimizer)  # skips optimizer.step() on an overflow
                scaler.update()
            elif finite or not setup.guard:
                optimizer.step()
            optimizer.zero_grad()
            if recorder is not None and setup.reported == "after":
                recorder.report_loss(reported)  # the update just closed
            history.append({"before": before, "grads": grads, "skipped": not finite})
    if recorder is not None:
        recorder.close()
    del ddp, model, optimizer, scaler
    gc.collect()
    return history


def job(rank: int, world_size: int, setup: Setup, log_dir: str) -> dict[str, Any]:
    """DDP job body: the set-up trained once, recorded."""
    return {"rank": rank, "history": train(rank, world_size, setup, log_dir)}


# Uneven counts, no microbatch without a valid token (a local mean of an empty one is NaN).
_UNEVEN: Counts = (((5, 1), (3, 7)), ((2, 6), (6, 1)), ((8, 4), (2, 8)), ((3, 3), (7, 2)))

_LONG: Counts = (((40, 21), (63, 30)), ((25, 58), (47, 33)), ((60, 44), (22, 51)))

SETUPS: tuple[Setup, ...] = (
    Setup(
        name="amp_told",
        counts=_UNEVEN,
        scaler="told",
        overflow=(1, 0),
        correct=True,
        description="W·S/N under a GradScaler passed to the recorder; step 1 overflows and is skipped",
    ),
    Setup(
        name="amp_untold",
        counts=_UNEVEN,
        scaler="untold",
        overflow=(1, 0),
        correct=True,
        description="the same loop, the GradScaler not given to the recorder: its scale cannot be divided out",
    ),
    Setup(
        name="nan_guard_skip",
        counts=_UNEVEN,
        guard=True,
        overflow=(2, 1),
        correct=True,
        description="W·S/N; an inf/NaN guard skips optimizer.step() at step 2 (no GradScaler)",
    ),
    Setup(
        name="aux_head_named",
        counts=_UNEVEN,
        heads=2,
        correct=True,
        description="main + auxiliary head over the same tokens, each W·S/N, recorded as named terms",
    ),
    Setup(
        name="aux_head_captured",
        counts=_UNEVEN,
        heads=2,
        capture=True,
        correct=True,
        description="main + auxiliary head, each W·S/N, captured from F.cross_entropy (terms guessed)",
    ),
    Setup(
        name="aux_head_local_mean",
        counts=_UNEVEN,
        heads=2,
        capture=True,
        aux_local_mean=True,
        correct=False,
        description="main head W·S/N, auxiliary head F.cross_entropy's default mean (a local mean)",
    ),
    Setup(
        name="chunked_cross_entropy",
        counts=_UNEVEN,
        capture=True,
        chunks=2,
        correct=True,
        description="one W·S/N cross-entropy computed over two disjoint chunks of the sequence",
    ),
    Setup(
        name="chunked_cross_entropy_copied",
        counts=_UNEVEN,
        capture=True,
        chunks=4,
        chunking="copies",
        correct=True,
        description="torchtune's chunked W·S/N cross-entropy: logits.chunk(4, dim=1), each chunk's "
        "labels a copy, each chunk summed, all divided by N",
    ),
    Setup(
        name="chunked_cross_entropy_named",
        counts=_UNEVEN,
        chunks=3,
        chunking="named",
        correct=True,
        description="one W·S/N cross-entropy over three chunks of the sequence, each recorded as a loss term",
    ),
    Setup(
        name="chunked_cross_entropy_chunk_means",
        counts=_UNEVEN,
        capture=True,
        chunks=4,
        chunking="chunk_means",
        correct=False,
        description="the same chunks, each chunk's own mean, averaged (a chunk-local mean)",
    ),
    Setup(
        name="zero_grad_inside_accumulation",
        counts=_UNEVEN,
        zero_grad_each_micro=True,
        correct=False,
        description="W·S/N, but optimizer.zero_grad() before every microbatch: each update trains on its last "
        "microbatch alone",
    ),
    Setup(
        name="mtp_heads",
        counts=_UNEVEN,
        heads=3,
        terms="mtp",
        capture=True,
        correct=True,
        description="multi-token prediction: 3 heads predicting tokens t+1..t+3, each its own W·S/N",
    ),
    Setup(
        name="near_miss_local_mean",
        counts=_LONG,
        length=64,
        near_miss=True,
        correct=False,
        description="each microbatch divided by its own count plus one (one extra label per row)",
    ),
    Setup(
        name="ignored_positions_summed",
        counts=_UNEVEN,
        masked_sum="all",
        correct=True,
        description="W·per_token.sum()/N over cross_entropy(ignore_index=-100, reduction='none'): ignored "
        "positions hold an exact 0",
    ),
    Setup(
        name="padding_labelled",
        counts=_UNEVEN,
        masked_sum="padded",
        correct=False,
        description="padding labelled as a real token, then W·per_token.sum()/N: the padding's loss is trained",
    ),
    Setup(
        name="unknown_hook_right",
        counts=_UNEVEN,
        summing_hook=True,
        correct=True,
        description="S/N into a summing comm hook the recorder cannot see (right, but not visible)",
    ),
    Setup(
        name="unknown_hook_wrong",
        counts=_UNEVEN,
        summing_hook=True,
        factor=2,
        correct=False,
        description="W·S/N into a summing comm hook the recorder cannot see (W× too large)",
    ),
    Setup(
        name="counted_positions",
        counts=_UNEVEN,
        counted="positions",
        correct=True,
        description="W·S/N over the labelled tokens (right), but valid_tokens recorded as every position of "
        "the microbatch: the probe's weights contradict the count",
    ),
)
"""Each in real DDP on 2 gloo processes; `elastic_stale_w` is two jobs (W = 3, then W = 2)."""

ELASTIC: tuple[Setup, Setup] = (
    Setup(
        name="elastic_stale_w",
        counts=(((2, 5), (4, 1), (3, 3)), ((6, 2), (1, 1), (5, 4))),
        world_size=3,
        correct=True,
        description="W·S/N on 3 ranks",
    ),
    Setup(
        name="elastic_stale_w",
        counts=(((2, 7), (5, 1)), ((3, 3), (8, 2)), ((4, 6), (1, 5))),
        world_size=2,
        factor=3,
        first_step=2,
        correct=False,
        description="resumed on 2 ranks at step 2, the code still multiplies by W=3",
    ),
)
