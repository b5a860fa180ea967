"""Normalization recovery on small hand-made per-step tables: no Parquet, no DuckDB.

Each table row is built here from per-record weights by the definitions of the objective (e·Den over the
step's records, low and high), independently of the engine's SQL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.logs import seeds

from tokaudit._normalization import (
    Decisions,
    Denominator,
    Diagnoses,
    FactorKind,
    StepKind,
    block_fits,
    cluster,
    explain_factor,
    resolvable_integer,
    segments,
)

# One record: (rank, micro, n, e), e the effective weight of one of its valid tokens.
Record = tuple[int, int, int, float]


def step_row(
    step: int,
    records: Sequence[Record],
    world_size: int = 2,
    divisor: float | None = None,
    positions: int | None = None,
    group: str = "0",
    unknown_divisor: bool = False,
) -> dict[str, Any]:
    """The per-step columns normalization reads, from the definitions."""
    divisor = float(world_size) if divisor is None else divisor
    valid = [r for r in records if r[2] > 0]
    tokens = sum(r[2] for r in records)
    rank_tokens: dict[int, int] = {}
    micro_tokens: dict[int, int] = {}
    microbatches: dict[int, int] = {}
    for rank, micro, n, _ in records:
        rank_tokens[rank] = rank_tokens.get(rank, 0) + n
        micro_tokens[micro] = micro_tokens.get(micro, 0) + n
        microbatches[rank] = microbatches.get(rank, 0) + 1

    def bounds(values: list[float]) -> tuple[float, float]:
        return (min(values), max(values)) if values else (math.nan, math.nan)

    e = [r[3] for r in valid]
    row = {
        "grp": group,
        "term": "0",
        "step": step,
        "records": len(records),
        "tokens": tokens,
        "weighted_records": len(valid),
        "divisor_high": divisor,
        "world_high": world_size,
        "record_tokens_low": min(r[2] for r in records),
        "record_tokens_high": max(r[2] for r in records),
        "microbatches_low": min(microbatches.values()),
        "microbatches_high": max(microbatches.values()),
        "positions": (positions or 0) * len(records),
        "positions_known": len(records) if positions else 0,
        "unknown_divisor": len(valid) if unknown_divisor else 0,
    }
    row["weight_low"], row["weight_high"] = bounds(e)
    row["weight_by_record_low"], row["weight_by_record_high"] = bounds([r[3] * r[2] for r in valid])
    row["weight_by_rank_low"], row["weight_by_rank_high"] = bounds([r[3] * rank_tokens[r[0]] for r in valid])
    row["weight_by_record_m_low"], row["weight_by_record_m_high"] = bounds(
        [r[3] * r[2] * microbatches[r[0]] for r in valid]
    )
    row["weight_by_micro_low"], row["weight_by_micro_high"] = bounds([r[3] * micro_tokens[r[1]] for r in valid])
    row["weight_by_positions_low"], row["weight_by_positions_high"] = (
        bounds([r[3] * positions for r in valid]) if positions else (math.nan, math.nan)
    )
    return row


def table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows)


def weights(counts: Sequence[Sequence[int]], weight: Any, world_size: int = 2) -> list[Record]:
    """Records of one step from counts[rank][micro] and weight(n=, n_r=, N=, N_m=, M=) → e."""
    total = sum(sum(c) for c in counts)
    out = []
    for rank, mine in enumerate(counts):
        for micro, n in enumerate(mine):
            n_m = sum(c[micro] for c in counts)
            out.append((rank, micro, n, weight(n=n, n_r=sum(mine), N=total, N_m=n_m, M=len(mine), W=world_size)))
    return out


UNEVEN = [[[1], [3]], [[5], [2]], [[4], [6]]]
UNEVEN_GA = [[[5, 1], [3, 6]], [[2, 6], [6, 1]], [[8, 4], [2, 8]]]


def diagnose_steps(steps: pd.DataFrame, rtol: float) -> Diagnoses:
    """The normalization's one entry point as the checks call it: the run's decisions from two passes over
    the table (here one block), then the steps' diagnoses."""

    def passes() -> Any:
        return iter([block_fits(steps, rtol)])

    worlds = {int(w) for w in steps.world_high.unique() if w == w} if "world_high" in steps else set()
    return Decisions.of(passes(), passes, rtol, lambda: worlds).diagnose(steps)


def diagnose(counts: Any, weight: Any, rtol: float = 1e-4, **row: Any) -> list[Any]:
    steps = table([step_row(i, weights(c, weight), **row) for i, c in enumerate(counts)])
    return diagnose_steps(steps, rtol)


@pytest.mark.parametrize(
    "weight, denominator, factor, kind",
    [
        (lambda N, W, **_: 1 / N, Denominator.N, 2.0, StepKind.CORRECT),  # W·S/N into an average
        (lambda n_r, W, **_: 1 / (W * n_r), Denominator.RANK, 1.0, StepKind.NONUNIFORM),  # S_r/n_r
        (lambda n, M, W, **_: 1 / (W * n * M), Denominator.MICRO_TIMES_M, 1.0, StepKind.NONUNIFORM),
        (lambda N_m, M, W, **_: 1 / (M * N_m), Denominator.MICRO_GLOBAL, 1.0, StepKind.NONUNIFORM),  # α = W/M
        (lambda N, W, **_: 1 / (W * N), Denominator.N, 1.0, StepKind.UNIFORM_OFF),  # missing W
    ],
)
def test_each_denominator_is_recovered_with_its_factor(
    weight: Any, denominator: Denominator, factor: float, kind: StepKind
) -> None:
    for diagnosis in diagnose(UNEVEN_GA, weight):
        assert (diagnosis.denominator, diagnosis.kind) == (denominator, kind)
        assert diagnosis.factor == pytest.approx(factor)
        assert diagnosis.approximate is None


def test_the_whole_run_votes_so_a_coincidence_in_one_step_does_not_decide() -> None:
    # Step 1 has equal counts on both ranks: n_rank fits it too, with α = 1 (local mean) and the
    # token mean (W·S/N, α = 2 for N) fits every step. Token mean wins everywhere.
    counts = [[[1], [3]], [[4], [4]], [[2], [7]]]
    diagnoses = diagnose(counts, lambda N, **_: 1 / N)
    assert {d.denominator for d in diagnoses} == {Denominator.N}
    assert all(d.kind == StepKind.CORRECT for d in diagnoses)


def test_balanced_steps_are_undetermined() -> None:
    diagnoses = diagnose([[[4], [4]], [[3], [3]]], lambda n_r, W, **_: 1 / (W * n_r))
    assert all(d.balanced and d.denominator == Denominator.UNDETERMINED for d in diagnoses)
    assert all(d.kind == StepKind.CORRECT for d in diagnoses)  # the weights are 1/N: only the code can differ


def test_alpha_is_clustered_within_rtol_not_rounded_to_digits() -> None:
    # bf16-like noise: each record's e off by up to ±0.4%; at rtol 1e-2 that is one hypothesis.
    rng = np.random.default_rng(3)
    rows = []
    for step in range(40):
        counts = [[int(rng.integers(1, 50))], [int(rng.integers(1, 50))]]
        records = weights(counts, lambda n_r, W, **_: 1 / (W * n_r))
        rows.append(step_row(step, [(r, m, n, e * (1 + rng.uniform(-0.004, 0.004))) for r, m, n, e in records]))
    steps = table(rows)
    diagnoses = diagnose_steps(steps, 1e-2)
    assert {d.denominator for d in diagnoses} == {Denominator.RANK}
    assert len({d.factor for d in diagnoses}) == 1, "one α for the whole run"
    (span,), _ = segments(steps, diagnoses)
    assert (span.first, span.last, span.steps) == (0, 39, 40)


def test_cluster_labels() -> None:
    values = np.array([1.0, 1.00005, 2.0, 0.99995, np.nan, 2.0001])
    labels = cluster(values, 1e-4)
    assert labels[4] == -1
    assert labels[0] == labels[1] == labels[3] != labels[2] == labels[5]


def test_segments_are_per_group_and_never_interleave() -> None:
    rows = []
    for step in range(4):
        # group A is always correct; group B switches from a local mean to the token mean at step 2
        rows.append(step_row(step, weights(UNEVEN[step % 3], lambda N, **_: 1 / N), group="A"))
        local = step < 2
        rows.append(
            step_row(
                step,
                weights(UNEVEN[step % 3], (lambda n_r, W, **_: 1 / (W * n_r)) if local else (lambda N, **_: 1 / N)),
                group="B",
            )
        )
    steps = table(rows)
    spans = [(s.group, s.first, s.last, s.denominator) for s in segments(steps, diagnose_steps(steps, 1e-4))[0]]
    assert spans == [("A", 0, 3, Denominator.N), ("B", 0, 1, Denominator.RANK), ("B", 2, 3, Denominator.N)]
    # The engine's columns are categories, in any order of categories: spans still follow the names' order.
    renamed = steps.assign(grp=pd.Categorical(steps.grp.map({"A": "10", "B": "9"}), categories=["9", "10"]))
    spans = [(s.group, s.first, s.last, s.denominator) for s in segments(renamed, diagnose_steps(renamed, 1e-4))[0]]
    assert spans == [("10", 0, 3, Denominator.N), ("9", 0, 1, Denominator.RANK), ("9", 2, 3, Denominator.N)]


def test_a_normalization_that_alternates_lists_the_longest_spans_and_counts_the_rest() -> None:
    """A bug that fires every other update makes one span per step: at most MAX_SPANS are listed,
    the longest (so a long correct stretch is never dropped for a one-step one), in step order."""
    from tokaudit._normalization import MAX_SPANS

    rng = np.random.default_rng(11)
    rows = []
    for step in range(400):
        counts = [[int(rng.integers(2, 60))], [int(rng.integers(61, 120))]]  # uneven: the two readings differ
        local = step % 2 == 1 and not 300 <= step < 350  # steps 300..350 are one correct stretch
        rows.append(
            step_row(step, weights(counts, (lambda n_r, W, **_: 1 / (W * n_r)) if local else (lambda N, **_: 1 / N)))
        )
    steps = table(rows)
    spans, omitted = segments(steps, diagnose_steps(steps, 1e-4))
    # 0..299 and 351..399 alternate (349 one-step spans), 300..350 is one token-mean span of 51 steps
    assert len(spans) == MAX_SPANS and omitted == 349 + 1 - MAX_SPANS
    assert [s.first for s in spans] == sorted(s.first for s in spans)
    longest = max(spans, key=lambda s: s.steps)
    assert (longest.first, longest.last, longest.steps, longest.denominator) == (300, 350, 51, Denominator.N)
    assert sum(s.steps == 1 for s in spans) == MAX_SPANS - 1 and spans[0].first == 0


def test_a_near_miss_names_the_nearest_denominator_as_approximate() -> None:
    # Unshifted labels under a rank-local mean: each rank divides by n_r + 2 (one extra label per row).
    counts = [[[40], [90]], [[70], [25]], [[55], [60]]]
    diagnoses = diagnose(counts, lambda n_r, W, **_: 1 / (W * (n_r + 2)))
    for diagnosis in diagnoses:
        assert diagnosis.kind == StepKind.NONUNIFORM and diagnosis.denominator == Denominator.RANK
        assert diagnosis.approximate is not None and 0 < diagnosis.approximate < 0.05
    # Weights with no structure stay unexplained.
    noise = iter([0.9, 0.1, 0.3, 0.2, 0.5, 0.05])
    assert {d.denominator for d in diagnose(UNEVEN, lambda **_: next(noise))} == {Denominator.UNEXPLAINED}


def test_an_unknown_divisor_leaves_uniform_weights_unjudged() -> None:
    diagnoses = diagnose(UNEVEN, lambda N, **_: 1 / N, unknown_divisor=True)
    assert {d.kind for d in diagnoses} == {StepKind.UNJUDGED}
    # A local mean still shows: it is in the ratios, whatever D is.
    diagnoses = diagnose(UNEVEN, lambda n_r, W, **_: 1 / (W * n_r), unknown_divisor=True)
    assert {(d.kind, d.denominator) for d in diagnoses} == {(StepKind.NONUNIFORM, Denominator.RANK)}


def test_empty_and_unweighted_steps() -> None:
    empty = step_row(0, [(0, 0, 0, math.nan), (1, 0, 0, math.nan)])
    unweighted = step_row(1, [(0, 0, 3, 0.25), (1, 0, 2, 0.25)])
    unweighted.update(weighted_records=0, weight_low=math.nan, weight_high=math.nan)
    kinds = [d.kind for d in diagnose_steps(table([empty, unweighted]), 1e-4)]
    assert kinds == [StepKind.EMPTY, StepKind.UNWEIGHTED]


@pytest.mark.parametrize(
    "q, world_size, sizes, kind, label, integer",
    [
        (0.5, 2, [2], FactorKind.WORLD_SIZE, "1/W", 2),  # S/N into an average
        (1 / 1024, 1024, [1024], FactorKind.WORLD_SIZE, "1/W", 1024),
        (2.0, 2, [2], FactorKind.WORLD_SIZE, "W", 2),  # W·S/N into a sum
        (1.5, 2, [2, 3], FactorKind.WORLD_SIZE, "W'/W", 3),  # stale W=3 after a resize to 2
        (4.0, 2, [2], FactorKind.WORLD_SIZE, "k", 4),  # hard-coded 8 on W=2
        (8 / 3, 3, [3], FactorKind.WORLD_SIZE, "k/W", 8),  # hard-coded 8 on W=3
        (1 / 3, 2, [2], FactorKind.WORLD_SIZE, "1/k", 3),  # N counted 3× (replicated ranks)
        (65536.0, 2, [2], FactorKind.LOSS_SCALE, "2^j", 16),  # an unrecorded GradScaler
        (32768.0, 2, [2], FactorKind.LOSS_SCALE, "2^j", 15),
        (65536 / 3, 3, [3], FactorKind.LOSS_SCALE, "2^j", 16),  # a scale on a missing W=3
        (1234.93, 2, [2], FactorKind.OTHER, "c", None),  # not an integer that rtol can resolve
        (0.7, 2, [2], FactorKind.OTHER, "c", None),
    ],
)
def test_uniform_factors_are_named_only_when_plausible(
    q: float, world_size: int, sizes: list[int], kind: FactorKind, label: str, integer: int | None
) -> None:
    explanation = explain_factor(q, world_size, sizes, 1e-4)
    assert (explanation.kind, explanation.label, explanation.integer) == (kind, label, integer)


def test_resolvable_integers_depend_on_rtol() -> None:
    assert resolvable_integer(4.0002, 1e-4) == 4
    assert resolvable_integer(1235.0, 1e-4) is None  # rtol·k = 0.12: 1234.93 and 1235 cannot be told apart
    assert resolvable_integer(4.03, 1e-2) == 4
    assert resolvable_integer(40.0, 1e-2) is None
    assert resolvable_integer(1.0, 1e-4) is None and resolvable_integer(math.inf, 1e-4) is None


@pytest.mark.parametrize(
    "counts, confused",
    [
        ([[[3, 1], [2, 2]], [[5, 1], [4, 2]]], Denominator.RANK),  # n_r equal in every step, n is not
        ([[[0, 1]]], Denominator.MICRO),  # the only valid microbatch holds all of N
        ([[[1, 4], [3, 0]]], Denominator.MICRO_GLOBAL),  # N_m = 4 for both microbatch indices
        ([[[4], [4]], [[3], [3]]], Denominator.RANK),  # equal counts everywhere
        ([[[1], [3]], [[4], [4]]], None),  # step 0 tells them apart
        ([[[3]], [[5]]], None),  # one rank, one microbatch: n_r is N
    ],
)
def test_a_token_mean_run_that_a_local_count_explains_just_as_well(counts: Any, confused: Denominator | None) -> None:
    steps = table(
        [
            step_row(i, weights(c, lambda N, **_: 1 / N, world_size=len(c)), world_size=len(c))
            for i, c in enumerate(counts)
        ]
    )
    diagnoses = diagnose_steps(steps, 1e-4)
    assert diagnoses.confused == confused
    undetermined = {d.denominator for d in diagnoses} == {Denominator.UNDETERMINED}
    assert undetermined == (confused is not None)


def test_a_long_run_costs_columns_not_an_object_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory bound's mechanism: diagnoses, votes, codes and spans are arrays; a Python object is
    made per finding or per span, never per step."""
    import tokaudit._normalization.vocabulary as normalization
    from tokaudit._checks import check_run, whole_run

    rng = np.random.default_rng(5)
    rows = []
    for step in range(20_000):
        counts = [[int(rng.integers(1, 300))], [int(rng.integers(1, 300))]]
        rows.append(step_row(step, weights(counts, lambda n_r, W, **_: 1 / (W * n_r))))
    steps = table(rows)
    for column in (
        "world_low",
        "divisor_low",
        "probe_spread",
        "masked_share",
        "nonfinite_valid",
        "nonfinite_zero",
        "unsynced_ranks",
        "skipped_true",
        "skipped_false",
        "sync_known",
        "sync_true",
        "reported",
        "unweighted_records",
        "declared_weights",
        "declared_low",
        "declared_high",
        "loss",
    ):
        steps[column] = (
            steps["world_high"] if column == "world_low" else steps["divisor_high"] if column == "divisor_low" else 0
        )
    steps["ranks"], steps["rank_mask"] = 2, 3
    for which in ("heavy", "light"):
        for field in ("rank", "micro", "n", "rank_tokens"):
            steps[f"{which}_{field}"] = 1
    steps["token_weight_low"], steps["token_weight_high"] = steps.weight_low, steps.weight_high
    made = []
    original = normalization.StepDiagnosis.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(normalization.StepDiagnosis, "__init__", counting)
    diagnoses = diagnose_steps(steps, 1e-4)
    assert isinstance(diagnoses.kind, np.ndarray) and len(diagnoses.kind) == 20_000
    findings, spans, omitted = check_run("long", whole_run(steps), 1e-4)
    uneven = sum(
        row["record_tokens_low"] != row["record_tokens_high"] for row in rows
    )  # equal counts weigh the same either way
    assert [f.code.value for f in findings] == ["local_mean"] and findings[0].steps.count == uneven
    assert len(spans) == 1 and omitted == 0 and len(made) < 10


def test_a_long_run_is_diagnosed_a_block_at_a_time() -> None:
    """The steps are diagnosed a block at a time (what that saves is measured in bench/): a table of many
    blocks gets the diagnoses each block gets alone."""
    from tokaudit._normalization import BLOCK_STEPS

    rng = np.random.default_rng(7)
    rows = []
    for step in range(2_000):
        counts = [[int(rng.integers(1, 300))], [int(rng.integers(1, 300))]]
        rows.append(step_row(step, weights(counts, lambda n_r, W, **_: 1 / (W * n_r) if step % 2 else 1 / W)))
    small = table(rows)
    steps = pd.concat([small] * 150, ignore_index=True)  # 300,000 steps
    steps["step"] = np.arange(len(steps))
    assert len(steps) > 4 * BLOCK_STEPS
    diagnoses = diagnose_steps(steps, 1e-4)
    # The same diagnoses as a block of the table alone gets: blocks change memory, not results.
    alone = diagnose_steps(small, 1e-4)
    assert (diagnoses.kind[:2_000] == alone.kind).all() and (diagnoses.denominator[:2_000] == alone.denominator).all()


def _vote_by_labels(fits: np.ndarray, alphas: np.ndarray, rtol: float) -> tuple[np.ndarray, np.ndarray]:
    """The vote written plainly: hypotheses from `cluster`'s labels in label order (NaN first), each
    represented by np.median of its α; the greedy cover recomputed from scratch at every pick."""
    hypotheses = []  # (members, candidate, representative)
    for c in range(fits.shape[1]):
        rows = np.flatnonzero(fits[:, c])
        if len(rows):
            labels = cluster(alphas[rows, c], rtol)
            for label in sorted(set(labels.tolist())):
                members = rows[labels == label]
                hypotheses.append((members, c, float(np.median(alphas[members, c]))))
    chosen, representative = np.full(len(fits), -1), np.full(len(fits), np.nan)
    taken = np.zeros(len(fits), dtype=bool)
    plain = [0 if c == 0 else 1 if abs(v - 1) <= rtol else 2 for _, c, v in hypotheses]
    while True:
        best = min(
            range(len(hypotheses)),
            default=None,
            key=lambda h: (-int((~taken[hypotheses[h][0]]).sum()), plain[h], hypotheses[h][1], h),
        )
        if best is None:
            break
        members, c, value = hypotheses[best]
        free = members[~taken[members]]
        if len(free) < 2:
            break
        chosen[free], representative[free], taken[free] = c, value, True
    for i in np.flatnonzero(~taken & fits.any(axis=1)):
        c = int(np.argmax(fits[i]))
        chosen[i], representative[i] = c, alphas[i, c]
    return chosen, representative


def test_a_block_s_candidates_are_the_whole_table_s_rows_bit_for_bit() -> None:
    """The table is read a block of steps at a time (`block_fits`, `Decisions`): a block's fits, q,
    nearest fits and α of every candidate are exactly the whole table's at those rows, positions and
    missing weights included."""
    from tokaudit._normalization import block_fits

    rng = np.random.default_rng(3)
    rows = []
    for step in range(300):
        counts = [[int(rng.integers(0, 40)), int(rng.integers(1, 40))], [int(rng.integers(1, 40)), 0]]
        rows.append(
            step_row(
                step,
                weights(counts, lambda n, M, **_: 1 / (n * M) if n else 0.0),
                world_size=2,
                divisor=float(rng.choice([1.0, 2.0, 3.0])),
                positions=int(rng.integers(1, 99)) if step % 3 else None,
            )
        )
    steps = table(rows)
    whole = block_fits(steps, 1e-4)
    for start, stop in ((0, 1), (1, 120), (120, 300), (299, 300)):
        part = block_fits(steps.iloc[start:stop], 1e-4)
        for name in ("fits", "usable", "distortion", "nearest", "nearest_spread", "alphas", "world", "micro"):
            np.testing.assert_array_equal(getattr(part, name), getattr(whole, name)[start:stop], err_msg=name)


def _vote(fits: np.ndarray, alphas: np.ndarray, rtol: float, block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The vote (`Decisions`) over these candidates' fits and α, read `block` steps at a time (all at once
    when None): each step's winning candidate and the α it is read with."""
    from tokaudit._normalization import Decisions, FitBlock

    size = block or max(len(fits), 1)
    ones = np.ones(len(fits))
    blocks = [
        FitBlock(
            fits[i : i + size],
            fits[i : i + size, 0],
            ones[i : i + size],
            np.full(len(fits[i : i + size]), -1),
            ones[i : i + size],
            alphas[i : i + size],
            ones[i : i + size],
            ones[i : i + size],
        )
        for i in range(0, len(fits), size)
    ]
    decisions = Decisions.of(blocks, lambda: blocks, rtol)
    votes = [decisions.vote(found) for found in blocks]
    return np.concatenate([v[0] for v in votes]), np.concatenate([v[1] for v in votes])


@pytest.mark.parametrize("seed", seeds(16))
def test_vote_equals_the_plain_greedy_cover(seed: int) -> None:
    """The vote's clusters are slices of the sorted α and their medians the slices' middles: the same
    steps won by the same hypotheses as the plain construction, on tables of competing hypotheses
    (several factors per candidate, noise at the tolerance, ties, α = 1, NaN α)."""
    rng = np.random.default_rng(seed)
    rtol = 1e-4
    steps, candidates = 300, 8
    # seeds from 12 on: one factor per candidate (the usual run: one cluster each, NaN aside)
    centers = np.array([1.0, 4.0, 0.25, 8.0, 1 / 3, 2.0]) if seed < 12 else np.array([4.0])
    alphas = centers[rng.integers(0, len(centers), (steps, candidates))]
    alphas *= 1 + rng.uniform(-0.9, 0.9, alphas.shape) * rtol * rng.integers(0, 2, alphas.shape)
    alphas[rng.random(alphas.shape) < 0.03] = np.nan
    if seed < 12:
        alphas[rng.random(alphas.shape) < 0.05] = rng.uniform(0.1, 10, 1)[0]  # an exact tie of many steps
    fits = rng.random((steps, candidates)) < rng.uniform(0.1, 0.7, candidates)
    expected_chosen, expected_representative = _vote_by_labels(fits, alphas, rtol)
    for block in (None, 1, 7, 64):  # whole, and read a few steps at a time
        chosen, representative = _vote(fits, alphas, rtol, block)
        np.testing.assert_array_equal(chosen, expected_chosen)
        np.testing.assert_array_equal(representative, expected_representative)  # NaN equals NaN here


def _plain_spans(
    frame: pd.DataFrame, keep: np.ndarray, denominator: np.ndarray, factor: np.ndarray
) -> tuple[list[Any], int]:
    """The spans by definition, one row at a time: the kept rows sorted by (group, term, step) as text
    and number, a span per run of equal (group, term, denominator, α) with NaN equal to NaN, the
    MAX_SPANS longest (the earliest among equals) of each (group, term), in order; and how many were left out."""
    from tokaudit._normalization import DENOMINATORS, MAX_SPANS, Span

    rows = sorted(
        (str(g), str(t), int(s), int(d), float(f))
        for g, t, s, d, f, k in zip(frame.grp, frame.term, frame.step, denominator, factor, keep)
        if k
    )
    runs: list[list[Any]] = []  # [group, term, first step, last step, length, denominator, α, first row]
    for index, (g, t, s, d, f) in enumerate(rows):
        last = runs[-1] if runs else None
        if last and (last[0], last[1], last[5]) == (g, t, d) and (last[6] == f or (f != f and last[6] != last[6])):
            last[3], last[4] = s, last[4] + 1
        else:
            runs.append([g, t, s, s, 1, d, f, index])
    chosen = []
    for pair in sorted({(r[0], r[1]) for r in runs}):
        mine = sorted((r for r in runs if (r[0], r[1]) == pair), key=lambda r: (-r[4], r[7]))
        chosen += mine[:MAX_SPANS]
    chosen.sort(key=lambda r: r[7])
    return [Span(g, t, a, b, n, DENOMINATORS[d], None if f != f else f) for g, t, a, b, n, d, f, _ in chosen], len(
        runs
    ) - len(chosen)


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64, 1 << 20])
def test_spans_read_a_block_at_a_time_are_the_spans_of_the_whole_table(
    block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`segments` reads SPAN_BLOCK rows at a time, carrying the open span and the longest kept ones:
    whatever the block size, its spans and count left out are those of a plain walk over the sorted
    rows (`_plain_spans`), on random diagnoses with empty steps, NaN α, runs of equal and alternating
    normalizations, several groups and terms and more spans than MAX_SPANS. A table out of (group,
    term, step) order, even only in a later block, gives the same spans too."""
    import tokaudit._normalization.spans as normalization_spans
    from tokaudit._normalization import DENOMINATORS, KINDS, Diagnoses

    monkeypatch.setattr(normalization_spans, "SPAN_BLOCK", block)
    rng = np.random.default_rng(block)
    left_out = []
    for trial in range(12):
        groups, terms = ["b", "a", "10", "9"][: 1 + trial % 4], ["0", "aux"][: 1 + trial % 2]
        rows = []
        for group in sorted(groups):
            for term in sorted(terms):
                count = 600 if trial == 0 else int(rng.integers(0, 260))
                steps = np.sort(rng.choice(10_000, size=count, replace=False))
                # long runs and alternating stretches, from a few values of (denominator, α)
                choice = np.repeat(rng.integers(0, 3, size=count // 5 + 1), 5)[:count]
                choice = np.where(rng.random(count) < 0.3, rng.integers(0, 3, size=count), choice)
                for step, c in zip(steps.tolist(), choice.tolist()):
                    rows.append((group, term, step, c))
        frame = pd.DataFrame(rows, columns=["grp", "term", "step", "choice"])
        frame["grp"] = pd.Categorical(frame.grp, categories=list(reversed(groups)))  # categories in any order
        frame["term"] = pd.Categorical(frame.term)
        count = len(frame)
        choice = frame.choice.to_numpy()
        empty = rng.random(count) < 0.1
        kind = np.where(empty, KINDS.index(StepKind.EMPTY), KINDS.index(StepKind.NONUNIFORM)).astype(np.int8)
        denominator = np.array(
            [
                DENOMINATORS.index(Denominator.N),
                DENOMINATORS.index(Denominator.RANK),
                DENOMINATORS.index(Denominator.RANK),
            ],
            dtype=np.int8,
        )[choice]
        factor = np.array([1.0, 0.5, np.nan])[choice]
        diagnoses = Diagnoses(
            kind, denominator, factor, np.full(count, np.nan), np.zeros(count, bool), np.full(count, np.nan)
        )
        whole = _plain_spans(frame, ~empty, denominator, factor)
        got = segments(frame, diagnoses)
        assert got == whole, (block, trial)
        left_out.append(got[1])
        if count > 2:
            # out of order from the middle on: the whole table is sorted and taken at once
            late = np.r_[np.arange(count // 2), np.arange(count // 2, count)[::-1]]
            shuffled = frame.iloc[late].reset_index(drop=True)
            moved = Diagnoses(
                kind[late],
                denominator[late],
                factor[late],
                diagnoses.distortion,
                diagnoses.balanced,
                diagnoses.approximate,
            )
            assert segments(shuffled, moved) == whole, (block, trial)
    assert max(left_out) > 0 and min(left_out) == 0  # tables of more spans than MAX_SPANS, and of fewer


@pytest.mark.parametrize("seed", seeds(24))
def test_the_vote_leaves_out_what_the_token_mean_covers_and_picks_the_same(seed: int) -> None:
    """A candidate that fits only steps of N's one hypothesis (N fits them all in one cluster, no NaN α)
    can win nothing: the vote leaves its hypotheses out. The picks must stay the plain greedy cover's:
    tables where N is one cluster and other candidates fit subsets of its steps (equal to them, as 1 and T
    in a correct run, or smaller, with several factors and NaN α), where candidates outside N take some
    of its steps first so that ties with N's shrinking count occur, and where N has a NaN α or two
    clusters (nothing may be left out then)."""
    rng = np.random.default_rng(100 + seed)
    rtol = 1e-4
    steps, candidates = int(rng.integers(4, 60)), 8
    fits = np.zeros((steps, candidates), dtype=bool)
    fits[:, 0] = rng.random(steps) < rng.uniform(0.3, 1.0)
    alphas = rng.choice([0.5, 1.0, 2.0, 3.0], (steps, candidates)) * (
        1 + rng.uniform(-0.4, 0.4, (steps, candidates)) * rtol
    )
    alphas[:, 0] = 8.0 * (1 + rng.uniform(-0.4, 0.4, steps) * rtol)
    for c in range(1, candidates):
        kind = rng.integers(0, 4)
        if kind == 0:
            fits[:, c] = fits[:, 0]  # the same steps (1, T, ΣT in a correct run)
        elif kind == 1:
            fits[:, c] = fits[:, 0] & (rng.random(steps) < 0.6)  # a subset
        elif kind == 2:
            fits[:, c] = rng.random(steps) < 0.5  # steps outside N too: competes with it
        if rng.random() < 0.2:
            alphas[rng.random(steps) < 0.2, c] = np.nan
    if seed % 6 == 5:
        alphas[int(rng.integers(0, steps)), 0] = np.nan  # nothing may be left out then
    if seed % 6 == 4:
        alphas[: steps // 3, 0] *= 3.0  # N in two clusters
    expected_chosen, expected_representative = _vote_by_labels(fits, alphas, rtol)
    for block in (None, 1, 5):
        chosen, representative = _vote(fits, alphas, rtol, block)
        np.testing.assert_array_equal(chosen, expected_chosen)
        np.testing.assert_array_equal(representative, expected_representative)


def test_the_vote_leaves_nothing_out_when_n_is_not_one_whole_cluster() -> None:
    """Only N's own one hypothesis, covering every step N fits, lets the vote leave candidates out:
    with NaN α on half of N's steps, a candidate fitting all of them in one cluster is larger than
    either of N's hypotheses and wins them; with N in two clusters, a candidate of α = 1 (plainer) wins
    a tie against another candidate's one cluster, not by being left out."""
    from tokaudit._normalization import PREFERENCE

    fits = np.zeros((10, len(PREFERENCE)), dtype=bool)
    fits[:, :3] = True
    alphas = np.full(fits.shape, np.nan)
    alphas[5:, 0] = 8.0
    alphas[:, 1], alphas[:, 2] = 2.0, 1.0
    chosen, _ = _vote(fits, alphas, 1e-4, 3)
    np.testing.assert_array_equal(chosen, _vote_by_labels(fits, alphas, 1e-4)[0])
    assert (chosen == 2).all()  # α = 1 beats α = 2 at equal size; N's halves are smaller
    alphas[:, 0] = [1.0] * 5 + [3.0] * 5  # N's two clusters of five
    chosen, _ = _vote(fits, alphas, 1e-4, 3)
    np.testing.assert_array_equal(chosen, _vote_by_labels(fits, alphas, 1e-4)[0])
    assert (chosen == 2).all()


def test_every_denominator_has_its_facts_in_the_one_table() -> None:
    """The recovery, the checks and the renderers read one table (`DENOMINATOR_FACTS`): it covers the enum, the
    local counts are the four that balanced counts can hide, in the order of preference, and every record-level
    candidate's bounds are step columns."""
    from tokaudit._engine import STEP_COLUMNS
    from tokaudit._normalization import DENOMINATOR_FACTS, LOCAL_DENOMINATORS, RECORD_BOUNDS, Denominator

    assert list(DENOMINATOR_FACTS) == list(Denominator) and all(facts.words for facts in DENOMINATOR_FACTS.values())
    assert LOCAL_DENOMINATORS == (
        Denominator.RANK,
        Denominator.MICRO_TIMES_M,
        Denominator.MICRO,
        Denominator.MICRO_GLOBAL,
    )
    assert all(DENOMINATOR_FACTS[d].confused[0] for d in LOCAL_DENOMINATORS)
    names = {column.name for column in STEP_COLUMNS}
    assert all(low in names and high in names for low, high in RECORD_BOUNDS.values())
    # the codes a weighting by a denominator is are the code table's weighting family, the one --min-ratio gates
    from tokaudit.codes import WEIGHTING

    assert {facts.code for facts in DENOMINATOR_FACTS.values() if facts.code is not None} == WEIGHTING
