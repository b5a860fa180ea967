"""Token-loss normalizations, right and wrong, trained in real DDP and recorded with `Recorder`.

Each scenario writes the backward scalar the way real code does (`S / n`, `W * S / N`, ...);
the tests hold the theory for each one separately and check the recordings against it.
"""

from __future__ import annotations

import gc
import os
import signal
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tokaudit.hooks import Recorder

VOCAB, WIDTH, SEQ = 13, 6, 8
IGNORE_INDEX = -100

Counts = tuple[tuple[tuple[int, ...], ...], ...]  # counts[step][global rank][micro]


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One training set-up: who holds how many valid tokens and how the loss is normalized."""

    name: str
    """Folder name of its logs; says what it is."""
    strategy: str
    """How the backward scalar is formed (see `backward_scalar`)."""
    world_size: int
    """Processes launched."""
    counts: Counts
    """Valid tokens per step, global rank and microbatch (each at most SEQ)."""
    correct: bool
    """Whether this is the token-mean objective."""
    description: str
    """One line for people."""
    dp_size: int | None = None
    """Size of the data-parallel subgroups (ranks r, r+W/dp, ...); None: the whole world."""
    summing_hook: bool = False
    """Register a comm hook that sums instead of averaging (D = 1)."""
    hard_coded_world_size: int = 8
    """The constant used by the `hard_coded_world_size` strategy."""
    report: str = "token_mean"
    """What the trainer reports as its loss: token_mean or mean_of_local_means."""
    extra: dict[str, Any] = field(default_factory=dict)


class TinyLM(nn.Module):
    """Embedding → linear head: enough parameters to see every token's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))  # type: ignore[no-any-return]


def make_model() -> TinyLM:
    torch.manual_seed(1234)
    return TinyLM().double()


M = TypeVar("M", bound=nn.Module)


def loaded(model: M, params: list[torch.Tensor]) -> M:
    """The model with these parameters: where a float64 reference starts a step from."""
    with torch.no_grad():
        for target, source in zip(model.parameters(), params, strict=True):
            target.copy_(source)
    return model


def microbatch(
    step: int, rank: int, micro: int, count: int, length: int = SEQ
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels (IGNORE_INDEX where not valid) and the valid mask, the same in every process."""
    generator = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + 31 * micro + 17)
    tokens = torch.randint(0, VOCAB, (1, length), generator=generator)
    labels = torch.randint(0, VOCAB, (1, length), generator=generator)
    valid = torch.zeros(1, length, dtype=torch.bool)
    valid[0, torch.randperm(length, generator=generator)[:count]] = True
    return tokens, labels.masked_fill(~valid, IGNORE_INDEX), valid


def per_token_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
    return loss.view(labels.shape)


def backward_scalar(
    scenario: Scenario,
    loss_sum: torch.Tensor,
    valid: int,
    microbatches: int,
    step_tokens: torch.Tensor,
    micro_tokens: torch.Tensor,
    world_size: int,
) -> torch.Tensor:
    """The scalar each strategy backpropagates, written as such code is written in the wild."""
    strategy = scenario.strategy
    if strategy == "token_mean":  # W·S/N into DDP's average; N = 0 gives 0, still connected
        return world_size * loss_sum / step_tokens.clamp(min=1)
    if strategy == "token_mean_summed":  # S/N into a summing reduction
        return loss_sum / step_tokens.clamp(min=1)
    if strategy == "local_mean":  # per_token[valid].mean()
        return loss_sum / valid
    if strategy == "local_mean_over_accumulation":  # loss.mean() / grad_accum_steps
        return loss_sum / valid / microbatches
    if strategy == "per_micro_global":  # each microbatch's own global count N_m
        return world_size * loss_sum / (microbatches * micro_tokens.clamp(min=1))
    if strategy == "missing_world_size":  # S/N into an average: lr silently ÷W
        return loss_sum / step_tokens
    if strategy == "hard_coded_world_size":
        return scenario.hard_coded_world_size * loss_sum / step_tokens
    if strategy == "global_world_size":  # dist.get_world_size() on a data-parallel subgroup
        return dist.get_world_size() * loss_sum / step_tokens
    if strategy == "tokens_over_launch":  # N all-reduced over every process, tensor-parallel partners included
        counted = torch.tensor(float(valid), dtype=torch.float64)  # one microbatch a step: the rank's count
        dist.all_reduce(counted)
        return world_size * loss_sum / counted
    raise ValueError(f"unknown strategy {strategy!r}")


def _summing_hook(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
    """DDP comm hook that all-reduces with SUM and does not divide (D = 1)."""
    tensor = bucket.buffer()
    work = dist.all_reduce(tensor, group=process_group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def data_parallel_groups(world_size: int, dp_size: int | None) -> tuple[Any, list[int]]:
    """This rank's averaging group and its global members. Every rank creates every group."""
    if dp_size is None or dp_size == world_size:
        return None, list(range(world_size))
    stride = world_size // dp_size
    mine: tuple[Any, list[int]] | None = None
    for offset in range(stride):
        members = list(range(offset, world_size, stride))
        group = dist.new_group(members)
        if dist.get_rank() in members:
            mine = (group, members)
    assert mine is not None
    return mine


def train(
    scenario: Scenario, log_dir: str | None, process_group: Any, members: list[int], flush_every: int = 4096
) -> list[dict[str, Any]]:
    """Train through the scenario's steps; return per step the parameters before it and the
    reduced gradients (before the optimizer, after every microbatch's backward)."""
    rank = dist.get_rank()
    world_size = len(members)
    model = make_model()
    ddp = DDP(model, process_group=process_group)
    if scenario.summing_hook:
        ddp.register_comm_hook(process_group, _summing_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    recorder = None
    if log_dir is not None:
        recorder = Recorder(
            log_dir,
            run_id=scenario.name,
            model=ddp,
            optimizer=optimizer,
            group=process_group,
            grad_divisor=1.0 if scenario.summing_hook else None,
            flush_every=scenario.extra.get("flush_every", flush_every),
        )
    history = []
    for step, step_counts in enumerate(scenario.counts):
        mine = step_counts[rank]
        microbatches = len(mine)
        # N and N_m for the whole update, counted before the first backward (one collective each); ranks
        # may run different numbers of microbatches (the missing ones count 0 in N_m).
        micro_tokens = torch.zeros(max(len(c) for c in step_counts), dtype=torch.float64)
        micro_tokens[:microbatches] = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(micro_tokens, group=process_group)
        step_tokens = micro_tokens.sum()
        before = [p.detach().clone() for p in model.parameters()]
        local_sum = torch.zeros((), dtype=torch.float64)
        scalars = []
        for micro, valid_count in enumerate(mine):
            tokens, labels, valid = microbatch(step, rank, micro, valid_count)
            last = micro == microbatches - 1
            with nullcontext() if last else ddp.no_sync():
                per_token = per_token_loss(ddp, tokens, labels)
                if recorder is not None:
                    per_token = recorder.probe(per_token, valid)
                loss_sum = (per_token * valid).sum()  # a rank with no valid token still joins backward
                scalar = backward_scalar(
                    scenario, loss_sum, valid_count, microbatches, step_tokens, micro_tokens[micro], world_size
                )
                if recorder is not None and not last:
                    recorder.record(loss_sum=loss_sum, valid_tokens=valid_count, backward_scalar=scalar, positions=SEQ)
                scalar.backward()
            local_sum += loss_sum.detach()
            scalars.append(float(scalar.detach()))
            if recorder is not None and last:
                # Recorded after backward, with the loss the trainer reports (all ranks join it).
                recorder.record(
                    loss_sum=loss_sum,
                    valid_tokens=valid_count,
                    backward_scalar=scalar,
                    positions=SEQ,
                    reported_loss=_reported(scenario, local_sum, sum(mine), step_tokens, process_group, world_size),
                )
        grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        # every rank sees the same N: skip together; `skip_on` = (step, rank): one rank's own guard skips alone (a bug)
        if float(step_tokens) == 0 or scenario.extra.get("skip_on") == (step, rank):
            optimizer.zero_grad()
            if recorder is not None:
                recorder.end_step(skipped=True)
        else:
            optimizer.step()
            optimizer.zero_grad()
        history.append({"before": before, "grads": grads, "scalars": scalars})
        # `killed` = (step, rank): after that update the rank is killed at once (the OOM killer: SIGKILL, nothing
        # written after), and the others stop as torchrun stops them, their recorders closed
        if recorder is not None and scenario.extra.get("killed", (None,))[0] == step:
            dist.barrier(group=process_group)
            if rank == scenario.extra["killed"][1]:
                os.kill(os.getpid(), signal.SIGKILL)
            break
    if recorder is not None:
        recorder.close()
    del ddp, model, optimizer
    gc.collect()
    return history


def _reported(
    scenario: Scenario,
    local_sum: torch.Tensor,
    local_count: int,
    step_tokens: torch.Tensor,
    process_group: Any,
    world_size: int,
) -> torch.Tensor:
    if scenario.report == "mean_of_local_means":
        local_mean = local_sum / max(local_count, 1)
        dist.all_reduce(local_mean, group=process_group)
        return local_mean / world_size
    total = local_sum.clone()
    dist.all_reduce(total, group=process_group)
    return total / step_tokens.clamp(min=1)


def run_scenario(rank: int, world_size: int, scenario: Scenario, log_dir: str | None) -> dict[str, Any]:
    """DDP job body: train without the recorder, then with it, from the same start."""
    process_group, members = data_parallel_groups(world_size, scenario.dp_size)
    plain = train(scenario, None, process_group, members)
    recorded = train(scenario, log_dir, process_group, members) if log_dir is not None else None
    return {"rank": rank, "members": members, "plain": plain, "recorded": recorded}


def reference_gradient(
    params: list[torch.Tensor],
    scenario: Scenario,
    step: int,
    members: list[int],
    weights: dict[tuple[int, int], float] | None = None,
) -> list[torch.Tensor]:
    """Single process, float64: ∇ Σ_{r,m} w_{r,m}·S_{r,m} over the group's tokens of one step.

    With `weights=None`, w = 1/N: the token-mean objective L = ΣS/N.
    """
    model = loaded(make_model(), params)
    step_tokens = sum(sum(scenario.counts[step][r]) for r in members)
    total = torch.zeros((), dtype=torch.float64)
    for rank in members:
        for micro, valid_count in enumerate(scenario.counts[step][rank]):
            tokens, labels, valid = microbatch(step, rank, micro, valid_count)
            loss_sum = (per_token_loss(model, tokens, labels) * valid).sum()
            weight = 1.0 / max(step_tokens, 1) if weights is None else weights[(rank, micro)]
            total = total + weight * loss_sum
    total.backward()
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


# Uneven counts: padding, ignored labels, a rank with no valid token at step 1.
_UNEVEN_2x2: Counts = (((5, 1), (3, 7)), ((0, 0), (6, 2)), ((8, 4), (2, 8)))
_UNEVEN_2x1: Counts = (((2,), (7,)), ((5,), (1,)), ((8,), (3,)))
_UNEVEN_3x2: Counts = (((5, 1), (3, 7), (2, 2)), ((0, 0), (6, 2), (8, 1)), ((8, 4), (2, 8), (1, 0)))
_SUBGROUPS_4x1: Counts = (((2,), (7,), (5,), (1,)), ((8,), (3,), (4,), (6,)))
_UNEVEN_3x1: Counts = (((2,), (7,), (0,)), ((5,), (1,), (4,)), ((8,), (3,), (6,)))
_UNEVEN_MICRO: Counts = (((3, 2, 4), (4, 1)), ((1, 5), (2, 2, 6)), ((2, 2, 1), (7, 3)))

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        name="correct_token_mean_ga",
        strategy="token_mean",
        world_size=2,
        counts=_UNEVEN_2x2,
        correct=True,
        description="W·S/N into DDP's average, accumulation with no_sync, a rank with no valid token",
    ),
    Scenario(
        name="correct_token_mean_w3",
        strategy="token_mean",
        world_size=3,
        counts=_UNEVEN_3x2,
        correct=True,
        description="W·S/N with W=3 and uneven microbatches",
    ),
    Scenario(
        name="correct_sum_hook",
        strategy="token_mean_summed",
        world_size=2,
        counts=_UNEVEN_2x2,
        correct=True,
        summing_hook=True,
        description="S/N into a summing comm hook (D=1)",
    ),
    # One microbatch a step (no accumulation): the audit aggregates these without a per-rank table.
    Scenario(
        name="correct_token_mean_one_micro",
        strategy="token_mean",
        world_size=3,
        counts=_UNEVEN_3x1,
        correct=True,
        description="W·S/N with W=3, one microbatch a step, a rank with no valid token",
    ),
    Scenario(
        name="correct_sum_hook_one_micro",
        strategy="token_mean_summed",
        world_size=2,
        counts=_UNEVEN_2x1,
        correct=True,
        summing_hook=True,
        description="S/N into a summing comm hook, one microbatch a step",
    ),
    Scenario(
        name="bug_local_mean",
        strategy="local_mean",
        world_size=2,
        counts=_UNEVEN_2x1,
        correct=False,
        report="mean_of_local_means",
        description="each rank backpropagates its own mean S_r/n_r",
    ),
    Scenario(
        name="bug_local_mean_accumulation",
        strategy="local_mean_over_accumulation",
        world_size=2,
        counts=(((5, 1), (3, 7)), ((2, 6), (6, 2)), ((8, 4), (2, 8))),
        correct=False,
        report="mean_of_local_means",
        description="microbatch mean divided by the accumulation steps",
    ),
    Scenario(
        name="bug_per_micro_denominator",
        strategy="per_micro_global",
        world_size=2,
        counts=_UNEVEN_2x2,
        correct=False,
        description="each microbatch divided by its own global count N_m",
    ),
    Scenario(
        name="bug_missing_world_size",
        strategy="missing_world_size",
        world_size=2,
        counts=_UNEVEN_2x2,
        correct=False,
        description="S/N into DDP's average (the W factor is missing)",
    ),
    Scenario(
        name="bug_hard_coded_world_size",
        strategy="hard_coded_world_size",
        world_size=2,
        counts=_UNEVEN_2x2,
        correct=False,
        description="8·S/N on a group of 2 (a hard-coded W)",
    ),
    Scenario(
        name="bug_global_world_size_on_dp_group",
        strategy="global_world_size",
        world_size=4,
        counts=_SUBGROUPS_4x1,
        dp_size=2,
        correct=False,
        description="world size 4 used on data-parallel groups of 2 (DP×TP)",
    ),
    Scenario(
        name="inconclusive_balanced_local_mean",
        strategy="local_mean",
        world_size=2,
        counts=(((4,), (4,)), ((6,), (6,)), ((3,), (3,))),
        correct=False,
        report="mean_of_local_means",
        description="a local mean with equal counts everywhere: the logs cannot tell it from the token mean",
    ),
    Scenario(
        name="correct_uneven_microbatches",
        strategy="token_mean",
        world_size=2,
        counts=_UNEVEN_MICRO,
        correct=True,
        description="W·S/N, ranks running 3 and 2 microbatches, each syncing once (its last)",
    ),
    Scenario(
        name="bug_uneven_microbatches_local_mean",
        strategy="local_mean",
        world_size=2,
        counts=_UNEVEN_MICRO,
        correct=False,
        description="ranks running 3 and 2 microbatches, each divided by its own count",
    ),
    Scenario(
        name="correct_token_mean_reported_local_means",
        strategy="token_mean",
        world_size=2,
        counts=_UNEVEN_2x2,
        correct=True,
        report="mean_of_local_means",
        description="W·S/N (right), but the logged loss is the mean of per-rank means",
    ),
    Scenario(
        name="correct_empty_update_skipped",
        strategy="token_mean",
        world_size=2,
        counts=(((3, 5), (4, 1)), ((0, 0), (0, 0)), ((2, 6), (7, 3))),
        correct=True,
        description="step 1 has no valid token anywhere: every rank skips the update together",
    ),
)

SCENARIOS_BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}
