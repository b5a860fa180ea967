"""Each finding code from a small hand-made log, and the normalization recovered from it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.logs import audit_rows, codes, only, UNEVEN, UNEVEN_GA, local_mean, records, token_loss, token_mean, write
from tests.logs import write_by_rank
from tokaudit._auditing import audit
from tokaudit._report import AuditReport
from tokaudit._schema import PROVENANCE_KEY
from tokaudit.codes import Code, Severity


@pytest.mark.parametrize(
    "name, counts, scalar, extra",
    [
        ("average", UNEVEN, token_mean, {}),
        ("average_ga", UNEVEN_GA, token_mean, {}),
        ("sum", UNEVEN_GA, lambda S, N, **_: S / N, {"grad_divisor": 1.0}),
        ("raw_sum_rescaled", UNEVEN, lambda S, **_: S, {}),  # g = W/N is added per step below
    ],
)
def test_correct_constructions_pass(tmp_path: Path, name: str, counts: Any, scalar: Any, extra: dict[str, Any]) -> None:
    rows = records(counts, scalar, **extra)
    if name == "raw_sum_rescaled":
        for row in rows:  # torchtune: b = S, then scale_grads(W/N)
            step_tokens = sum(sum(r) for r in counts[row["step"]])
            row["grad_scale"] = row["world_size"] / step_tokens
    report = audit_rows(tmp_path, rows)
    (run,) = report.runs
    assert report.findings == [] and run.verdict == "correct"
    assert run.max_weight_ratio == pytest.approx(1.0)
    assert run.normalization is not None and run.normalization.denominator == "N"
    expected_factor = 1.0 if name == "sum" else 2.0
    assert run.normalization.factor == pytest.approx(expected_factor)


def test_local_mean_names_the_heaviest_and_lightest_token(tmp_path: Path) -> None:
    report = audit_rows(tmp_path, records(UNEVEN, local_mean))
    finding = only(report, Code.LOCAL_MEAN)
    assert finding.severity == Severity.ERROR and finding.steps.count == 3
    assert report.runs[0].verdict == "incorrect"
    assert report.runs[0].normalization.denominator == "n_rank"  # type: ignore[union-attr]
    # Step 0: n = (1, 3), W = 2, D = 2: e0 = 1/2, e1 = 1/6, ratio 3; at step 1 n = (5, 2): ratio 2.5.
    evidence = finding.evidence
    assert evidence["step"] == 0 and evidence["weight_ratio"] == pytest.approx(3.0)
    assert evidence["heaviest"]["rank"] == 0 and evidence["heaviest"]["valid_tokens"] == 1
    assert evidence["lightest"]["rank"] == 1 and evidence["lightest"]["valid_tokens"] == 3
    assert evidence["heaviest"]["distortion"] == pytest.approx(0.5 * 4)
    assert "3× the weight" in finding.message and "W=2" in finding.fix
    assert report.runs[0].max_weight_ratio == pytest.approx(3.0)


def test_local_mean_over_accumulation_recovers_n_times_m(tmp_path: Path) -> None:
    report = audit_rows(tmp_path, records(UNEVEN_GA, lambda S, n, M, **_: S / n / M))
    finding = only(report, Code.LOCAL_MEAN)
    assert finding.evidence["denominator"] == "n_micro*M" and finding.evidence["factor"] == pytest.approx(1.0)
    assert "all 2 microbatches" in finding.fix


def test_a_microbatch_mean_times_w_reads_as_its_own_count_times_w(tmp_path: Path) -> None:
    """b = W·S/n per microbatch, not divided by M (what the HF Trainer makes of a model that returns its own mean):
    n and n·M fit alike (α = W and W·M); the reading is the microbatch's count times W, not a mean divided by M."""
    report = audit_rows(tmp_path, records(UNEVEN_GA, lambda S, n, W, **_: W * S / n))
    finding = only(report, Code.LOCAL_MEAN)
    assert finding.evidence["denominator"] == "n_micro" and finding.evidence["factor"] == pytest.approx(2.0)
    assert "gradient_accumulation_steps" not in finding.message and "b·g = 2·S/n" in finding.message


def test_a_count_taken_before_the_shift_is_named_not_a_local_mean(tmp_path: Path) -> None:
    """torchtune's recipe: each microbatch's mean S/n times its count taken before the shift, n + 3 with 3 rows,
    summed and rescaled by W/(N + 3·R) after backward: e = (n + 3)/(n·(N + 3R))."""
    counts = [[[40, 7], [12, 90]], [[25, 60], [9, 33]], [[70, 14], [50, 5]]]
    rows = records(counts, lambda S, n, **_: S / n * (n + 3))
    for row in rows:
        row["grad_scale"] = 2 / sum(n + 3 for rank in counts[row["step"]] for n in rank)
    finding = only(audit_rows(tmp_path, rows), Code.UNEXPLAINED_WEIGHTING)
    assert finding.evidence["extra_labels_per_record"] == 3 and "before the causal shift" in finding.message
    # a plain local mean (every record's e·n alike) never reads as a shift, nor a count off by one, S/(n + 1),
    # whose two extremes solve to k = n_h·n_l, more labels than the heavier record has
    assert (
        "extra_labels_per_record"
        not in only(audit_rows(tmp_path / "mean", records(counts, local_mean)), Code.LOCAL_MEAN).evidence
    )
    for case, near in enumerate(([[[1], [7], [1]]] * 3, [[[3, 8], [5, 2]], [[1, 6], [9, 4]]], counts)):
        near_miss = audit_rows(tmp_path / f"near{case}", records(near, lambda S, n, W, **_: W * S / (n + 1)))
        assert near_miss.findings and all("extra_labels_per_record" not in f.evidence for f in near_miss.findings)


HF_PROVENANCE = {b"tokaudit.provenance": b'{"trainer": "transformers", "trainer_version": "5.24.0", "world_size": 2}'}
"""The footer note the Hugging Face callback's recorder writes."""


@pytest.mark.parametrize("trainer", [False, True])
def test_a_microbatch_mean_times_w_says_so_and_names_the_trainer_s_fix(tmp_path: Path, trainer: bool) -> None:
    """b = W·S/n: the message says each microbatch's mean was multiplied by W and not divided by M (about W·M
    times the token mean); a log the Hugging Face callback recorded gets the Trainer's own settings as the fix."""
    rows = records(UNEVEN_GA, lambda S, n, W, **_: W * S / n)
    finding = only(audit([write_by_rank(tmp_path / "run", rows, HF_PROVENANCE if trainer else None)]), Code.LOCAL_MEAN)
    assert "its own mean over its n valid tokens, multiplied by W=2 and not divided by the M=2" in finding.message
    assert "W·M=4 times the token mean" in finding.message
    assert ("num_items_in_batch" in finding.message) == trainer
    assert ("compute_loss_func that sums the per-token losses" in finding.fix) == trainer


@pytest.mark.parametrize("trainer", [False, True])
def test_a_count_of_every_label_before_the_shift_is_named(tmp_path: Path, trainer: bool) -> None:
    """W·S/N' with N' counting every label while the loss covers all but the first of each row (GPT-2 under the
    Hugging Face Trainer): every token light by a share that varies, named as a count before the causal shift;
    the Trainer's own setting as the fix where the log says it recorded the run."""
    rows = records(UNEVEN_GA, lambda S, N, W, **_: W * S / (N + 3))  # q = N/(N + 3): each step its own
    finding = only(
        audit([write_by_rank(tmp_path / "run", rows, HF_PROVENANCE if trainer else None)]), Code.SCALE_MISMATCH
    )
    assert "one label per row counted before a causal shift" in finding.message
    assert ("model.loss_type" in finding.fix) == trainer and ("W·S_r/N" in finding.fix) != trainer


def test_per_micro_global_denominator(tmp_path: Path) -> None:
    report = audit_rows(tmp_path, records(UNEVEN_GA, lambda S, N_m, M, W, **_: W * S / (M * N_m)))
    finding = only(report, Code.PER_MICRO_DENOMINATOR)
    assert finding.evidence["denominator"] == "N_m"
    assert codes(report) == {"per_micro_denominator"}


@pytest.mark.parametrize(
    "scalar, divisor, factor, cause",
    [
        (lambda S, N, **_: S / N, None, "1/2", "W factor is missing"),  # S/N into an average
        (lambda S, N, **_: 8 * S / N, None, 4, "hard-coded W"),  # 8·S/N on W = 2
        (lambda S, N, W, **_: W * S / N, 1.0, 2, "summing reduction"),  # W·S/N into a sum
    ],
)
def test_world_size_mismatch(tmp_path: Path, scalar: Any, divisor: float | None, factor: Any, cause: str) -> None:
    extra = {} if divisor is None else {"grad_divisor": divisor}
    report = audit_rows(tmp_path, records(UNEVEN_GA, scalar, **extra))
    finding = only(report, Code.WORLD_SIZE_MISMATCH)
    assert finding.evidence["integer_factor"] == factor and cause in finding.message
    assert codes(report) == {"world_size_mismatch"}
    assert report.runs[0].max_weight_ratio == pytest.approx(1.0)


@pytest.mark.parametrize("microbatches", [2, 3])
def test_a_token_mean_divided_again_by_the_accumulation_steps_is_named(tmp_path: Path, microbatches: int) -> None:
    """b = W·S/(N·M): the token mean, then ÷ gradient_accumulation_steps. With M = 3 the factor 1/3 is named as
    that division; with M = 2 = W it reads as the missing W or as the division, and both are said."""
    counts = [
        [[5, 1, 2][:microbatches], [3, 7, 4][:microbatches]],
        [[2, 6, 1][:microbatches], [6, 2, 5][:microbatches]],
    ]
    rows = records(counts, lambda S, N, W, M, **_: W * S / (N * M))
    finding = only(audit_rows(tmp_path, rows), Code.WORLD_SIZE_MISMATCH)
    assert f"divided again by the M={microbatches} accumulation steps" in finding.message
    assert ("the W factor is missing" in finding.message) == (microbatches == 2)


def test_scale_mismatch_and_unnormalized_sum(tmp_path: Path) -> None:
    report = audit_rows(tmp_path / "a", records(UNEVEN_GA, lambda S, N, W, **_: 0.7 * W * S / N))
    assert only(report, Code.SCALE_MISMATCH).evidence["distortion"] == pytest.approx(0.7)
    report = audit_rows(tmp_path / "b", records(UNEVEN_GA, lambda S, **_: S))
    finding = only(report, Code.SCALE_MISMATCH)
    assert finding.evidence["denominator"] == "1" and "without a token denominator" in finding.message
    assert finding.severity == Severity.WARNING
    # b = S to the bit, which a per-microbatch mean logged in both columns gives too: the message says so
    assert "If loss_sum holds each record's mean (S/n) rather than its sum, as b does" in finding.message
    report = audit_rows(tmp_path / "c", records(UNEVEN_GA, lambda S, **_: 3 * S))
    assert "record's mean" not in only(report, Code.SCALE_MISMATCH).message
    negated = only(audit_rows(tmp_path / "d", records(UNEVEN_GA, lambda S, N, W, **_: -W * S / N)), Code.SCALE_MISMATCH)
    assert "Every weight is negative: the update ascended the loss" in negated.message
    assert (
        "negative"
        not in only(
            audit_rows(tmp_path / "e", records(UNEVEN_GA, lambda S, N, W, **_: 0.7 * W * S / N)), Code.SCALE_MISMATCH
        ).message
    )


def test_padded_denominators(tmp_path: Path) -> None:
    # Local: every microbatch divided by its own positions, which differ between ranks.
    rows = records(UNEVEN, lambda S, **_: S)
    for row in rows:
        row["positions"] = 8 if row["rank"] == 0 else 16
        row["backward_scalar"] = row["loss_sum"] / row["positions"]
    finding = only(audit_rows(tmp_path / "local", rows), Code.PADDED_DENOMINATOR)
    assert finding.evidence["denominator"] == "T"
    # Global: W·S/ΣT, uniform weights but q = N/ΣT.
    rows = records(UNEVEN, lambda S, W, **_: W * S / 16, positions=8)
    finding = only(audit_rows(tmp_path / "global", rows), Code.PADDED_DENOMINATOR)
    assert finding.evidence["denominator"] in ("T", "T_step") and finding.evidence["positions"] == 16
    assert finding.evidence["distortion"] == pytest.approx(4 / 16)
    # Each microbatch over its own 16 positions, 2 a rank: uniform (every record holds as many), q = N/(W·T·...), and
    # the message names each microbatch's positions, not the step's (it said "all 64 positions of the step")
    rows = records(UNEVEN_GA, lambda S, **_: S / 16, positions=16)
    finding = only(audit_rows(tmp_path / "each", rows), Code.PADDED_DENOMINATOR)
    assert finding.evidence["denominator"] == "T", finding.evidence
    assert "Each microbatch's loss was divided by its own positions T" in finding.message
    assert "positions of the step" not in finding.message


def test_positions_that_never_change_are_no_evidence_of_a_padded_denominator(tmp_path: Path) -> None:
    """T = 16 on every record: b = W·S/50 fits S/T exactly as it fits a constant, so the run is said to divide by
    a constant (scale_mismatch, denominator 1), not by its positions; two steps of one N and one T whose weights
    are off by one factor read as a scale on N."""
    counts = [[[3, 5], [4, 4]], [[1, 2], [6, 7]], [[2, 2], [2, 9]]]
    report = audit_rows(tmp_path / "constant", records(counts, lambda S, W, **_: W * S / 50, positions=16))
    assert only(report, Code.SCALE_MISMATCH).evidence["denominator"] == "1"
    same = [[[3, 5], [4, 4]], [[3, 5], [4, 4]]]
    report = audit_rows(tmp_path / "same", records(same, lambda S, N, W, **_: 0.8 * W * S / N, positions=8))
    assert only(report, Code.SCALE_MISMATCH).evidence["denominator"] == "N"
    # T itself (α = 1) is named even where it never changes: b = W·S/ΣT, ΣT = 64 a step
    report = audit_rows(tmp_path / "itself", records(counts, lambda S, W, **_: W * S / 64, positions=16))
    assert only(report, Code.PADDED_DENOMINATOR).evidence["denominator"] in ("T", "T_step")


def test_unexplained_weighting(tmp_path: Path) -> None:
    weights = iter([0.9, 0.1, 0.3, 0.2, 0.5, 0.05])
    report = audit_rows(tmp_path, records(UNEVEN, lambda S, **_: S * next(weights)))
    assert codes(report) == {"unexplained_weighting"}
    assert "negative" not in only(report, Code.UNEXPLAINED_WEIGHTING).message


def test_a_loss_sum_logged_as_the_mean_is_named_by_weights_that_are_each_record_s_own_n(tmp_path: Path) -> None:
    """The token mean's b over a loss_sum that holds the record's mean S/n: each token weighs n/N, no denominator of
    the vocabulary. The message says what gives exactly that; weights that are not n/N do not get it."""
    rows = records(UNEVEN_GA, token_mean)
    for row in rows:
        row["loss_sum"] /= row["valid_tokens"]
    finding = only(audit_rows(tmp_path / "means", rows), Code.UNEXPLAINED_WEIGHTING)
    assert (
        "weighs its record's own n/N" in finding.message and "loss_sum that holds the record's mean" in finding.message
    )
    weights = iter([0.9, 0.1, 0.3, 0.2, 0.5, 0.05])
    other = audit_rows(tmp_path / "other", records(UNEVEN, lambda S, **_: S * next(weights)))
    assert "own n/N" not in only(other, Code.UNEXPLAINED_WEIGHTING).message


def test_a_token_whose_weight_is_negative_is_said_to_be_ascended_not_infinitely_lighter(tmp_path: Path) -> None:
    """One record's b negated: its tokens weigh −1/N. The message says the update ascended its loss, not that the other
    tokens weighed inf× as much."""
    rows = records(UNEVEN_GA, token_mean)
    rows[1]["backward_scalar"] = -rows[1]["backward_scalar"]
    report = audit_rows(tmp_path, rows)
    finding = only(report, Code.UNEXPLAINED_WEIGHTING)
    assert report.runs[0].verdict == "incorrect" and finding.steps.first == 0
    assert "received a negative weight, -1/N: the update ascended its loss" in finding.message
    assert "inf×" not in finding.message


def test_probe_findings(tmp_path: Path) -> None:
    rows = records(UNEVEN, token_mean)
    for row in rows:
        weight = row["backward_scalar"] / row["loss_sum"]
        row.update(
            token_weight_sum=weight * row["valid_tokens"],
            token_weight_min=weight,
            token_weight_max=weight,
            masked_weight_abs_sum=0.0,
            backward_scalar=None,
        )
    rows[0].update(
        token_weight_min=rows[0]["token_weight_min"] * 0.8, token_weight_max=rows[0]["token_weight_max"] * 1.25
    )
    rows[1]["masked_weight_abs_sum"] = 0.25
    report = audit_rows(tmp_path, rows, keep_steps=True)
    assert codes(report) == {"nonuniform_in_microbatch", "masked_tokens_weighted"}
    assert report.runs[0].max_weight_ratio == pytest.approx(1.25 / 0.8)
    (spread,) = (f.evidence for f in report.findings if f.code == Code.NONUNIFORM_IN_MICROBATCH)
    assert spread == {"steps": 1, "largest_spread": pytest.approx((1.25 - 0.8) / 1.25)}  # (max − min) / max
    (masked,) = (f.evidence for f in report.findings if f.code == Code.MASKED_TOKENS_WEIGHTED)
    # 0.25 of ∂b/∂ℓ on masked positions, where each valid token of that record got b/S
    mean_weight = rows[1]["token_weight_sum"] / rows[1]["valid_tokens"]
    assert masked == {"steps": 1, "masked_weight_in_tokens": pytest.approx(0.25 / mean_weight)}
    # judged at --rtol above the step table, which is the same whatever the tolerance
    loose = audit([tmp_path / "run"], rtol=0.4, keep_steps=True)
    assert "nonuniform_in_microbatch" not in codes(loose)
    assert report.steps is not None and loose.steps is not None
    pd.testing.assert_frame_equal(report.steps, loose.steps)


def _probed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The probe's columns of a record whose every valid token got the weight b/S (a reduced loss)."""
    for row in rows:
        weight = row["backward_scalar"] / row["loss_sum"]
        row.update(
            token_weight_sum=weight * row["valid_tokens"],
            token_weight_min=weight,
            token_weight_max=weight,
            masked_weight_abs_sum=0.0,
        )
    return rows


def test_a_count_the_probe_contradicts_leaves_its_steps_out_and_calls_nothing_wrong(tmp_path: Path) -> None:
    """The training is right (W·S/N on the labelled tokens) but valid_tokens counts every attended position
    (10 a microbatch): Σ∂b/∂ℓ / n falls below the probe's one weight. Without the check every step is
    `unexplained_weighting`, an error about a correct run; with it, count_mismatch and inconclusive."""
    rows = _probed(records(UNEVEN_GA, token_mean))
    for row in rows:
        row["valid_tokens"] = 10
    report = audit_rows(tmp_path, rows)
    assert codes(report) == {"count_mismatch"} and report.runs[0].verdict == "inconclusive"
    finding = only(report, Code.COUNT_MISMATCH)
    assert finding.severity == Severity.WARNING and (finding.steps.first, finding.steps.last, finding.steps.count) == (
        0,
        2,
        3,
    )
    # Step 0: labelled counts (5, 1 | 3, 7), N = 16, every token's weight b/S = 2/16, e = 1/16 (D = 2). The
    # recorded N is 40: q = e·40 = 2.5 on every token; the lightest record, n = 1 of 10: 2.5/10 = 0.25.
    evidence = finding.evidence
    assert evidence["step"] == 0 and evidence["global_tokens"] == 40
    assert evidence["probe_weight_range"] == pytest.approx([2.5, 2.5]) and evidence["mean_weight"] == pytest.approx(
        0.25
    )
    assert "the same weight, 2.5/N, on every valid token" in finding.message and "0.25/N, below" in finding.message
    assert report.runs[0].rows == 0 and report.runs[0].steps == 0


def test_only_the_miscounted_steps_are_left_out(tmp_path: Path) -> None:
    """One record of step 1 counts two tokens too many: that step (both its loss terms) is left out, the
    others judged; a local mean stays an error on them, a correct run has only the warning."""
    for name, scalar in (("right", token_mean), ("wrong", local_mean)):
        rows = _probed(records(UNEVEN_GA, scalar))
        aux = [dict(row, term="aux") for row in rows]
        rows[5]["valid_tokens"] += 2  # step 1, rank 0, microbatch 1
        report = audit_rows(tmp_path / name, rows + aux)
        finding = only(report, Code.COUNT_MISMATCH)
        assert (finding.steps.first, finding.steps.last, finding.steps.count) == (1, 1, 1)
        assert finding.evidence["step"] == 1 and "below that range" in finding.message  # Σ∂b/∂ℓ over more tokens
        (run,) = report.runs
        assert run.steps == 2 and run.rows == 2 * 4 * 2  # steps 0 and 2: 4 records, both terms
        if name == "right":
            assert codes(report) == {"count_mismatch"} and run.verdict == "inconclusive"
        else:
            assert codes(report) == {"count_mismatch", "local_mean"} and run.verdict == "incorrect"
            local = [f for f in report.findings if f.code == Code.LOCAL_MEAN]
            assert all(f.steps.count == 2 for f in local)


def test_weights_that_differ_inside_a_record_are_no_miscount(tmp_path: Path) -> None:
    """A per-sequence objective weighs a record's tokens unequally: Σ∂b/∂ℓ / n is their mean, inside the
    probe's range however far apart its lightest and heaviest token are: no count_mismatch."""
    rows = _probed(records(UNEVEN_GA, token_mean))
    for row in rows:
        mean = row["token_weight_sum"] / max(row["valid_tokens"], 1)
        row.update(token_weight_min=mean / 3, token_weight_max=mean * 1.0001 if row["valid_tokens"] == 1 else mean * 5)
    report = audit_rows(tmp_path, rows)
    assert "count_mismatch" not in codes(report) and report.runs[0].steps == 3


def test_miscounted_rows_compare_the_mean_weights_with_the_probe_s_extremes() -> None:
    """The rule on a hand-made step table: e's extremes outside the probe's by more than rtol, where a
    record was probed; NaN (no weight) and unprobed steps are never flagged."""
    from tokaudit._checks import miscounted_rows

    table = pd.DataFrame(
        {
            "probed": [4, 4, 4, 4, 0, 4, 4],
            "weight_low": [0.25, 0.2499, 0.2, 0.25, 0.1, np.nan, 0.25],
            "weight_high": [0.25, 0.25, 0.25, 0.2501, 0.5, np.nan, 0.250001],
            "token_weight_low": [0.25, 0.25, 0.25, 0.25, 0.2, 0.25, 0.25],
            "token_weight_high": [0.25, 0.25, 0.25, 0.25, 0.2, 0.25, 0.25],
        }
    )
    assert miscounted_rows(table, 1e-4).tolist() == [False, True, True, True, False, False, False]
    assert miscounted_rows(table.drop(columns=["token_weight_low"]), 1e-4).tolist() == [False] * 7


def _bfloat16(value: float) -> float:
    """Rounded to bfloat16 (the upper 16 bits of a float32, to nearest even), as float64."""
    bits = int(np.array([value], dtype=np.float32).view(np.uint32)[0])
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _logged_in_bfloat16(probe: bool, divided_in_float32: bool = False) -> list[dict[str, Any]]:
    """W·S/N computed on bf16 values: S and b rounded to 8 significant bits, or the probe's per-token weight
    bf16(2/N). Every token's q is 1 within 2⁻⁸: the token mean up to bf16 rounding. `divided_in_float32`: S rounded
    to bf16 once, then W·S/N computed in float32 (b holds more bits than bf16's) and S logged unrounded."""
    counts = [[[37, 5], [13, 71]], [[22, 60], [61, 2]], [[8, 44], [29, 80]], [[50, 50], [3, 90]]] * 3
    rows = records(counts, token_mean)
    for row in rows:
        tokens = sum(sum(rank) for rank in counts[row["step"]])
        if divided_in_float32:
            row["backward_scalar"] = float(np.float32(2 * np.float32(_bfloat16(row["loss_sum"])) / np.float32(tokens)))
            continue
        row["loss_sum"] = _bfloat16(row["loss_sum"])
        row["backward_scalar"] = _bfloat16(2 * row["loss_sum"] / tokens)
        if probe:
            weight = _bfloat16(_bfloat16(2.0) / tokens)
            row.update(token_weight_sum=weight * row["valid_tokens"], token_weight_min=weight, token_weight_max=weight)
    return rows


@pytest.mark.parametrize("probe", [True, False])
def test_a_log_whose_every_b_holds_bfloat16_s_bits_is_never_incorrect_for_its_rounding(
    tmp_path: Path, probe: bool
) -> None:
    """The same bf16 loop logged as Python numbers, no precision_bits: every b holding 8 significant bits may say
    where it was computed (or be round numbers), so weights within two bf16 roundings say the logs cannot tell (it
    read incorrect). A log with precision_bits = 8 is judged at that precision (the test below)."""
    right = audit_rows(tmp_path / "right", _logged_in_bfloat16(probe))
    assert right.runs[0].verdict != "incorrect" and all(f.undecidable for f in right.findings), right.findings


@pytest.mark.parametrize("probe", [True, False])
def test_a_right_loop_computed_in_bfloat16_is_judged_at_its_precision(tmp_path: Path, probe: bool) -> None:
    """The training is the token mean up to bf16 rounding, and the log says so (precision_bits = 8, as the
    recorder writes for bf16 values or a bf16 gradient): correct, judged at 2^(1−8); a local mean computed in
    bf16, its ranks' tokens 2× apart, is still a local mean at that precision."""
    right = audit_rows(tmp_path / "right", [dict(row, precision_bits=8) for row in _logged_in_bfloat16(probe)])
    assert right.findings == [] and right.runs[0].verdict == "correct"
    assert (right.runs[0].precision_bits, right.runs[0].rtol) == (8, 2.0**-7)
    counts = [[[40, 40], [20, 20]], [[30, 30], [60, 60]]] * 3  # each step's ranks 2× apart
    wrong = [
        dict(
            row,
            loss_sum=_bfloat16(row["loss_sum"]),
            backward_scalar=_bfloat16(row["backward_scalar"]),
            precision_bits=8,
        )
        for row in records(counts, local_mean)
    ]
    report = audit_rows(tmp_path / "wrong", wrong)
    assert report.runs[0].verdict == "incorrect" and "local_mean" in codes(report)
    assert audit_rows(tmp_path / "float32", records(counts, local_mean)).runs[0].rtol == 1e-4  # nothing said


@pytest.mark.parametrize("probe", [True, False])
def test_a_deviation_within_bfloat16_rounding_says_so_and_rtol_clears_it(tmp_path: Path, probe: bool) -> None:
    """Where the log does not say its precision (a log without precision_bits, values recorded as Python
    floats) and its b are no bf16 values (S rounded to bf16, then divided in float32): a finding whose every weight is
    within 2⁻⁷ of the token mean's says that bf16 rounds that far and names --rtol 1e-2, which then finds nothing;
    W applied twice (q ≈ 2), on the same values, says no such thing."""
    rows = _logged_in_bfloat16(probe, divided_in_float32=True)
    report = audit_rows(tmp_path / "bf16", rows)
    (finding,) = report.findings
    assert finding.code.value == "unexplained_weighting"  # (the probe's bf16 weights beside float32 b: no one factor)
    assert finding.evidence["within_bfloat16_rounding"] is True and "audit with --rtol 1e-2" in finding.message
    assert audit([tmp_path / "bf16"], rtol=1e-2).findings == []
    doubled = ("backward_scalar", "token_weight_sum", "token_weight_min", "token_weight_max")  # 2·W·S/N
    wrong = audit_rows(tmp_path / "w", [{**row, **{k: row[k] * 2 for k in doubled if k in row}} for row in rows])
    assert wrong.findings and wrong.runs[0].verdict == "incorrect"  # q ≈ 2, whatever code bf16's rounding leaves
    assert all("within_bfloat16_rounding" not in f.evidence and "--rtol" not in f.message for f in wrong.findings)


def test_missing_rank_uneven_microbatches_and_world_size(tmp_path: Path) -> None:
    rows = records(UNEVEN_GA, token_mean)
    rows = [r for r in rows if not (r["step"] == 1 and r["rank"] == 1)]
    report = audit_rows(tmp_path / "missing", rows)
    finding = only(report, Code.MISSING_RANK)
    assert finding.evidence["missing_ranks"] == [1] and finding.steps.first == 1
    # the step's N lacks rank 1's tokens, so its weights read light by their share: no scale of the loss to fix
    assert codes(report) == {"missing_rank"}, codes(report)
    assert "its tokens are missing from N here" in finding.message

    # a rank of no valid token at step 1, its rows left out of a log written by hand: the records there weigh every
    # token 1/N of their own, which the message says (its fix: record every backward, n = 0 included)
    rows = [r for r in records([[[5, 1], [3, 7]], [[2, 6], [0, 0]], [[8, 4], [2, 8]]], token_mean) if r["valid_tokens"]]
    finding = only(audit_rows(tmp_path / "empty", rows), Code.MISSING_RANK)
    assert finding.evidence["missing_ranks"] == [1] and "held none that N counted" in finding.message
    assert "n = 0 included" in finding.message and "missing from N" not in finding.message

    rows = records([[[3, 2], [4]], [[1, 1], [2, 2]]], token_mean)
    report = audit_rows(tmp_path / "uneven", rows)
    assert only(report, Code.UNEVEN_MICROBATCHES).steps.first == 0
    # no record says whether it synced: one synced backward a rank, or one a microbatch, the logs cannot tell
    assert report.runs[0].verdict == "inconclusive"
    unsynced = [dict(r, sync=True) for r in rows]  # every backward synced: rank 0's second pairs with another
    assert audit_rows(tmp_path / "every", unsynced).runs[0].verdict == "incorrect"


def test_a_rank_whose_records_end_early_by_at_most_a_shard_leaves_those_steps_unjudged(tmp_path: Path) -> None:
    """A rank killed at once loses what its recorder held since its last shard: in files of 2 steps a rank, rank 1's
    end at step 3 and rank 0's at 5. Steps 4–5 hold rank 0's tokens alone: left out and said (unfinished_update),
    the run correct. A rank short by more than its widest shard is a rank missing, as is one whose recorder the
    training code closed. In files of every rank (a compaction's), no footer says which: those steps are left out
    and the run is inconclusive; a rank that is back after a step without it is missing there."""
    rows = records(UNEVEN_GA * 2, token_mean)
    killed = write_by_rank(tmp_path / "killed", [r for r in rows if r["rank"] == 0 or r["step"] <= 3], steps_per_file=2)
    report = audit([killed])
    (finding,) = report.findings
    assert report.runs[0].verdict == "correct" and finding.code == Code.UNFINISHED_UPDATE
    assert (finding.steps.first, finding.steps.last) == (4, 5) and finding.evidence["stopped_ranks"] == [1]
    assert "rank 1 stops at step 3" in finding.message

    short = write_by_rank(tmp_path / "short", [r for r in rows if r["rank"] == 0 or r["step"] <= 1], steps_per_file=2)
    assert only(audit([short]), Code.MISSING_RANK).steps.first == 2
    together = write(tmp_path / "together" / "all.parquet", [r for r in rows if r["rank"] == 0 or r["step"] <= 3])
    compacted = audit([together.parent])
    (finding,) = compacted.findings
    assert finding.code == Code.UNFINISHED_UPDATE and finding.severity == Severity.WARNING and finding.undecidable
    assert (finding.steps.first, finding.steps.last) == (4, 5) and "cannot say which" in finding.message
    assert compacted.runs[0].verdict == "inconclusive"
    back = write(tmp_path / "back" / "all.parquet", [r for r in rows if r["rank"] == 0 or r["step"] != 4])
    assert only(audit([back.parent]), Code.MISSING_RANK).steps.first == 4
    local = write(
        tmp_path / "local" / "all.parquet",
        [r for r in records(UNEVEN_GA * 2, local_mean) if r["rank"] == 0 or r["step"] <= 3],
    )
    assert audit([local.parent]).runs[0].verdict == "incorrect"  # judged on the steps before the end
    # rank 1's last shard says its recorder was closed by the training code (under DDP's join(), say): it ended
    # on purpose, while the other rank's updates went on without its tokens
    joined = write_by_rank(tmp_path / "joined", [r for r in rows if r["rank"] == 0 or r["step"] <= 3], steps_per_file=2)
    (joined / "rank-00001-000002.parquet").unlink()
    write(
        joined / "rank-00001-000002.parquet",
        [r for r in rows if r["rank"] == 1 and r["step"] in (2, 3)],
        metadata={PROVENANCE_KEY: b'{"closed": true}'},
    )
    assert only(audit([joined]), Code.MISSING_RANK).steps.first == 4
    # a relaunch: both ranks closed at the end of launch 0 (steps 0–3), launch 4 went on and rank 1 was killed before
    # its first shard: only a close in the group's latest launch says a rank ended on purpose
    relaunched = tmp_path / "relaunched"
    for rank in (0, 1):
        first = {"launch": {"id": "a", "first_shard": 0}, "closed": True}
        held = [r for r in rows if r["rank"] == rank and r["step"] <= 3]
        write(
            relaunched / f"rank-{rank:05d}-000000.parquet", held, metadata={PROVENANCE_KEY: json.dumps(first).encode()}
        )
    later = {"launch": {"id": "b", "first_shard": 4}}
    held = [r for r in rows if r["rank"] == 0 and 4 <= r["step"] <= 5]
    write(relaunched / "rank-00000-000004.parquet", held, metadata={PROVENANCE_KEY: json.dumps(later).encode()})
    (finding,) = audit([relaunched]).findings
    assert finding.code == Code.UNFINISHED_UPDATE and (finding.steps.first, finding.steps.last) == (4, 5)


def test_a_close_any_footer_says_keeps_a_ragged_end_a_missing_rank_and_each_group_s_end_is_read(
    tmp_path: Path,
) -> None:
    """Rank 1's recorder closed by the training code at step 3 (out of data under join()), rank 0 on to 5: missing,
    incorrect, whether its shards give their steps or not, and beside a compacted copy of the same records (which
    alone could not say it). In a run of two groups, one in per-rank shards and one compacted, both killed at once:
    each group's end is read, and the run is inconclusive."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [r for r in records(UNEVEN_GA * 2, token_mean) if r["rank"] == 0 or r["step"] <= 3]
    closed = {PROVENANCE_KEY: b'{"closed": true}'}
    for name, statistics in (("stats", True), ("no_stats", False)):
        for rank in (0, 1):
            mine = pa.Table.from_pylist([r for r in rows if r["rank"] == rank])
            folder = tmp_path / name
            folder.mkdir(exist_ok=True)
            table = mine.replace_schema_metadata(closed if rank == 1 else None)
            pq.write_table(table, folder / f"rank-{rank:05d}-000000.parquet", write_statistics=statistics)
        assert only(audit([tmp_path / name]), Code.MISSING_RANK).steps.first == 4, name
    write(tmp_path / "stats" / "compacted.parquet", rows)
    assert audit([tmp_path / "stats"]).runs[0].verdict == "incorrect"

    # a close on the rank that went on (rank 0, at the end) says nothing of the one that stopped: a kill, and with
    # a compacted copy beside the shards the footers cannot settle it: inconclusive, never incorrect
    for name in ("killed", "copied"):
        for rank in (0, 1):
            mine = [r for r in rows if r["rank"] == rank]
            write(tmp_path / name / f"rank-{rank:05d}-000000.parquet", mine, metadata=closed if rank == 0 else None)
    assert audit([tmp_path / "killed"]).runs[0].verdict == "correct"
    write(tmp_path / "copied" / "compacted.parquet", rows)
    assert audit([tmp_path / "copied"]).runs[0].verdict == "inconclusive"
    # two of 4 ranks out of data at once, both closed at step 3, while the other two go on: no job's end, but two
    # ranks missing (a close is a job's end only where every rank closed at that step)
    four = [r for r in records([[[2], [3], [1], [4]]] * 6, token_mean) if r["rank"] < 2 or r["step"] <= 3]
    for rank in range(4):
        mine = [r for r in four if r["rank"] == rank]
        write(tmp_path / "two" / f"rank-{rank:05d}.parquet", mine, metadata=closed if rank >= 2 else None)
    assert only(audit([tmp_path / "two"]), Code.MISSING_RANK).steps.first == 4
    # W = 3: launch a ends at step 3, ranks 0 and 1 closing there (rank 2 not: an error in flight); launch b goes on
    # to 5 on ranks 0 and 2, rank 1 killed before its first shard: only a close in the latest launch says on purpose
    three = records([[[2], [3], [1]]] * 6, token_mean)
    for rank in range(3):
        for launch, first, last in (("a", 0, 3), ("b", 4, 5)):
            mine = [r for r in three if r["rank"] == rank and first <= r["step"] <= last]
            facts = {"launch": {"id": launch, "first_shard": first}, "closed": launch == "a" and rank < 2}
            if mine and not (launch == "b" and rank == 1):
                write(
                    tmp_path / "relaunch" / f"rank-{rank:05d}-{first:06d}.parquet",
                    mine,
                    metadata={PROVENANCE_KEY: json.dumps(facts).encode()},
                )
    (finding,) = audit([tmp_path / "relaunch"]).findings
    assert finding.code == Code.UNFINISHED_UPDATE and (finding.steps.first, finding.steps.last) == (4, 5)
    # a close no footer places on a (run, group), in another run's folder: the killed run's footers still settle it
    other = write_by_rank(tmp_path / "other", records(UNEVEN_GA, token_mean, run_id="other"))
    for shard in other.glob("*.parquet"):
        pq.write_table(pq.read_table(shard).replace_schema_metadata(closed), shard, write_statistics=False)
    report = audit([tmp_path / "killed", other])
    assert {r.run: r.verdict for r in report.runs} == {"killed": "correct", "other": "correct"}

    two = [dict(r, group="a") for r in rows] + [dict(r, group="b") for r in rows]
    write_by_rank(tmp_path / "groups", [r for r in two if r["group"] == "a"], steps_per_file=2)
    write(tmp_path / "groups" / "b.parquet", [r for r in two if r["group"] == "b"])
    report = audit([tmp_path / "groups"])
    (finding,) = report.findings
    assert finding.code == Code.UNFINISHED_UPDATE and finding.undecidable and report.runs[0].verdict == "inconclusive"


def test_ranks_with_no_record_in_any_step_make_the_run_inconclusive(tmp_path: Path) -> None:
    """A W=2 log with only rank 1's records (a local mean, which the other rank's tokens would show): every
    step's N is partial, so nothing about the normalization is judged: one ranks_not_recorded, inconclusive.
    With both ranks the same loop is local_mean; a group whose ranks all recorded is judged beside it."""
    rows = records(UNEVEN_GA, local_mean)
    partial = audit_rows(tmp_path / "partial", [r for r in rows if r["rank"] == 1])
    (finding,) = partial.findings
    assert finding.code == Code.RANKS_NOT_RECORDED and finding.evidence["ranks_not_recorded"] == [0]
    assert finding.steps.count == len(UNEVEN_GA) and "1 of W=2 ranks" in finding.message
    assert partial.runs[0].verdict == "inconclusive" and partial.runs[0].weight_range is None
    assert only(audit_rows(tmp_path / "whole", rows), Code.LOCAL_MEAN)
    grouped = [dict(r, group="dp0") for r in rows] + [dict(r, group="dp1") for r in rows if r["rank"] == 0]
    (finding,) = audit_rows(tmp_path / "groups", grouped).findings
    assert finding.code == Code.RANKS_NOT_RECORDED and finding.evidence["group"] == "dp1"


@pytest.mark.parametrize(
    "synced, flagged",
    [("last", False), ("last two", False), ("every", True), ("none of rank 1", True), ("all but the last", True)],
)
def test_uneven_microbatches_are_flagged_only_where_the_synced_backwards_do_not_match(
    tmp_path: Path, synced: str, flagged: bool
) -> None:
    """Rank 0 runs 3 microbatches and rank 1 runs 2, N counted over all: the weights are exact. With one synced
    backward per rank (its last) that is a correct loop, and with two on every rank, its last two: the all-reduces
    pair off one for one, and (g₀₀ + g₀₁ + g₁₀)/2 + (g₀₂ + g₁₁)/2 is the mean of the sums. Every microbatch syncing
    (3 on one rank, 2 on the other), a rank that never syncs, or syncs before its last, is flagged."""
    counts = [[[3, 2, 4], [4, 1]], [[1, 5], [2, 2, 6]], [[2, 2, 1], [7, 3]]]
    rows = records(counts, token_mean)
    for row in rows:
        left = len(counts[row["step"]][row["rank"]]) - 1 - row["micro"]  # microbatches after this one
        row["sync"] = {
            "last": left == 0,
            "last two": left < 2,
            "every": True,
            "none of rank 1": left == 0 and row["rank"] == 0,
            "all but the last": left == 1,
        }[synced]
    report = audit_rows(tmp_path, rows)
    assert (Code.UNEVEN_MICROBATCHES in {f.code for f in report.findings}) == flagged
    assert report.runs[0].verdict == ("incorrect" if flagged else "correct"), [f.message for f in report.findings]

    rows = records(UNEVEN, token_mean)
    rows[1]["world_size"] = 8
    assert Code.WORLD_SIZE_INCONSISTENT in {f.code for f in audit_rows(tmp_path / "inconsistent", rows).findings}

    rows = records(UNEVEN, token_mean) + records([[[2], [3], [4], [1]]], token_mean, step_offset=3)
    report = audit_rows(tmp_path / "changed", rows)
    changed = only(report, Code.WORLD_SIZE_CHANGED)
    assert changed.severity == Severity.INFO and changed.evidence["world_sizes"] == [2, 4]
    assert report.runs[0].verdict == "correct" and report.runs[0].world_size == [2, 4]


def test_uneven_microbatches_with_a_loss_recorded_by_two_layers_are_correct_where_every_rank_syncs_alike(
    tmp_path: Path,
) -> None:
    """Rank 0 runs 2 microbatches and rank 1 one (at step 0) under no_sync() but the last; "lm" a token mean on each,
    "aux" recorded by 2 layers on each microbatch, so each rank's synced backward leaves 2 records of aux. aux
    outnumbers lm: it is the main term, whose 2 synced records a rank were read as 2 synced backwards against 1
    (uneven_microbatches, incorrect). Every rank synced its last backward alone: correct. A rank that synced its
    first microbatch too is flagged."""
    counts = [[[5, 3], [2]], [[4, 4], [9, 1]], [[3], [6, 2]]]

    def terms(early: bool) -> list[dict[str, object]]:
        def synced(step: int, rank: int, micro: int) -> bool:
            return micro == len(counts[step][rank]) - 1 or (early and (step, rank) == (0, 0))

        lm = [dict(r, term="lm", sync=synced(r["step"], r["rank"], r["micro"])) for r in records(counts, token_mean)]
        layered = [[[n + layer for n in mine for layer in range(2)] for mine in step] for step in counts]
        aux = [
            dict(
                r,
                term="aux",
                sync=synced(r["step"], r["rank"], r["micro"] // 2),
                loss_sum=r["loss_sum"] / 100,
                backward_scalar=r["backward_scalar"] / 100,
            )
            for r in records(layered, token_mean)
        ]
        return lm + aux

    report = audit_rows(tmp_path / "alike", terms(early=False))
    assert report.runs[0].verdict == "correct" and report.findings == [], [f.message for f in report.findings]
    report = audit_rows(tmp_path / "early", terms(early=True))
    assert report.runs[0].verdict == "incorrect" and Code.UNEVEN_MICROBATCHES in {f.code for f in report.findings}


def test_ranks_of_as_many_microbatches_that_synchronize_unequally_are_incorrect(tmp_path: Path) -> None:
    """2 microbatches a rank, the token mean: rank 0 runs both outside no_sync(), rank 1 only its last, so rank 0's
    second all-reduce pairs with rank 1's first of the next step (it read correct: only uneven counts were looked
    at). Both ranks syncing both, or each only its last, is correct (sync_every_micro, information, for the first)."""
    counts = [[[3, 2], [4, 1]], [[1, 5], [2, 6]]]

    def audited(name: str, synced: Callable[[int, int], bool]) -> AuditReport:
        rows = [dict(r, sync=synced(r["rank"], r["micro"])) for r in records(counts, token_mean)]
        return audit_rows(tmp_path / name, rows)

    report = audited("unequal", lambda rank, micro: micro == 1 or rank == 0)
    finding = only(report, Code.UNEQUAL_SYNCS)
    assert report.runs[0].verdict == "incorrect" and finding.steps.count == 2
    assert finding.evidence == {"step": 0, "synced_records_low": 1, "synced_records_high": 2}
    assert audited("last", lambda rank, micro: micro == 1).runs[0].verdict == "correct"
    every = audited("every", lambda rank, micro: True)
    assert every.runs[0].verdict == "correct" and codes(every) == {"sync_every_micro"}, codes(every)


def test_a_step_that_does_not_say_whether_it_synced_leaves_the_steps_that_do_decided(tmp_path: Path) -> None:
    """Rank 0 runs 2 microbatches and rank 1 one, every microbatch synchronizing (2 all-reduces against 1); at step 0
    rank 1's record says nothing of its sync. Steps 1 and 2 show the mismatch: incorrect, named at step 1 (the run
    read inconclusive, by its first step alone)."""
    rows = [dict(r, sync=True) for r in records([[[3, 2], [4]]] * 3, token_mean)]
    for row in rows:
        if (row["step"], row["rank"]) == (0, 1):
            row["sync"] = None
    report = audit_rows(tmp_path, rows)
    finding = only(report, Code.UNEVEN_MICROBATCHES)
    assert report.runs[0].verdict == "incorrect" and not finding.undecidable
    assert finding.evidence["step"] == 1 and "the records do not show that every rank" in finding.message


def test_duplicates_keep_the_later_record(tmp_path: Path) -> None:
    good = records(UNEVEN, token_mean)
    stale = [dict(row, backward_scalar=row["backward_scalar"] * 3) for row in good if row["step"] == 2]
    folder = tmp_path / "run"
    write(folder / "rank-all-000000.parquet", stale)  # written first (older file)
    write(folder / "rank-all-000001.parquet", good)
    report = audit([folder])
    finding = only(report, Code.DUPLICATE_RECORDS)
    assert finding.evidence["dropped_records"] == 2 and finding.steps.first == 2
    assert codes(report) == {"duplicate_records"}
    # `time` never decides (a clock may run ahead): the later file wins, here the stale one written last.
    from datetime import datetime, timezone

    older, newer = datetime(2026, 1, 1, tzinfo=timezone.utc), datetime(2026, 1, 2, tzinfo=timezone.utc)
    write(tmp_path / "timed" / "a.parquet", [dict(r, time=newer) for r in good])
    write(tmp_path / "timed" / "b.parquet", [dict(r, time=older) for r in stale])
    assert codes(audit([tmp_path / "timed"])) == {"duplicate_records", "world_size_mismatch"}


def test_empty_updates(tmp_path: Path) -> None:
    counts = [[[2], [3]], [[0], [0]], [[1], [4]]]
    rows = records(counts, token_mean)
    for row in rows:
        row["skipped"] = True if row["step"] == 1 else None
    finding = only(audit_rows(tmp_path / "skipped", rows), Code.EMPTY_UPDATE)
    assert finding.severity == Severity.INFO and finding.steps.first == 1
    assert finding.message.endswith("and every rank skipped it together.")
    # no skipped column: the log does not say (it said every rank skipped it)
    finding = only(audit_rows(tmp_path / "unsaid", records(counts, token_mean)), Code.EMPTY_UPDATE)
    assert "the log does not say the update was skipped" in finding.message and "together" not in finding.message
    rows = records(counts, token_mean)
    for row in rows:  # one rank says skipped, the other nothing: not every rank skipped it together
        row["skipped"] = True if (row["step"], row["rank"]) == (1, 0) else None
    finding = only(audit_rows(tmp_path / "half", rows), Code.EMPTY_UPDATE)
    assert "the log does not say the update was skipped" in finding.message and "together" not in finding.message

    rows = records(counts, token_mean)
    for row in rows:
        row["skipped"] = (row["rank"] == 0) if row["step"] == 1 else None
    finding = only(audit_rows(tmp_path / "disagree", rows), Code.EMPTY_UPDATE)
    assert finding.severity == Severity.ERROR and "disagree" in finding.message

    # every rank backpropagates 0/0 = NaN in the empty update: whether it reached the weights, the step after says
    rows = records(counts, lambda S, N, W, **_: W * S / N if N else float("nan"))
    report = audit_rows(tmp_path / "nan", rows)  # step 2 finite: the NaN never reached them (cross-entropy's 0)
    assert only(report, Code.EMPTY_UPDATE).severity == Severity.INFO
    assert only(report, Code.ZERO_TOKEN_NONFINITE).severity == Severity.INFO
    assert report.runs[0].verdict == "correct"
    for row in rows:
        if row["step"] == 2:  # every loss after it NaN: the NaN reached the weights
            row.update(loss_sum=float("nan"), backward_scalar=float("nan"))
    report = audit_rows(tmp_path / "spread", rows)
    assert only(report, Code.EMPTY_UPDATE).severity == Severity.ERROR
    assert only(report, Code.ZERO_TOKEN_NONFINITE).severity == Severity.ERROR
    ended = [row for row in rows if row["step"] < 2]  # the run ends at it: the logs cannot tell
    report = audit_rows(tmp_path / "ended", ended)
    assert only(report, Code.ZERO_TOKEN_NONFINITE).severity == Severity.WARNING
    assert report.runs[0].verdict == "inconclusive"


def test_zero_token_rank_with_nan_and_nonfinite_values(tmp_path: Path) -> None:
    rows = records([[[0], [3]], [[2], [2]], [[1], [5]]], local_mean)
    report = audit_rows(tmp_path / "zero", rows)
    assert only(report, Code.ZERO_TOKEN_NONFINITE).steps.first == 0

    rows = records(UNEVEN, token_mean)
    rows[2]["loss_sum"] = math.inf
    assert only(audit_rows(tmp_path / "inf", rows), Code.NONFINITE_VALUES).evidence["first_step"] == 1


def test_reported_loss_mismatch_names_the_mean_of_local_means(tmp_path: Path) -> None:
    rows = records(UNEVEN, token_mean)
    for step, counts in enumerate(UNEVEN):
        mine = [r for r in rows if r["step"] == step]
        local = sum(r["loss_sum"] / r["valid_tokens"] for r in mine) / len(mine)
        for row in mine:
            row["reported_loss"] = local
    finding = only(audit_rows(tmp_path, rows), Code.REPORTED_LOSS_MISMATCH)
    assert "mean of per-rank means" in finding.message and finding.steps.count == 3

    rows = records(UNEVEN, token_mean)
    for row in rows:
        step_rows = [r for r in rows if r["step"] == row["step"]]
        row["reported_loss"] = sum(r["loss_sum"] for r in step_rows) / sum(r["valid_tokens"] for r in step_rows)
    assert codes(audit_rows(tmp_path / "ok", rows)) == set()


@pytest.mark.parametrize("logged", [math.nan, math.inf])
def test_a_logged_loss_that_is_not_finite_is_said_so_not_as_a_ratio(tmp_path: Path, logged: float) -> None:
    """A right run whose trainer logged nan (or inf) at every step: the mismatch said it was "nan× the token mean"."""
    rows = [dict(r, reported_loss=logged) for r in records(UNEVEN, token_mean)]
    report = audit_rows(tmp_path, rows)
    finding = only(report, Code.REPORTED_LOSS_MISMATCH)
    assert "it is not finite where ΣS/N is (step 0: reported " in finding.message and "×" not in finding.message
    assert report.runs[0].verdict == "correct"  # (the logged loss is no claim about the update)


def _token_means(rows: list[dict[str, Any]]) -> dict[int, float]:
    steps = sorted({r["step"] for r in rows})
    return {
        s: sum(r["loss_sum"] for r in rows if r["step"] == s) / sum(r["valid_tokens"] for r in rows if r["step"] == s)
        for s in steps
    }


@pytest.mark.parametrize("shift", [1, -1])
def test_a_reported_loss_stamped_one_update_off_is_named_not_called_wrong(tmp_path: Path, shift: int) -> None:
    """Each step's reported loss the token mean of the step after it (a loss reported before the update it
    belongs to closed) or before it: the losses are right, so the run stays correct, and the finding says
    which neighbour they belong to; rounded as a logger prints them, or right at some steps, the same."""
    rows = records(UNEVEN * 3, token_mean)
    means = _token_means(rows)
    for row in rows:
        theirs = means.get(row["step"] + shift)
        if theirs is not None:
            row["reported_loss"] = round(theirs, 4) if row["step"] % 2 else theirs
    report = audit_rows(tmp_path / "shifted", rows)
    finding = only(report, Code.REPORTED_LOSS_SHIFTED)
    assert finding.severity == Severity.INFO and report.runs[0].verdict == "correct"
    assert finding.steps.count == 8 and ("early" if shift == 1 else "late") in finding.message
    assert finding.evidence[f"token_mean_of_the_{'next' if shift == 1 else 'previous'}_step"] == pytest.approx(
        means[finding.steps.first + shift]
    )

    # The same losses, some stamped on their own step: only the others are named
    for row in rows:
        if row["step"] in (3, 4):
            row["reported_loss"] = means[row["step"]]
    assert only(audit_rows(tmp_path / "partly", rows), Code.REPORTED_LOSS_SHIFTED).steps.count == 6


def test_a_reported_loss_that_is_no_neighbour_s_stays_a_mismatch(tmp_path: Path) -> None:
    """Twice the token mean, or the next step's at one step and something else at another, or a single step
    off (one coincidence proves nothing): reported_loss_mismatch, as before."""
    rows = records(UNEVEN * 3, token_mean)
    means = _token_means(rows)
    for row in rows:
        row["reported_loss"] = 2 * means[row["step"]]
    assert codes(audit_rows(tmp_path / "double", rows)) == {"reported_loss_mismatch"}
    for row in rows:
        row["reported_loss"] = means[row["step"]]
        if row["step"] == 0:
            row["reported_loss"] = means[1]
        if row["step"] == 5:
            row["reported_loss"] = 3 * means[5]
    assert codes(audit_rows(tmp_path / "mixed", rows)) == {"reported_loss_mismatch"}
    for row in rows:
        if row["step"] == 5:
            row["reported_loss"] = means[5]
    assert codes(audit_rows(tmp_path / "once", rows)) == {"reported_loss_mismatch"}


def test_sync_findings(tmp_path: Path) -> None:
    rows = records(UNEVEN_GA, token_mean)
    for row in rows:
        row["sync"] = row["micro"] == 1 and not (row["step"] == 2 and row["rank"] == 0)
    finding = only(audit_rows(tmp_path / "missing", rows), Code.MISSING_SYNC)
    assert finding.steps.first == 2 and finding.evidence["rank_steps"] == 1

    rows = records(UNEVEN_GA, token_mean, sync=True)
    finding = only(audit_rows(tmp_path / "every", rows), Code.SYNC_EVERY_MICRO)
    assert finding.severity == Severity.INFO and "correct, but 2× the communication" in finding.message
    # steps of 2 and of 3 microbatches: as many all-reduces each, 2–3× (it said 3×, the run's most)
    rows = records([[[2, 3], [4, 1]], [[1, 2, 3], [3, 2, 1]]], token_mean, sync=True)
    finding = only(audit_rows(tmp_path / "every_varied", rows), Code.SYNC_EVERY_MICRO)
    assert "correct, but 2–3× the communication" in finding.message

    # null is "not said": a last microbatch whose sync nobody knew is no unsynced update (its microbatch 0 was)
    rows = records(UNEVEN_GA, token_mean)
    for row in rows:
        row["sync"] = None if row["micro"] == 1 and row["step"] == 0 else row["micro"] == 1
    report = audit_rows(tmp_path / "unsaid", rows)
    assert report.findings == [] and report.runs[0].verdict == "correct", codes(report)


def test_balanced_counts_are_inconclusive(tmp_path: Path) -> None:
    report = audit_rows(tmp_path, records([[[4], [4]], [[3], [3]]], local_mean))
    assert codes(report) == {"balanced_counts"}
    assert only(report, Code.BALANCED_COUNTS).evidence["counts"] == [3, 4]  # each count once, in order
    assert report.runs[0].verdict == "inconclusive"
    assert report.runs[0].normalization.denominator == "undetermined"  # type: ignore[union-attr]


def test_a_change_of_normalization_shows_as_segments(tmp_path: Path) -> None:
    counts = UNEVEN * 3
    rows = records(counts[:5], local_mean) + records(counts[5:], token_mean, step_offset=5)
    report = audit_rows(tmp_path, rows)
    segments = [(s.first, s.last, s.denominator) for s in report.runs[0].segments]
    assert segments == [(0, 4, "n_rank"), (5, 8, "N")]
    assert only(report, Code.LOCAL_MEAN).steps.last == 4


def test_runs_are_audited_separately(tmp_path: Path) -> None:
    write_by_rank(tmp_path / "good", records(UNEVEN, token_mean))
    write_by_rank(tmp_path / "bad", records(UNEVEN, local_mean))
    report = audit([tmp_path])
    assert {r.run: r.verdict for r in report.runs} == {"good": "correct", "bad": "incorrect"}
    assert {f.run for f in report.findings} == {"bad"}
    assert [r.run for r in audit([tmp_path], runs=["good"]).runs] == ["good"]


@pytest.mark.parametrize("as_categories", [True, False])
def test_world_size_changes_are_found_group_by_group_as_a_group_by_finds_them(as_categories: bool) -> None:
    """world_size_changed per group, in the group-by's order, with the steps where W differs from the
    group's first and the sizes in the order W took them (a change back said again; past 16, the first 15 and the
    latest); W and M compared as
    arrays or as one value each
    (`engine.constant_of`'s stride-0 columns). The reference is pandas' group-by, written here."""
    from tokaudit._checks.base import RunContext, TermInputs
    from tokaudit._checks.structure import StructureCheck
    from tokaudit._schema import UNNAMED

    def _structure_findings(frame: pd.DataFrame, context: RunContext, block: int = 7) -> list[Any]:
        """The check fed a few steps at a time, in the frame's order."""
        check = StructureCheck(TermInputs(context, keep_steps=True, main_term=True))
        for start in range(0, len(frame), block):
            check.add(frame.iloc[start : start + block], None)
        return list(check.findings())

    rng = np.random.default_rng(5)
    count = 60
    groups = rng.choice(["dp1", UNNAMED, "dp0"], count)
    world = rng.choice([4, 8, 2], count, p=[0.8, 0.1, 0.1]).astype(np.int32)
    world[groups == "dp1"] = 4  # one group never changes
    frame = pd.DataFrame(
        {
            "grp": pd.Categorical(groups) if as_categories else groups,
            "step": np.arange(count),
            "world_low": world,
            "world_high": world,
            "microbatches_low": np.broadcast_to(np.ones(1, np.int32), (count,)),
            "microbatches_high": np.broadcast_to(np.ones(1, np.int32), (count,)),
        }
    )
    context = RunContext(
        run="r", term=UNNAMED, world_size=4, world_sizes=(2, 4, 8), microbatches=1, divisor=4.0, rtol=1e-4
    )
    found = _structure_findings(frame, context)
    assert [str(f) for f in found] == [str(f) for f in _structure_findings(frame, context, block=len(frame))]
    expected = []
    for group, per_group in frame.groupby("grp", sort=True, observed=True):
        values = [int(w) for w in per_group.world_high]
        sizes = [w for i, w in enumerate(values) if i == 0 or w != values[i - 1]]  # each change, in step order
        sizes = sizes if len(sizes) <= 16 else sizes[:15] + sizes[-1:]  # past 16, the first and the latest
        if len(sizes) > 1:
            changed = per_group.step[per_group.world_high != per_group.world_high.iloc[0]]
            expected.append((group, sizes, int(changed.min()), int(changed.max()), len(changed)))
    assert len(expected) == 2
    assert [(f.evidence["world_sizes"], f.steps.first, f.steps.last, f.steps.count) for f in found] == [
        (sizes, first, last, n) for _, sizes, first, last, n in expected
    ]
    assert all(f.code == Code.WORLD_SIZE_CHANGED for f in found)
    assert ["in group" in found[0].message, "in group dp0" in found[1].message] == [False, True]  # "0" sorts first

    # W and M held as one value each: equal, nothing found; different, every step
    one = np.broadcast_to(np.full(1, 4, np.int32), (count,))
    other = np.broadcast_to(np.full(1, 3, np.int32), (count,))

    def held_as(**columns: Any) -> pd.DataFrame:
        held = pd.DataFrame({"grp": frame.grp, "step": frame.step.to_numpy(), **columns}, copy=False)
        assert all(held[name].to_numpy().strides == (0,) for name in columns)
        return held

    assert not list(
        _structure_findings(
            held_as(world_low=one, world_high=one, microbatches_low=one, microbatches_high=one), context
        )
    )
    uneven = list(
        _structure_findings(
            held_as(world_low=one, world_high=one, microbatches_low=one, microbatches_high=other), context
        )
    )
    assert [f.code for f in uneven] == [Code.UNEVEN_MICROBATCHES] and uneven[0].steps.count == count


@pytest.mark.parametrize("block", [1, 3, 7, 65_536])
def test_a_finding_s_evidence_step_and_its_steps_do_not_depend_on_the_blocks(
    tmp_path: Path, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weighting findings group their steps and pick the evidence step (most unequal weights, then q
    furthest from 1, the last of equals) a block of steps at a time: the same as one np.lexsort over
    every member, and the same report whatever the block, on random ratios with ties and on a log with
    several weighting findings."""
    import tokaudit._checks.base as checks_module
    from tokaudit._checks.base import RunContext, TermInputs
    from tokaudit._checks.weighting import FactorTable, WeightingCheck
    from tokaudit._normalization import DENOMINATORS, KINDS, Denominator, Diagnoses, StepKind

    rng = np.random.default_rng(block)
    count = 200
    low = rng.choice([1.0, 2.0, 0.0], count)
    high = low * rng.choice([1.0, 3.0, 1.00001], count)
    distortion = rng.choice([1.0, 0.5, 2.0, np.nan], count)
    context = RunContext(run="r", term="0", world_size=2, world_sizes=(2,), microbatches=1, divisor=2.0, rtol=1e-4)
    for members in (np.arange(count), np.sort(rng.choice(count, 37, replace=False))):
        frame = pd.DataFrame(
            {
                "step": members,
                "token_weight_low": low[members],
                "token_weight_high": high[members],
                "world_high": np.full(len(members), 2),
                "ranks": np.full(len(members), 2),
            }
        )
        kind = np.full(len(members), KINDS.index(StepKind.NONUNIFORM), np.int8)
        denominator = np.full(len(members), DENOMINATORS.index(Denominator.UNEXPLAINED), np.int8)
        diagnoses = Diagnoses(
            kind,
            denominator,
            np.full(len(members), np.nan),
            distortion[members],
            np.zeros(len(members), bool),
            np.full(len(members), np.nan),
        )
        weighting = WeightingCheck(
            TermInputs(context, keep_steps=False, main_term=True, factors=FactorTable(1e-4, np.zeros(0), {}, [], False))
        )
        for start in range(0, len(members), block):
            part = slice(start, start + block)
            weighting.add(
                frame.iloc[part],
                Diagnoses(
                    *(
                        getattr(diagnoses, name)[part]
                        for name in ("kind", "denominator", "factor", "distortion", "balanced", "approximate")
                    )
                ),
            )
        (group,) = weighting.groups.values()
        ratio = np.where(low[members] > 0, high[members] / np.where(low[members] > 0, low[members], 1), np.inf)
        unequal = np.where(ratio > 1 + 1e-4, ratio, 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            far = np.nan_to_num(np.abs(np.log(np.abs(distortion[members]))), nan=0.0)
        assert int(group.row.step) == int(members[np.lexsort((far, unequal))[-1]])
        assert group.count == len(members) and group.steps.range().count == len(members)

    from tokaudit._render.json_report import render_json

    counts = [[[5, 1], [3, 7]], [[2, 6], [6, 2]], [[8, 4], [2, 8]], [[3, 3], [3, 3]]] * 5
    rows = records(counts, local_mean) + [
        dict(r, term="aux") for r in records(counts, lambda S, n, M, **_: S / (n * M) if n else 0.0)
    ]
    for index, row in enumerate(rows):
        if row["step"] % 3 == 0:
            row["backward_scalar"] *= 2.0  # another factor: more than one finding per code
    monkeypatch.setattr(checks_module, "BLOCK_STEPS", block)
    report = audit_rows(tmp_path / f"run{block}", rows)
    monkeypatch.setattr(checks_module, "BLOCK_STEPS", 65_536)
    assert render_json(report) == render_json(audit_rows(tmp_path / f"whole{block}", rows))
    assert (
        len(
            [
                f
                for f in report.findings
                if f.code
                in (Code.LOCAL_MEAN, Code.SCALE_MISMATCH, Code.UNEXPLAINED_WEIGHTING, Code.PER_MICRO_DENOMINATOR)
            ]
        )
        >= 2
    )


def test_an_update_closed_unsynced_and_skipped_says_zero_grad_ran_inside_the_window(tmp_path: Path) -> None:
    """What the recorder logs when zero_grad() runs between the microbatches of one update: the update closes at
    it as skipped, its last record unsynced (inside no_sync), and the next update holds the last microbatch.
    missing_sync then says the gradients were cleared inside the window, not that ranks stepped on a local
    gradient; an unsynced last microbatch of an update that stepped keeps that message."""
    counts = [[[5], [3]], [[1], [7]], [[2], [6]], [[6], [1]]]
    rows = records(counts, token_mean)
    for row in rows:
        row.update(sync=row["step"] % 2 == 1, skipped=True if row["step"] % 2 == 0 else None)
    cleared = only(audit_rows(tmp_path / "cleared", rows), Code.MISSING_SYNC)
    assert "cleared inside the accumulation window" in cleared.message and cleared.evidence["cleared_steps"] == 2
    stepped = [dict(row, skipped=None) for row in rows]
    local = only(audit_rows(tmp_path / "stepped", stepped), Code.MISSING_SYNC)
    assert "stepped on their local gradient" in local.message and "cleared_steps" not in local.evidence


def test_the_fix_names_the_helpers_to_paste_or_the_trainer_s_setting(tmp_path: Path) -> None:
    """A local mean from a hand-written loop: the fix names tokaudit.hooks' global_valid_tokens and
    token_mean_loss (reduction="sum" under a summing reduction, D = 1); recorded by the Hugging Face Trainer, its
    own setting instead."""
    from tokaudit._schema import provenance_metadata

    rows = records(UNEVEN, local_mean)
    fix = only(audit_rows(tmp_path / "loop", rows), Code.LOCAL_MEAN).fix
    assert "global_valid_tokens(" in fix and "token_mean_loss(loss_sum, N)" in fix
    summed = only(audit_rows(tmp_path / "sum", [dict(r, grad_divisor=1.0) for r in rows]), Code.LOCAL_MEAN).fix
    assert 'token_mean_loss(loss_sum, N, reduction="sum")' in summed
    hf = write_by_rank(tmp_path / "hf" / "run", rows, metadata=provenance_metadata({"trainer": "transformers"}))
    trained = only(audit([hf]), Code.LOCAL_MEAN).fix
    assert "average_tokens_across_devices=True" in trained and "token_mean_loss" not in trained


def _in_chunks(rows: list[dict[str, Any]], scalar: Any, parts: int = 3) -> list[dict[str, Any]]:
    """Each record split into two terms, a chunk of 1/`parts` of its tokens and the rest (its S in proportion),
    each chunk's b = scalar(S_k, n_k, N) with N the step's tokens over every chunk and rank."""
    tokens = {}
    for row in rows:
        tokens[row["step"]] = tokens.get(row["step"], 0) + row["valid_tokens"]
    out = []
    for row in rows:
        n = row["valid_tokens"]
        for term, n_k in (("0", n // parts), ("1", n - n // parts)):
            S_k = row["loss_sum"] * n_k / n
            out.append(
                dict(
                    row,
                    term=term,
                    valid_tokens=n_k,
                    loss_sum=S_k,
                    backward_scalar=scalar(S_k, n_k, tokens[row["step"]], row["world_size"]),
                )
            )
    return out


def test_terms_that_together_are_one_token_mean_are_judged_as_one(tmp_path: Path) -> None:
    """A loss computed in two chunks, each recorded as a term, each chunk W·S_k/N with N over both chunks: one
    token mean over their combined tokens (correct, said as information); the same chunks each divided by their
    own count are still a mistake; two real heads each a token mean over its own N stay two terms."""
    base = records(UNEVEN_GA, token_mean)
    chunks = _in_chunks(base, lambda S, n, N, W: W * S / N)
    for row in chunks:  # the logged loss: the whole objective's token mean, ΣS/N over both chunks
        mine = [r for r in base if r["step"] == row["step"]]
        row["reported_loss"] = sum(r["loss_sum"] for r in mine) / sum(r["valid_tokens"] for r in mine)
    report = audit_rows(tmp_path / "chunks", chunks)
    (run,) = report.runs
    assert run.verdict == "correct" and codes(report) == {"terms_one_objective"}, codes(report)
    assert run.reporting == "matches" and run.terms_pooled
    assert only(report, Code.TERMS_ONE_OBJECTIVE).evidence["terms"] == ["0", "1"]
    assert run.normalization is not None and run.normalization.denominator == "N"
    assert run.normalization.factor == pytest.approx(2.0) and run.weight_range == pytest.approx((1.0, 1.0))
    report = audit_rows(tmp_path / "chunk_means", _in_chunks(base, lambda S, n, N, W: S / n if n else 0.0))
    assert report.runs[0].verdict == "incorrect" and "terms_one_objective" not in codes(report)
    # every record and piece of one count: a mean over each piece's own count weighs as the token mean does
    even = records([[[6, 6], [6, 6]], [[4, 4], [4, 4]]], token_mean)
    report = audit_rows(tmp_path / "balanced", _in_chunks(even, lambda S, n, N, W: W * S / N, parts=2))
    assert report.runs[0].verdict == "inconclusive"
    assert codes(report) == {"terms_one_objective", "balanced_counts"}
    heads = [dict(r, term=term) for r in base for term in ("0", "head1")]  # each head W·S/N over its own N
    report = audit_rows(tmp_path / "heads", heads)
    assert report.runs[0].verdict == "correct" and codes(report) == set()
    assert report.runs[0].terms == ["0", "head1"] and not report.runs[0].terms_pooled


def test_what_a_named_term_s_factor_looks_like_is_not_read_as_its_coefficient(tmp_path: Path) -> None:
    """Named terms, none declaring λ: a W kept across a resize on the aux term alone (4 on W = 8: q = 1/2 from the
    resize on) is a stale W; both terms off by the same factors over the run (a hard-coded W = 2 after 2 → 4) are
    the whole loss's; an unrecorded loss scale on both is a loss scale. None reads as a λ chosen on purpose."""
    two, four = [[[3, 1], [2, 5]]] * 2, [[[3, 1], [2, 5], [4, 2], [1, 6]]] * 2
    eight = [[[3, 1], [2, 5], [4, 2], [1, 6], [2, 2], [5, 1], [1, 3], [2, 4]]] * 2
    lm = records(four, token_mean, term="lm") + records(eight, token_mean, term="lm", step_offset=2)
    aux = records(four, token_mean, term="aux") + records(eight, lambda S, N, **_: 4 * S / N, term="aux", step_offset=2)
    report = audit_rows(tmp_path / "stale", lm + aux)
    assert report.runs[0].verdict == "incorrect" and "undeclared_term_weight" not in codes(report), codes(report)
    hard = lambda S, N, **_: 2 * S / N  # noqa: E731  (W = 2 hard-coded)
    both = [dict(r, term=t) for t in ("lm", "aux") for r in records(two, hard) + records(four, hard, step_offset=2)]
    report = audit_rows(tmp_path / "shared", both)
    assert report.runs[0].verdict == "incorrect" and "undeclared_term_weight" not in codes(report), codes(report)
    scaled = lambda S, N, W, step, **_: (2.0**16 if step < 2 else 2.0**15) * W * S / N  # noqa: E731
    amp = [dict(r, term=t) for t in ("lm", "aux") for r in records(two * 2, lambda **k: scaled(step=0, **k))]
    for row in amp:
        row["backward_scalar"] *= 1 if row["step"] < 2 else 0.5
    report = audit_rows(tmp_path / "amp", amp)
    assert codes(report) == {"loss_scale"} and report.runs[0].verdict == "inconclusive", codes(report)


def test_a_factor_near_one_is_shown_in_the_digits_that_tell_it_from_one_with_the_tolerance(tmp_path: Path) -> None:
    """q = 1.0002 everywhere: the message shows 1.0002/N (not "1/N instead of 1/N") and the tolerance it is past."""
    finding = only(
        audit_rows(tmp_path, records(UNEVEN_GA, lambda S, N, W, **_: 1.0002 * W * S / N)), Code.SCALE_MISMATCH
    )
    assert "every valid token received 1.0002/N instead of 1/N" in finding.message
    assert "|q − 1| = 0.0002 past the tolerance rtol = 0.0001 (--rtol)" in finding.message


def test_terms_of_one_count_in_every_step_cannot_be_told_from_heads_that_miss_w(tmp_path: Path) -> None:
    """Two heads over the same tokens, each S/N on W = 2 (W missing: each half the token mean), weigh every token
    1/(2N), as one loss in two equal pieces would: not correct, but inconclusive (balanced_counts names both); on
    W = 3 the same heads are off by 1/3, no pooling fits, and each is world_size_mismatch."""
    heads = [dict(r, term=t) for r in records(UNEVEN_GA * 2, lambda S, N, **_: S / N) for t in ("main", "mtp")]
    report = audit_rows(tmp_path / "w2", heads)
    assert report.runs[0].verdict == "inconclusive", codes(report)
    assert codes(report) == {"terms_one_objective", "balanced_counts"}
    assert "2 heads over the same tokens" in only(report, Code.BALANCED_COUNTS).message
    three = [[[5, 1], [3, 6], [2, 2]], [[2, 6], [6, 1], [4, 4]]]
    heads = [dict(r, term=t) for r in records(three, lambda S, N, **_: S / N) for t in ("main", "mtp")]
    report = audit_rows(tmp_path / "w3", heads)
    assert report.runs[0].verdict == "incorrect" and codes(report) == {"world_size_mismatch"}, codes(report)


def test_a_constant_scale_with_float32_noise_is_called_a_constant(tmp_path: Path) -> None:
    """q = 2⁻¹⁰ in every step, each b rounded as float32 arithmetic leaves it (relative noise of 1e-8): the factor
    is a constant, not one that changes from step to step, and no overcount of labels is suggested."""
    rows = records(UNEVEN_GA * 3, lambda S, N, W, **_: float(np.float32(W * S / N * 2.0**-10) * (1 + 1e-8 * (S % 3))))
    finding = only(audit_rows(tmp_path, rows), Code.SCALE_MISMATCH)
    low, high = finding.evidence["distortion_range"]
    assert low != high and abs(high / low - 1) < 1e-6
    assert "scaled by a constant" in finding.message
    assert "changes from step to step" not in finding.message and "more labels" not in finding.message


def test_a_named_term_off_by_one_factor_is_an_undeclared_weight_and_the_logs_cannot_tell(tmp_path: Path) -> None:
    """A second term whose tokens all weigh 0.3/N in every step: a coefficient chosen on purpose or a factor that
    does not belong (inconclusive, undeclared_term_weight); the same term with a λ = 0.3 declared in the log is
    correct. A term alone, or a second term whose factor changes from step to step, is judged as before."""
    main = records(UNEVEN_GA * 2, token_mean)
    aux = [dict(r, term="aux", backward_scalar=0.3 * r["backward_scalar"]) for r in main]
    report = audit_rows(tmp_path / "untold", main + aux)
    assert codes(report) == {"undeclared_term_weight"} and report.runs[0].verdict == "inconclusive"
    declared = audit_rows(tmp_path / "told", main + [dict(r, term_weight=0.3) for r in aux])
    assert declared.findings == [] and declared.runs[0].verdict == "correct"
    # λ = 0.2 declared, the term's loss missing W (b = λ·S/N on W = 2): what is left past λ is no coefficient
    missing = [dict(r, term_weight=0.2, backward_scalar=r["backward_scalar"] / 0.3 * 0.2 / 2) for r in aux]
    report = audit_rows(tmp_path / "told_missing_w", main + missing)
    assert codes(report) == {"world_size_mismatch"} and report.runs[0].verdict == "incorrect", codes(report)
    alone = audit_rows(tmp_path / "alone", aux)
    assert codes(alone) == {"scale_mismatch"} and alone.runs[0].verdict == "incorrect"
    varying = [dict(r, backward_scalar=(1 + r["step"]) * r["backward_scalar"]) for r in aux]
    assert "undeclared_term_weight" not in codes(audit_rows(tmp_path / "varying", main + varying))
    # a schedule of λ (DeepSeek-V3's MTP weight: 0.3, then 0.1), undeclared: each value over its steps, inconclusive
    schedule = [dict(r, backward_scalar=r["backward_scalar"] / 3) if r["step"] >= 3 else r for r in aux]
    report = audit_rows(tmp_path / "schedule", main + schedule)
    assert codes(report) == {"undeclared_term_weight"} and report.runs[0].verdict == "inconclusive", codes(report)
    assert "by one factor over steps 3–5, one of 2 over the run (a schedule of λ)" in " ".join(
        f.message for f in report.findings
    )
    # two factors that come back step after step are no schedule: judged as factors of the loss
    alternating = [dict(r, backward_scalar=r["backward_scalar"] * (5 / 3 if r["step"] % 2 else 1)) for r in aux]
    report = audit_rows(tmp_path / "alternating", main + alternating)
    assert "undeclared_term_weight" not in codes(report) and report.runs[0].verdict == "incorrect", codes(report)


def test_named_terms_all_off_by_one_factor_are_a_scale_of_the_whole_objective(tmp_path: Path) -> None:
    """Every term named and each off by the same factor (1/W: W missing from both, or 0.3 on both): nothing
    weighs one term against another, the whole objective is scaled, and the run is judged as a single term off by
    that factor would be (incorrect), not as an undeclared coefficient. Two factors that differ stay undecidable."""
    # aux counts its own tokens (3n + 1: its N is not ce's, so the two are not one mean over both terms' tokens)
    aux_counts = [[[3 * n + 1 for n in mine] for mine in step] for step in UNEVEN_GA * 2]
    for name, factor, code in (("both_miss_w", 0.5, "world_size_mismatch"), ("both_scaled", 0.3, "scale_mismatch")):
        ce = records(UNEVEN_GA * 2, lambda S, N, W, **_: factor * W * S / N, term="ce")
        aux = records(aux_counts, lambda S, N, W, **_: factor * W * S / N, term="aux")
        report = audit_rows(tmp_path / name, ce + aux)
        assert report.runs[0].verdict == "incorrect" and codes(report) == {code}, (name, codes(report))
    apart = [dict(r, backward_scalar=0.5 / 0.3 * r["backward_scalar"]) for r in aux]
    report = audit_rows(tmp_path / "apart", ce + apart)
    assert report.runs[0].verdict == "inconclusive" and codes(report) == {"undeclared_term_weight"}, codes(report)


def test_two_tokens_of_one_n_weighed_apart_by_their_ranks_totals_say_the_totals(tmp_path: Path) -> None:
    """A rank-local mean where the heaviest and lightest records both hold n = 3: the message gives each one's
    rank total n_r, which is what weighed them apart (n alone would read as no reason at all)."""
    rows = records([[[3, 3], [3, 9]]] * 2, lambda S, n_r, **_: S / n_r)  # each rank's own mean
    finding = only(audit_rows(tmp_path, rows), Code.LOCAL_MEAN)
    assert "n=3 of its rank's n_r=6)" in finding.message and "n=3 of its rank's n_r=12)" in finding.message


def test_a_run_whose_last_update_alone_never_synced_says_it_may_have_ended_inside_it(tmp_path: Path) -> None:
    """The last microbatch of the run's last update unsynced on every rank (a loop that ended inside that update,
    its loader drawn ahead): missing_sync says the update may never have been applied. Mid-run, it does not."""
    rows = records(UNEVEN_GA * 2, token_mean)
    for row in rows:
        row["sync"] = row["micro"] == 1 and row["step"] != 5
    finding = only(audit_rows(tmp_path / "last", rows), Code.MISSING_SYNC)
    assert finding.steps.first == 5 and "Only the run's last step" in finding.message
    for row in rows:
        row["sync"] = row["micro"] == 1 and row["step"] != 2
    finding = only(audit_rows(tmp_path / "middle", rows), Code.MISSING_SYNC)
    assert "Only the run's last step" not in finding.message


@pytest.mark.parametrize("scalar", [token_mean, local_mean])
def test_a_run_killed_inside_its_last_update_after_a_flush_leaves_that_update_out(tmp_path: Path, scalar: Any) -> None:
    """A flush inside an update, then SIGKILL (which leaves no note that the run stopped): the last update holds its
    first microbatch alone on every rank, unsynchronized, and nothing says it was applied. Its weights (half an
    update's tokens, whatever its loss) are no claim about the run, and a loop that flushed and then stepped a short
    last update unsynchronized leaves the same records: left out with a warning that the logs cannot tell,
    inconclusive (it read missing_sync and scale_mismatch: incorrect), whatever a term recorded on the first
    microbatch alone shows. Said applied, cut on one rank only, or unsynced mid-run, it is judged: a short last
    update stepped unsynchronized is a real bug."""
    killed = [row for row in records([[[4, 3], [1, 6]]], scalar, step_offset=3) if row["micro"] == 0]
    rows = [dict(row, skipped=False) for row in records(UNEVEN_GA, token_mean)] + killed
    for row in rows:
        row["sync"] = row["micro"] == 1
    firsts = [[[ranks[0][0]], [ranks[1][0]]] for ranks in [*UNEVEN_GA, [[4, 3], [1, 6]]]]  # microbatch 0's tokens
    aux = [dict(row, term="aux", sync=False) for row in records(firsts, token_mean)]
    untold = [dict(row, skipped=None) for row in rows]
    for name, judged in (("killed", rows), ("with_aux", rows + aux), ("untold", untold)):
        report = audit_rows(tmp_path / name, judged)
        finding = only(report, Code.UNFINISHED_UPDATE)
        assert report.verdicts == {"run": "inconclusive"} and codes(report) == {"unfinished_update"}, name
        assert finding.steps.first == 3 and finding.severity == Severity.WARNING
        assert "fewer microbatches than the updates before it" in finding.message and "cannot tell" in finding.message
    said = [dict(row, skipped=False) if row["step"] == 3 else row for row in rows]
    cut = [*rows, dict(rows[-1], micro=1, sync=True)]  # rank 1 finished it: rank 0 stepped on its own gradient
    middle = [dict(row, sync=row["micro"] == 1 and row["step"] != 1) for row in rows]
    for name, judged in (("said", said), ("cut", cut), ("middle", middle)):
        assert "missing_sync" in codes(audit_rows(tmp_path / name, judged)), name


def test_a_term_declared_off_by_a_weight_of_zero_is_not_judged_and_one_that_weighs_its_tokens_is(
    tmp_path: Path,
) -> None:
    """λ = 0 (a warm-up that starts the aux term off) weighs its tokens 0 whatever the normalization: those records
    carry no weight to judge, and the term's later steps of λ > 0 are judged against λ/N. A record that says λ = 0 but
    weighs its tokens was not off: judged as a token mean (λ = 1). The main term is judged as ever."""
    main = records(UNEVEN_GA, token_mean)

    def warmed(scalar: Any) -> list[dict[str, Any]]:  # λ = 0, 0, then 0.5
        rows = records(UNEVEN_GA, scalar, term="aux")
        return [
            dict(r, term_weight=0.0, backward_scalar=0.0)
            if r["step"] < 2
            else dict(r, term_weight=0.5, backward_scalar=0.5 * r["backward_scalar"])
            for r in rows
        ]

    off = records(UNEVEN_GA, lambda **_: 0.0, term="aux", term_weight=0.0)
    verdicts = {
        "warm_up": (main + warmed(token_mean), "correct", set()),
        "warm_up_local_mean": (main + warmed(local_mean), "incorrect", {("local_mean", "aux")}),
        "off_main_local_mean": (records(UNEVEN_GA, local_mean) + off, "incorrect", {("local_mean", "0")}),
        "said_off_weighs_local": (
            main + records(UNEVEN_GA, local_mean, term="aux", term_weight=0.0),
            "incorrect",
            {("local_mean", "aux")},
        ),
    }
    for name, (rows, verdict, found) in verdicts.items():
        report = audit_rows(tmp_path / name, rows)
        assert report.problems == [] and report.verdicts == {"run": verdict}, name
        assert {(f.code.value, f.term) for f in report.findings} == found, name


def test_twice_the_token_mean_where_m_is_w_names_a_per_microbatch_mean_not_divided_by_m(tmp_path: Path) -> None:
    """Each microbatch's own mean S/n, 2 microbatches of one count on 2 ranks: uniform weights at 2/N, which a W
    applied twice gives too. The cause named the W alone ("the code scaled by 4"), where the loop never scaled."""
    rows = records([[[3, 3], [3, 3]], [[5, 5], [5, 5]], [[2, 2], [2, 2]]], lambda S, n, **_: S / n)
    finding = only(audit_rows(tmp_path, rows), Code.WORLD_SIZE_MISMATCH)
    assert finding.message.endswith(
        "or each microbatch's own mean (its count n, the same in every microbatch here) summed over the M=2 "
        "microbatches without dividing by M."
    )


def test_token_weights_below_0_are_said_so_not_a_percentage_below_the_heaviest(tmp_path: Path) -> None:
    """A preference loss's rejected tokens weigh below 0: "the lightest token's weight is 133% below the heaviest's"
    said nothing a reader could use."""
    rows = records(UNEVEN_GA, token_mean)
    for row in rows:  # a token pushed down (−c), another up to keep Σ = n·c
        c, n = row["backward_scalar"] / row["loss_sum"], row["valid_tokens"]
        row.update(
            token_weight_sum=c * n, token_weight_min=-c if n > 1 else c, token_weight_max=c * (n + 1) if n > 1 else c
        )
    finding = only(audit_rows(tmp_path, rows), Code.NONUNIFORM_IN_MICROBATCH)
    assert (
        "in one record token weights differ by 1.33× the heaviest's magnitude and some are below 0" in finding.message
    )
    assert "% below" not in finding.message


def test_a_run_whose_divisor_nobody_saw_states_no_q_nor_d_in_its_summary(tmp_path: Path) -> None:
    """D unseen (divisor_known false): q = e·N depends on it, and the finding gives q under each reading; the
    summary's weight_range, read as the run's q, is null rather than the average's reading (1 for W·S/N into a
    summing hook, a wrong run), and its divisors list no D: the records hold the recorder's default W, not a
    divisor anyone saw."""
    rows = [dict(r, divisor_known=False, grad_divisor=2.0) for r in records(UNEVEN_GA, token_mean)]
    report = audit_rows(tmp_path, rows)
    assert codes(report) == {"unknown_divisor"} and report.runs[0].verdict == "inconclusive"
    assert report.runs[0].weight_range is None and report.runs[0].divisors == []


def test_whether_a_zero_token_nan_reached_the_weights_is_read_from_every_later_loss(tmp_path: Path) -> None:
    """Weights once NaN make every later loss NaN, in every loss term: the aux term's NaN at step 1, its own later
    steps empty, is settled by the main term's finite losses after it; and a later update skipped for an overflow
    (b infinite, the loss finite) shows finite weights as well. Neither is an error."""
    main = records([[[2], [3]]] * 4, token_mean)
    aux = records([[[1], [2]], [[0], [2]], [[0], [0]], [[0], [0]]], token_mean, term="aux")
    for row in aux:
        if row["valid_tokens"] == 0:
            row["backward_scalar"] = float("nan") if row["step"] == 1 else 0.0
    report = audit_rows(tmp_path / "terms", main + aux)
    assert only(report, Code.ZERO_TOKEN_NONFINITE).severity == Severity.INFO
    assert not [f for f in report.findings if f.severity == Severity.ERROR]
    rows = records([[[2], [3]], [[0], [4]], [[1], [5]]], lambda S, N, W, n, **_: W * S / N if n else float("nan"))
    for row in rows:
        if row["step"] == 2:
            row.update(skipped=True, backward_scalar=math.inf if row["rank"] == 0 else row["backward_scalar"])
    zero = only(audit_rows(tmp_path / "overflow", rows), Code.ZERO_TOKEN_NONFINITE)
    assert zero.severity == Severity.INFO and not zero.evidence["reached_weights"]


def test_an_update_a_guard_dropped_before_its_last_microbatch_is_information(tmp_path: Path) -> None:
    """A guard drops update 1 after its first microbatch (no_sync, then an error, the gradients cleared, no step): the
    log holds that microbatch alone, never synchronized, the update skipped. Nothing of it reached the weights, and
    every update after it is whole and the token mean: missing_sync is information, the run correct."""
    rows = records([[[3, 2], [1, 7]], [[2, 2], [6, 1]], [[4, 1], [1, 1]]], token_mean)
    for row in rows:
        row["sync"] = row["micro"] == 1
    rows = [row for row in rows if not (row["step"] == 1 and row["micro"] == 1)]
    for row in rows:
        row["skipped"] = row["step"] == 1
    report = audit_rows(tmp_path / "dropped", rows)
    assert only(report, Code.MISSING_SYNC).severity == Severity.INFO and report.runs[0].verdict == "correct"


def test_copies_of_a_key_in_one_file_that_differ_leave_the_verdict_to_what_they_cannot_change(tmp_path: Path) -> None:
    """A writer that logs every microbatch under micro 0 (a correct token mean over 2 microbatches a rank): each
    step's copies lie in one file and differ. Keeping the later copy alone halves N, a uniform factor that is no
    evidence (it read incorrect, scale_mismatch): the logs cannot tell. Two loss heads logged without a term column,
    the first a local mean, the second the token mean: the later copies are the second head's, and the run read
    correct; it is inconclusive. A rank-local mean whose kept copies weigh their tokens apart stays incorrect."""
    rows = records(UNEVEN_GA, token_mean)
    for row in rows:
        row["micro"] = 0
    report = audit_rows(tmp_path / "untold", rows)
    assert report.runs[0].verdict == "inconclusive", report.findings
    assert all(f.undecidable for f in report.findings) and "duplicate_records" in codes(report)

    heads = [
        {**row, "micro": 0, "backward_scalar": scalar}
        for main, aux in zip(records(UNEVEN, local_mean), records(UNEVEN, token_mean))
        for row, scalar in ((main, main["backward_scalar"]), (aux, aux["backward_scalar"]))
    ]
    report = audit_rows(tmp_path / "heads", heads)
    assert report.runs[0].verdict == "inconclusive", report.findings

    wrong = records(UNEVEN_GA, local_mean)
    for row in wrong:
        row["micro"] = 0
    report = audit_rows(tmp_path / "wrong", wrong)
    assert report.runs[0].verdict == "incorrect", report.findings

    # S/N into DDP's average (half the token mean at every step), one record of the last step logged twice: the
    # steps without a copy still say it (the copy made the whole finding cannot-tell)
    halved = records(UNEVEN_GA, lambda S, N, **_: S / N)
    last = halved[-1]
    halved.append(dict(last, loss_sum=last["loss_sum"] * 1.01, backward_scalar=last["backward_scalar"] * 1.01))
    report = audit_rows(tmp_path / "halved", halved)
    assert report.runs[0].verdict == "incorrect" and "world_size_mismatch" in codes(report), report.findings


def test_guessed_update_ends_over_uniform_weights_name_no_denominator(tmp_path: Path) -> None:
    """The token mean over 2 microbatches a rank, each microbatch taken for an update (the footers say the ends were
    guessed), 12 positions recorded a microbatch and N = 24 an update: every step's tokens weigh alike, 1/24, which
    the fits read as the 24 positions of a step's two records (it read padded_denominator, an error). No
    denominator is named then: inconclusive. A rank-local mean, whose tokens weigh apart inside a step, stays
    incorrect."""
    counts = [[[5, 7], [3, 9]], [[2, 10], [6, 6]], [[8, 4], [4, 8]]]
    for name, weights, want in (("token_mean", token_mean, "inconclusive"), ("local_mean", local_mean, "incorrect")):
        rows = [
            dict(row, step=2 * row["step"] + row["micro"], micro=0, positions=12) for row in records(counts, weights)
        ]
        folder = write_by_rank(tmp_path / name, rows, metadata={PROVENANCE_KEY: b'{"steps_inferred": true}'})
        report = audit([folder])
        assert report.runs[0].verdict == want, (name, report.findings)
        assert "update_ends_guessed" in codes(report)


def test_a_class_weighted_mean_is_never_incorrect_for_its_factor_and_stays_incorrect_for_what_weights_do_not_make(
    tmp_path: Path,
) -> None:
    """A cross-entropy with class weights (the footers say `class_weights`) divided by Σw over the update: every token
    of a step weighs 1/Σw, N/Σw of 1/N, a factor the labels set (1/1.3, 1/0.8, 1/1.7 here). Without the fact it is
    incorrect (scale_mismatch); with it, the logs cannot tell. What class weights do not make stays incorrect with
    the fact: a rank-local mean, whose tokens weigh apart inside a step, and a factor of exactly 1/W at every step
    (the W left out: weights of 1 passed as weight=, or an unweighted main loss beside a weighted auxiliary one)."""
    mass = {0: 1.3, 1: 0.8, 2: 1.7}  # Σw / N of each step
    by_labels = [
        dict(row, backward_scalar=row["backward_scalar"] / mass[row["step"]]) for row in records(UNEVEN_GA, token_mean)
    ]
    report = audit([write_by_rank(tmp_path / "by_labels", by_labels)])
    assert report.runs[0].verdict == "incorrect" and "scale_mismatch" in codes(report), report.findings
    said = {PROVENANCE_KEY: b'{"class_weights": true}'}
    report = audit([write_by_rank(tmp_path / "by_labels_weighted", by_labels, metadata=said)])
    assert report.runs[0].verdict == "inconclusive", report.findings
    finding = only(report, Code.SCALE_MISMATCH)
    assert finding.undecidable and "cross_entropy(weight=...)" in finding.message
    halved = [dict(row, backward_scalar=row["backward_scalar"] / 2) for row in records(UNEVEN_GA, token_mean)]
    for name, rows in (("local", records(UNEVEN_GA, local_mean)), ("halved", halved)):
        report = audit([write_by_rank(tmp_path / name, rows, metadata=said)])
        assert report.runs[0].verdict == "incorrect", (name, report.findings)


def test_a_stale_w_after_a_resize_is_fixed_in_the_w_and_microbatches_of_the_steps_it_affects(tmp_path: Path) -> None:
    """W = 2 with 3 microbatches, then a relaunch on W = 4 with 2 that kept b = 2·S/N: the fix names the affected
    steps' W = 4, their 2 microbatches and 4 ranks (it named the first launch's W = 2, 3 microbatches, 2 ranks)."""
    two = [[[3, 1, 2], [2, 5, 1]]] * 2
    four = [[[3, 1], [2, 5], [4, 2], [1, 6]]] * 2
    stale = lambda S, N, **_: 2 * S / N  # noqa: E731
    rows = records(two, token_mean) + records(four, stale, step_offset=2)
    finding = only(audit_rows(tmp_path, rows), Code.WORLD_SIZE_MISMATCH)
    assert (finding.steps.first, finding.steps.last) == (2, 3)
    assert (
        "W=4 (the size of the averaging group)" in finding.fix
        and "all 2 microbatches of the step on all 4 ranks" in finding.fix
    )
    # after the resize one microbatch a step, the run's 3 before it: the fix keeps the 3 (a fix of one microbatch would
    # read as N counted per microbatch)
    one = [[[3], [2], [5]]] * 2
    rows = records(two, token_mean) + records(one, stale, step_offset=2)
    finding = only(audit_rows(tmp_path / "one", rows), Code.WORLD_SIZE_MISMATCH)
    assert "W=3 (the size" in finding.fix and "all 3 microbatches of the step on all 3 ranks" in finding.fix, (
        finding.fix
    )


def test_a_dp_by_tp_loop_recorded_without_its_group_is_told_to_give_it(tmp_path: Path) -> None:
    """2 DP × 2 TP on 4 ranks, the token mean over the DP group of 2 (b = 2·S/N, N counted once), recorded without
    group=: W = 4, D = 2 said, each TP pair's records alike, so the log's N counts every token twice (q = 2). The
    finding says what D ≠ W points to, and its fix gives group= first; a D of W (or 1) does not."""
    dp = [[[3, 1], [2, 5]], [[4, 2], [1, 6]]]  # step, DP rank, microbatch
    rows = []
    for row in records(dp, token_mean):
        for tp in range(2):  # each DP rank's tokens held by two ranks, recorded as ranks 2·r and 2·r + 1
            rows.append(dict(row, rank=2 * row["rank"] + tp, world_size=4, grad_divisor=2.0))
    finding = only(audit_rows(tmp_path / "nogroup", rows), Code.WORLD_SIZE_MISMATCH)
    assert "D=2 is no average over W=4" in finding.message and finding.fix.startswith("record with Recorder(group=")
    hard = records(UNEVEN_GA, lambda S, N, **_: 4 * S / N)  # W = 2, a hard-coded 4: D = W
    assert "no average over" not in only(audit_rows(tmp_path / "hard", hard), Code.WORLD_SIZE_MISMATCH).message


def test_an_untold_loss_scale_that_halves_beside_steps_one_rank_holds_is_never_a_local_mean(tmp_path: Path) -> None:
    """The token mean under a GradScaler the recorder was not given, its scale halving once (65536 → 32768, = W),
    with steps where one rank holds every token: the rank count fits every step at one α (balanced and single-holder
    steps weigh their tokens alike), yet no step's weights differ. A loss scale the logs show, never local_mean."""
    counts = [[[6], [6]], [[4], [4]], [[7], [7]], [[5], [5]], [[0], [9]], [[8], [0]], [[3], [3]], [[2], [2]]]
    rows = []
    for step, ranks in enumerate(counts):
        scale = 65536 if step < 4 else 32768
        rows += records([ranks], lambda S, N, W, **_: scale * W * S / N, step_offset=step)  # noqa: B023
    report = audit_rows(tmp_path, rows)
    assert report.runs[0].verdict != "incorrect" and "local_mean" not in codes(report), codes(report)
    assert "loss_scale" in codes(report)


def test_terms_that_never_share_a_step_are_each_a_token_mean_of_their_own(tmp_path: Path) -> None:
    """Two terms in turn, a step each (two optimizers on one model, each its own updates): each weighs its tokens 1/N
    of its own step, correct; no step holds both, so they are no pieces of one loss, and equal counts say nothing."""
    rows = []
    for step, ranks in enumerate([[[3, 1], [2, 5]], [[4, 2], [1, 6]], [[2, 2], [2, 2]], [[5, 1], [1, 5]]]):
        rows += records([ranks], token_mean, step_offset=step, term="A" if step % 2 == 0 else "B")
    report = audit_rows(tmp_path, rows)
    assert report.runs[0].verdict == "correct" and codes(report) == set(), codes(report)


def test_pieces_of_one_loss_with_a_step_one_piece_holds_alone_are_correct(tmp_path: Path) -> None:
    """One loss in two pieces recorded as terms, each W·S/N over the whole step's N: equal counts wherever both hold
    tokens, and one step piece B holds none. That step tells pieces from two heads missing 1/2 (q would be 1/2 there):
    correct, with no balanced_counts."""
    pieces = {
        "A": [[[3], [2]], [[4], [1]], [[2], [5]], [[6], [2]]],
        "B": [[[3], [2]], [[4], [1]], [[2], [5]], [[0], [0]]],
    }
    rows = []
    for step in range(4):
        total = sum(sum(ranks[0]) + sum(ranks[1]) for ranks in (pieces["A"][step], pieces["B"][step]))
        for term, counts in pieces.items():
            rows += records([counts[step]], lambda S, W, **_: W * S / total, step_offset=step, term=term)  # noqa: B023
    report = audit_rows(tmp_path, rows)
    assert report.runs[0].verdict == "correct" and "balanced_counts" not in codes(report), codes(report)


def test_the_fix_counts_every_microbatch_of_a_finding_whose_step_shown_has_one(tmp_path: Path) -> None:
    """A rank-local mean over steps of 1, 3 and 2 microbatches, shown at a step of one: the fix still counts N over
    the microbatches of each step (the run's 3), never over one alone, which on the other steps would be N per
    microbatch (per_micro_denominator)."""
    counts = [[[4], [2]], [[3, 1, 5], [2, 2, 6]], [[2, 6], [5, 1]]]
    finding = only(audit_rows(tmp_path, records(counts, lambda S, n_r, **_: S / n_r)), Code.LOCAL_MEAN)
    assert "N summed over all 3 microbatches of the step on all 2 ranks" in finding.fix, finding.fix


def test_a_w_that_returns_is_said_in_order_and_a_w_one_rank_misreports_adds_no_missing_rank(tmp_path: Path) -> None:
    """W 3 → 2 → 3 over five steps: the change back is said (it read 3 → 2). A step where one rank says W = 4 among
    ranks that say 3 is world_size_inconsistent's, no change of W (it was said)."""
    three, two = [[[2], [3], [1]]], [[[4], [2]]]
    rows = records(three, token_mean) + records(two * 2, token_mean, step_offset=1)
    rows += records(three * 2, token_mean, step_offset=3)
    finding = only(audit_rows(tmp_path / "back", rows), Code.WORLD_SIZE_CHANGED)
    assert "3 → 2 → 3" in finding.message and finding.evidence["world_sizes"] == [3, 2, 3]
    rows = records(three * 4, token_mean, grad_divisor=3.0)  # (the divisor said: the W misreported divides nothing)
    for row in rows:
        if row["step"] == 2 and row["rank"] == 1:
            row["world_size"] = 4
    assert "world_size_changed" not in codes(audit_rows(tmp_path / "misreported", rows))
    # W 2 ↔ 4 twelve times over, then 3: the first sizes and the latest, the cut said (the 3 was lost)
    rows = []
    for step, size in enumerate([2, 4] * 12 + [3]):
        rows += records([[[1 + (rank + step) % 3] for rank in range(size)]], token_mean, step_offset=step)
    finding = only(audit_rows(tmp_path / "often", rows), Code.WORLD_SIZE_CHANGED)
    assert finding.evidence["world_sizes"][-1] == 3 and finding.evidence["world_sizes_cut"] is True
    assert "→ … → 3 (an elastic restart" in finding.message


def test_duplicate_records_in_more_files_than_it_names_says_there_are_more(tmp_path: Path) -> None:
    """The log written twice, a file a rank each time, 3 ranks: six files hold copies. The finding names four and says
    there are more (it named four as if they were all); four files it names as they are."""

    def written_twice(folder: Path, counts: list[Any]) -> Path:
        rows = records(counts, token_mean)
        for copy in ("a", "b"):
            for rank in range(len(counts[0])):
                write(folder / f"{copy}-rank-{rank}.parquet", [r for r in rows if r["rank"] == rank])
        return folder

    finding = only(audit([written_twice(tmp_path / "six", [[[2], [3], [4]], [[1], [5], [2]]])]), Code.DUPLICATE_RECORDS)
    assert len(finding.evidence["files"]) == 4 and " and more:" in finding.message, finding.message
    finding = only(audit([written_twice(tmp_path / "four", [[[2], [3]], [[1], [5]]])]), Code.DUPLICATE_RECORDS)
    assert len(finding.evidence["files"]) == 4 and "and more" not in finding.message, finding.message


def test_duplicate_records_name_their_files_below_rank_folders_whatever_the_ranges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rank=K/ folders whose files are named alike (part-0.parquet in each), a copy of one record beside each: the
    files named are the same whether the log is aggregated in one range or many, each with its folder (several
    ranges named part-0.parquet and part-1.parquet once each, with no "and more"; one range, part-0.parquet twice)."""
    rows = records([[[2], [3], [4]]] * 40, token_mean)
    for rank in range(3):
        mine = [{k: v for k, v in r.items() if k != "rank"} for r in rows if r["rank"] == rank]
        write(tmp_path / "run" / f"rank={rank}" / "part-0.parquet", mine)
        write(tmp_path / "run" / f"rank={rank}" / "part-1.parquet", [mine[10 * rank]])
    named = ["rank=0/part-0.parquet", "rank=0/part-1.parquet", "rank=1/part-0.parquet", "rank=1/part-1.parquet"]
    for chunk in ("1000000", "20"):
        monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", chunk)
        finding = only(audit([tmp_path / "run"]), Code.DUPLICATE_RECORDS)
        assert finding.evidence["files"] == named and f"in {', '.join(named)} and more:" in finding.message, chunk


def test_a_per_microbatch_mean_divided_by_m_says_the_m_of_the_step_it_shows(tmp_path: Path) -> None:
    """loss.mean() / M, a step of 2 microbatches shown, the run's most 3: it said M=3 beside the step of 2."""
    rows = records([[[9, 1], [1, 9]], [[3, 3, 4], [3, 4, 3]]], lambda S, n, M, **_: S / (n * M))
    finding = only(audit_rows(tmp_path, rows), Code.LOCAL_MEAN)
    assert "at step 0 " in finding.message and "divided by the number of microbatches M=2 " in finding.message


def test_records_of_one_step_that_declare_different_weights_for_a_term_are_an_error(tmp_path: Path) -> None:
    """A warm-up counted per rank: at step 1 rank 0 declares λ = 0 (its aux loss times 0) and rank 1 λ = 0.5. Each
    record reads right against its own λ, so the run read correct; its aux tokens weigh 0 on one rank and 0.5/N on
    the other, no λ·ΣS/N. Said, and the run incorrect; one λ a step over the ranks stays correct."""
    main = records(UNEVEN_GA, token_mean)

    def aux(per_rank: Any) -> list[dict[str, Any]]:
        rows = records(UNEVEN_GA, token_mean, term="aux")
        return [dict(r, term_weight=(w := per_rank(r)), backward_scalar=w * r["backward_scalar"]) for r in rows]

    report = audit_rows(tmp_path / "per_rank", main + aux(lambda r: 0.0 if r["step"] == 1 and r["rank"] == 0 else 0.5))
    finding = only(report, Code.TERM_WEIGHT_INCONSISTENT)
    assert report.verdicts == {"run": "incorrect"} and finding.term == "aux" and finding.steps.first == 1
    assert "(step 1: λ from 0 to 0.5)" in finding.message
    report = audit_rows(tmp_path / "per_step", main + aux(lambda r: 0.0 if r["step"] == 1 else 0.5))
    assert report.verdicts == {"run": "correct"} and report.findings == []
    # a record of no valid token weighs nothing whatever its λ; 0.1·3 and 0.3 are one λ
    some_empty = [[[0, 1], [3, 7]], [[2, 6], [6, 2]], [[8, 4], [2, 8]]]  # rank 0's first microbatch: no aux token
    empty = [
        dict(
            r,
            term="aux",
            term_weight=0.0 if r["valid_tokens"] == 0 else 0.3,
            backward_scalar=0.3 * r["backward_scalar"],
        )
        for r in records(some_empty, token_mean)
    ]
    rounded = aux(lambda r: 0.1 * 3 if r["rank"] == 0 else 0.3)
    for name, rows in (("empty", main + empty), ("rounded", main + rounded)):
        assert audit_rows(tmp_path / name, rows).verdicts == {"run": "correct"}, name


def _killed(counts: list[Any], cut: list[Any], **columns: Any) -> list[dict[str, Any]]:
    """Whole updates said applied, each rank's last microbatch synchronized; then `cut`'s first microbatches of one
    more update, unsynchronized and said nothing of (a kill inside it after a flush)."""
    whole = [dict(r, skipped=False, **columns) for r in records(counts, token_mean)]
    ends = {
        (r["step"], r["rank"]): max(x["micro"] for x in whole if (x["step"], x["rank"]) == (r["step"], r["rank"]))
        for r in whole
    }
    for r in whole:
        r["sync"] = r["micro"] == ends[(r["step"], r["rank"])]
    return whole + [dict(r, sync=False, **columns) for r in records(cut, token_mean, step_offset=len(counts))]


def test_a_last_update_cut_short_is_read_per_group_and_rank_and_never_where_something_says_it_was_applied(
    tmp_path: Path,
) -> None:
    """A kill inside the last update: left out with a warning where each group's ranks hold fewer microbatches than
    the most before (a group of one microbatch beside one of two; updates of 4, 4, 2 and 4 microbatches, cut at 2;
    an update a guard dropped before), not where a rank holds as many as before, nor where another term says the
    update was applied and synchronized (that term's weights then judged). Where the cut cannot be left out (sync
    recorded by one rank only), the logs cannot tell: inconclusive, not incorrect."""
    two = [[[5, 1], [3, 7]], [[2, 6], [6, 2]], [[8, 4], [2, 8]]]
    groups = _killed(two, [[[4], [1]]], group="g0") + [
        dict(r, group="g1", skipped=False, sync=True) for r in records([[[3], [4]]] * 3, token_mean)
    ]
    varied = _killed(
        [[[1, 1, 1, 1], [2, 2, 2, 2]]] * 2 + [[[3, 3], [1, 5]], [[1, 1, 1, 1], [2, 2, 2, 2]]], [[[2, 2], [1, 1]]]
    )
    guarded = _killed(two, [[[4], [1]]])
    guarded = [dict(r, skipped=True, sync=False) if r["step"] == 1 else r for r in guarded]  # dropped by a guard
    for name, rows in (("groups", groups), ("varied", varied), ("guarded", guarded)):
        report = audit_rows(tmp_path / name, rows)
        assert report.verdicts == {"run": "inconclusive"} and "unfinished_update" in codes(report), name
    # a rank that ran as many microbatches as before and never synchronized is no kill's
    full = [r for r in _killed(two, [[[4, 3], [1, 6]]]) if not (r["step"] == 3 and r["rank"] == 0 and r["micro"] == 1)]
    assert "missing_sync" in codes(audit_rows(tmp_path / "full", full))
    applied = _killed(two, [[[4], [1]]]) + [
        dict(r, term="x", sync=r["micro"] == 1, skipped=False, backward_scalar=2 * r["backward_scalar"])
        for r in records([*two, [[4, 3], [1, 6]]], token_mean)
    ]
    assert "unfinished_update" not in codes(audit_rows(tmp_path / "applied", applied))
    unsaid = [dict(r, skipped=None) if 1 <= r["step"] else r for r in _killed(two, [[[4], [1]]])]
    report = audit_rows(tmp_path / "unsaid", unsaid)
    assert (
        report.verdicts == {"run": "inconclusive"} and only(report, Code.UNFINISHED_UPDATE).severity == Severity.WARNING
    )
    one_rank = [dict(r, sync=None) if r["rank"] == 1 else r for r in _killed(two, [[[4], [1]]])]
    only_one = _killed([], [[[4], [1]]])  # a run of one step, cut: no update says how many a whole one holds
    for name, rows in (("one_rank", one_rank), ("only_one", only_one)):
        report = audit_rows(tmp_path / name, rows)
        assert report.verdicts == {"run": "inconclusive"} and only(report, Code.MISSING_SYNC).evidence["cut_short"]
    # a group whose whole last update did not synchronize beside one cut short; a term's update cut short mid-run
    beside = groups + [
        dict(r, group="g2", skipped=r["step"] < 3 or None, sync=r["micro"] == 1 and r["step"] < 3)
        for r in records([*two, [[4, 3], [1, 6]]], token_mean)
    ]
    assert "missing_sync" in {
        f.code.value for f in audit_rows(tmp_path / "beside", beside).findings if f.severity == Severity.ERROR
    }
    # (terms named "main" and "aux": "aux", first by name, is the one whose sync is read)
    mid = [dict(r, term="main", skipped=False, sync=r["micro"] == 1) for r in records([*two, *two], token_mean)]
    mid = [dict(r, backward_scalar=r["loss_sum"] / r["valid_tokens"]) if r["step"] == 1 else r for r in mid]
    aux = records([[[4, 3], [1, 6]], [[2], [6]]], token_mean, term="aux")
    mid += [dict(r, skipped=False, sync=r["micro"] == 1 and r["step"] == 0) for r in aux]
    report = audit_rows(tmp_path / "mid", mid)
    assert report.verdicts == {"run": "incorrect"} and only(report, Code.LOCAL_MEAN).severity == Severity.ERROR


def test_the_main_term_is_the_unnamed_one_else_one_that_synchronized_else_one_that_accumulated_else_the_most() -> None:
    """ "0" (the recorder's default) is the main term wherever a record is of it; where every term is named, one some
    record of which synchronized (an auxiliary loss of the first microbatch, recorded by several layers, outnumbers
    the loss but never synchronizes), then one some step of which holds records that synchronized and records that
    did not (an accumulation's: an auxiliary loss of the last microbatch by several layers outnumbers the loss and
    synchronizes, but never so), then the most records in one group, ties by name. (synchronized, most, accumulating
    steps)."""
    from tokaudit._checks import main_term_first

    assert main_term_first({"aux": (0.0, 4.0, 0.0), "lm": (2.0, 8.0, 2.0)}) == ["lm", "aux"]
    assert main_term_first({"router": (0.0, 12.0, 0.0), "lm": (2.0, 8.0, 2.0)}) == ["lm", "router"]
    assert main_term_first({"aux": (1.0, 8.0, 1.0), "0": (0.0, 2.0, 0.0), "b": (1.0, 9.0, 1.0)}) == ["0", "aux", "b"]
    tied = {"mtp2": (3.0, 6.0, 3.0), "mtp1": (3.0, 6.0, 3.0), "ce": (3.0, 3.0, 3.0)}
    assert main_term_first(tied) == ["mtp1", "ce", "mtp2"]
    assert main_term_first({"z": (6.0, 12.0, 0.0), "lm": (3.0, 8.0, 3.0)}) == ["lm", "z"]
    assert main_term_first({"z": (6.0, 12.0, 0.0), "lm": (3.0, 8.0, 0.0)}) == ["z", "lm"]  # (no accumulation)
    assert main_term_first({"x": (0.0, 4.0, 0.0), "y": (0.0, 6.0, 0.0)}) == ["y", "x"]  # none synchronized: the most
    assert main_term_first({"only": (0.0, 0.0, 0.0)}) == ["only"] and main_term_first({}) == []


@pytest.mark.parametrize(
    "aux", ["3 layers on the first microbatch of one stage, once on the other", "3 layers on the last"]
)
def test_an_auxiliary_loss_of_more_records_that_never_accumulates_is_not_the_main_term(
    tmp_path: Path, aux: str
) -> None:
    """2 ranks under no_sync() over 2 microbatches, "lm" on each (synchronized on the last), each a token mean, the
    logged loss lm's ΣS/N. "aux" recorded by 3 layers on the first microbatch of stage s0 (unsynchronized) and once
    on the last of s1 (synchronized), or by 3 layers on the last microbatch beside lm: it synchronized somewhere and
    outnumbers lm in one group, so it was the main term, its first microbatch's records a missing_sync (incorrect),
    or every microbatch synchronizing (sync_every_micro) and the logged loss 3× off (reported_loss_mismatch). lm's
    steps hold records that synchronized and records that did not, as an accumulation's loss does: correct."""
    counts = [[[5, 3], [2, 7]], [[4, 4], [9, 1]], [[3, 6], [6, 2]]]
    lm = [dict(r, term="lm", group="s1", sync=r["micro"] == 1) for r in records(counts, token_mean)]
    micro = 0 if aux.endswith("other") else 1
    layers = [[[mine[micro] + layer for layer in range(3)] for mine in step] for step in counts]
    extra = [
        dict(r, term="aux", group="s0" if micro == 0 else "s1", sync=micro == 1) for r in records(layers, token_mean)
    ]
    if micro == 0:  # and once, on the last microbatch of s1
        extra += [
            dict(r, term="aux", group="s1", sync=True)
            for r in records([[[s[k][1]] for k in range(2)] for s in counts], token_mean)
        ]
    means = {s: sum(r["loss_sum"] for r in lm if r["step"] == s) / sum(map(sum, counts[s])) for s in range(3)}
    report = _by_group(tmp_path, [dict(r, reported_loss=means[r["step"]]) for r in lm + extra])
    assert report.runs[0].terms == ["lm", "aux"]
    assert report.runs[0].verdict == "correct" and report.findings == [], report.findings


def test_an_auxiliary_loss_of_every_pipeline_stage_is_not_the_main_term_of_the_last_stage_s_loss(
    tmp_path: Path,
) -> None:
    """Three pipeline stages, each a group of 2 ranks under no_sync() over 2 microbatches: the last stage records
    "lm" on every microbatch, every stage an auxiliary "router" on its first microbatch alone, each a token mean,
    the reported loss lm's ΣS/N. Counted over the run, router's records outnumber lm's (3 groups against 1) and
    router was read as the main term: its unsynchronized first microbatches missing_sync, the logged loss a
    reported_loss_mismatch (incorrect). The most records one group holds decides: lm, correct."""
    counts = [[[5, 3], [2, 7]], [[4, 4], [9, 1]], [[3, 6], [6, 2]]]
    lm = [dict(r, term="lm", group="s2", sync=r["micro"] == 1) for r in records(counts, token_mean)]
    firsts = [[[mine[0]] for mine in step] for step in counts]
    router = [
        dict(
            r,
            term="router",
            group=g,
            sync=False,
            loss_sum=0.01 * r["loss_sum"],
            backward_scalar=0.01 * r["backward_scalar"],
        )
        for g in ("s0", "s1", "s2")
        for r in records(firsts, token_mean)
    ]
    means = {s: sum(r["loss_sum"] for r in lm if r["step"] == s) / sum(map(sum, counts[s])) for s in range(3)}
    rows = [dict(r, reported_loss=means[r["step"]]) for r in lm + router]
    for group, rank in {(r["group"], r["rank"]) for r in rows}:
        write(
            tmp_path / "run" / f"{group}-{rank}.parquet", [r for r in rows if (r["group"], r["rank"]) == (group, rank)]
        )
    report = audit([tmp_path])
    assert report.findings == [] and report.runs[0].verdict == "correct" and report.runs[0].terms == ["lm", "router"]


def test_an_auxiliary_loss_recorded_by_several_layers_in_the_first_microbatch_is_not_the_main_term(
    tmp_path: Path,
) -> None:
    """2 ranks under no_sync() over 2 microbatches: "lm" on each, "router" recorded by 3 layers in the first alone
    (its microbatch indices count per term: 0, 1, 2, every record unsynchronized), each a token mean. router's
    records outnumber lm's and it was read as the main term (missing_sync: incorrect); a term some record of which
    synchronized comes first."""
    counts = [[[5, 3], [2, 7]], [[4, 4], [9, 1]], [[3, 6], [6, 2]]]
    lm = [dict(r, term="lm", sync=r["micro"] == 1) for r in records(counts, token_mean)]
    layers = [[[mine[0] + layer for layer in range(3)] for mine in step] for step in counts]  # (tokens routed)
    router = [dict(r, term="router", sync=False) for r in records(layers, token_mean)]
    report = audit_rows(tmp_path / "run", lm + router)
    assert report.runs[0].verdict == "correct" and report.runs[0].terms == ["lm", "router"]
    assert report.findings == []


@pytest.mark.parametrize("broken", [False, True, "cleared"])
def test_a_pipeline_stage_that_holds_no_record_of_the_main_term_is_read_by_its_own_loss(
    tmp_path: Path, broken: bool | str
) -> None:
    """Two pipeline stages, each a group of 2 ranks under no_sync(): the first records "router" on each of its 4
    virtual-chunk microbatches, the second "lm" on each of its 2, each a token mean synchronized on its last
    microbatch. router, of the most records in one group, is the run's main term, and no sync or structure check
    read lm's stage: one whose lm never synchronized at step 1 read correct. A group without the main term is read by
    its own; as its loss may be an auxiliary one that the update's last microbatch does not record, the logs cannot
    tell whether that microbatch synchronized: missing_sync at that step, a warning, inconclusive. An update a guard
    dropped on both stages (its first microbatch alone recorded, unsynchronized, every record skipped) is the main
    term's to say (information): correct."""
    lm_counts = [[[5, 3], [2, 7]], [[4, 4], [9, 1]], [[3, 6], [6, 2]]]
    router_counts = [[[2, 3, 1, 4], [5, 1, 2, 2]], [[3, 3, 3, 1], [1, 2, 6, 2]], [[4, 1, 2, 2], [2, 5, 1, 3]]]
    lm = [
        dict(r, term="lm", group="s1", sync=r["micro"] == 1 and not (broken and r["step"] == 1))
        for r in records(lm_counts, token_mean)
    ]
    router = [dict(r, term="router", group="s0", sync=r["micro"] == 3) for r in records(router_counts, token_mean)]
    dropped = [dict(r, sync=False, skipped=True) for r in lm + router if r["step"] == 1 and r["micro"] == 0]
    if broken == "cleared":  # step 1 of each stage: its first microbatch alone
        lm, router = ([r for r in rows if r["step"] != 1] for rows in (lm, router))
    report = _by_group(tmp_path, lm + router + (dropped if broken == "cleared" else []))
    assert report.runs[0].terms == ["router", "lm"]
    if broken == "cleared":
        assert report.runs[0].verdict == "correct" and [(f.code, f.term) for f in report.findings] == [
            (Code.MISSING_SYNC, "router")
        ]
        return
    if not broken:
        assert report.findings == [] and report.runs[0].verdict == "correct"
        return
    assert report.runs[0].verdict == "inconclusive"
    (finding,) = report.findings
    assert (finding.code, finding.term, finding.steps.first, finding.steps.last) == (Code.MISSING_SYNC, "lm", 1, 1)
    assert finding.undecidable and finding.evidence["rank_steps"] == 2


@pytest.mark.parametrize("microbatches", [2, 1])
def test_a_stage_whose_loss_synchronizes_every_microbatch_but_one_update_never_is_never_correct(
    tmp_path: Path, microbatches: int
) -> None:
    """Stage s0 records "router" under no_sync() over 2 microbatches (the run's main term: its steps show an
    accumulation); stage s1 records "lm" on each of its microbatches, every one synchronized (a loop without
    no_sync(), or of one microbatch), but at step 1, where none did: s1 stepped on its local gradients. lm shows no
    accumulation, so it stood in for no one and s1 was read by no check: correct. A term whose steps all synchronized
    beside one that never did shows where updates end: read, its missing sync a warning (an auxiliary loss of the
    first microbatch synchronizes only in a last update of one microbatch: the logs cannot tell), never correct."""
    counts = [[[5, 3], [2, 7]], [[4, 4], [9, 1]], [[3, 6], [6, 2]]]
    lm_counts = [[mine[:microbatches] for mine in step] for step in counts]
    lm = [dict(r, term="lm", group="s1", sync=r["step"] != 1) for r in records(lm_counts, token_mean)]
    router = [
        dict(
            r,
            term="router",
            group="s0",
            sync=r["micro"] == 1,
            loss_sum=0.01 * r["loss_sum"],
            backward_scalar=0.01 * r["backward_scalar"],
        )
        for r in records(counts, token_mean)
    ]
    report = _by_group(tmp_path, lm + router)
    assert report.runs[0].terms == ["router", "lm"] and report.runs[0].verdict == "inconclusive", report.findings
    (finding,) = report.findings
    assert (finding.code, finding.term, finding.steps.first, finding.undecidable) == (Code.MISSING_SYNC, "lm", 1, True)


def test_a_stage_is_read_by_the_first_of_its_terms_that_shows_where_updates_end(tmp_path: Path) -> None:
    """Stage s1 records "lm" under no_sync() over 2 microbatches (the run's main term); stage s0 "enc" on its one
    microbatch an update, synchronized but at step 1, where no rank did, and from step 2 "router" by 4 layers (a
    warm-up), always synchronized. router, of the most records there, is s0's own first term but shows no update's
    end, and s0 was read by no check: correct. The first of its terms that does (enc) stands in: never correct."""
    counts = [[[5, 3], [2, 7]], [[4, 4], [9, 1]], [[3, 6], [6, 2]], [[2, 5], [4, 4]]]
    firsts = [[mine[:1] for mine in step] for step in counts]
    lm = [dict(r, term="lm", group="s1", sync=r["micro"] == 1) for r in records(counts, token_mean)]
    enc = [dict(r, term="enc", group="s0", sync=r["step"] != 1) for r in records(firsts, token_mean)]
    layers = [[[mine[0] + layer for layer in range(4)] for mine in step] for step in firsts]
    router = [dict(r, term="router", group="s0", sync=True) for r in records(layers, token_mean) if r["step"] >= 2]
    report = _by_group(tmp_path, lm + enc + router)
    assert report.runs[0].verdict == "inconclusive", report.findings
    assert [(f.code, f.term, f.steps.first) for f in report.findings] == [(Code.MISSING_SYNC, "enc", 1)]


# which microbatches of 3 hold an image, per (step, rank): a vision stage's auxiliary loss is recorded on those
_IMAGES = {(0, 0): [0, 2], (0, 1): [1, 2], (1, 0): [0, 1], (1, 1): [2], (2, 0): [1], (2, 1): [0, 2]}


@pytest.mark.parametrize("stage", ["first microbatch, then a last update of one", "microbatches with images", "layers"])
def test_a_pipeline_stage_that_records_an_auxiliary_loss_alone_is_never_incorrect(tmp_path: Path, stage: str) -> None:
    """The last stage records "lm" on each microbatch (synchronized on its last), the first stage an auxiliary loss
    alone, each record's sync the loop's: router on the first microbatch (unsynchronized, but for a last update of
    one microbatch), vis on the microbatches that hold an image (the last not always), or z by 3 layers on the last
    (the recorder numbers them 0, 1, 2, all synchronized). Every update synchronized: the first read missing_sync
    (incorrect), the second missing_sync and uneven_microbatches, the third sync_every_micro."""
    counts = [[[5, 3, 4], [2, 7, 3]], [[4, 4, 2], [9, 1, 5]], [[3, 6, 2], [6, 2, 4]], [[4], [5]]]
    if stage.startswith("first"):
        aux = [[[mine[0]] for mine in step] for step in counts]
        ended = {(s, k): len(counts[s][k]) == 1 for s in range(4) for k in range(2)}
        synced = [ended[(r["step"], r["rank"])] for r in records(aux, token_mean)]
    elif stage.startswith("micro"):
        counts = counts[:3]
        aux = [[[counts[s][k][m] for m in _IMAGES[(s, k)]] for k in range(2)] for s in range(3)]
        synced = [_IMAGES[(r["step"], r["rank"])][r["micro"]] == 2 for r in records(aux, token_mean)]
    else:
        counts = counts[:3]
        aux = [[[mine[-1] + layer for layer in range(3)] for mine in step] for step in counts]
        synced = [True for _ in records(aux, token_mean)]
    last = {(s, k): len(counts[s][k]) - 1 for s in range(len(counts)) for k in range(2)}
    lm = [
        dict(r, term="lm", group="s1", sync=r["micro"] == last[(r["step"], r["rank"])])
        for r in records(counts, token_mean)
    ]
    name = {"f": "router", "m": "vis", "l": "z"}[stage[0]]
    stage_rows = [
        dict(
            r,
            term=name,
            group="s0",
            sync=sync,
            loss_sum=0.1 * r["loss_sum"],
            backward_scalar=0.1 * r["backward_scalar"],
        )
        for r, sync in zip(records(aux, token_mean), synced)
    ]
    report = _by_group(tmp_path, lm + stage_rows)
    assert report.runs[0].verdict != "incorrect" and report.runs[0].terms[0] == "lm"
    assert {f.code for f in report.findings} <= {Code.MISSING_SYNC} and all(f.undecidable for f in report.findings)


def _by_group(tmp_path: Path, rows: list[dict[str, Any]]) -> Any:
    """The audit of rows written as a shard per (group, rank)."""
    for group, rank in {(r["group"], r["rank"]) for r in rows}:
        mine = [r for r in rows if (r["group"], r["rank"]) == (group, rank)]
        write(tmp_path / "run" / f"{group}-{rank}.parquet", mine)
    return audit([tmp_path])


@pytest.mark.parametrize(
    ("logged", "mismatched"),
    [
        ("ntp ntp ntp on every record", []),
        ("mtp mtp mtp on every record", []),
        ("ntp ntp ntp on mtp's records", []),
        ("mtp mtp ntp on every record", []),
        ("ntp ntp local on every record", [2]),
        ("local local local on mtp's records, each its own", [0, 2]),  # (at step 1 the ranks hold 8 tokens each)
    ],
)
def test_a_logged_loss_of_either_of_two_terms_the_records_cannot_tell_apart_is_no_mismatch(
    tmp_path: Path, logged: str, mismatched: list[int]
) -> None:
    """Two heads, "ntp" and "mtp", on every microbatch of 2 ranks, each a token mean: their records cannot tell
    which is the main term, which their names ordered (mtp). A trainer that logs ntp's ΣS/N was told
    reported_loss_mismatch; a logged loss that is either term's ΣS/N at its step is none, whichever records carry it,
    and one that is neither's (the mean of mtp's local means) stays one at its steps, whatever ntp's own records log.
    `logged`: what each step's logged loss is, and on whose records."""
    ntp = [dict(r, term="ntp", sync=r["micro"] == 1) for r in records(UNEVEN_GA, token_mean)]
    # mtp's loss another head's: S' = S/2 + 0.1, b = W·S'/N
    mtp = [dict(r, term="mtp", loss_sum=0.5 * r["loss_sum"] + 0.1) for r in ntp]
    mtp = [dict(r, backward_scalar=2 * r["loss_sum"] / sum(map(sum, UNEVEN_GA[r["step"]]))) for r in mtp]

    def mean(rows: list[dict[str, Any]], step: int) -> float:
        return sum(r["loss_sum"] for r in rows if r["step"] == step) / sum(map(sum, UNEVEN_GA[step]))

    def local(step: int) -> float:  # the mean over ranks of mtp's S_r/n_r
        mine = [[r for r in mtp if (r["step"], r["rank"]) == (step, k)] for k in range(2)]
        return sum(sum(r["loss_sum"] for r in rows) / sum(r["valid_tokens"] for r in rows) for rows in mine) / 2

    values = {"ntp": lambda s: mean(ntp, s), "mtp": lambda s: mean(mtp, s), "local": local}
    said = [values[name](step) for step, name in enumerate(logged.split()[:3])]
    on = mtp if "mtp's records" in logged else ntp + mtp
    rows = [dict(r, reported_loss=said[r["step"]]) if r in on else r for r in ntp + mtp]
    if "each its own" in logged:
        rows = [dict(r, reported_loss=mean(ntp, r["step"])) if r["term"] == "ntp" else r for r in rows]
    report = audit_rows(tmp_path, rows)
    assert report.runs[0].verdict == "correct" and report.runs[0].terms == ["mtp", "ntp"]
    if not mismatched:
        assert report.findings == []
        return
    finding = only(report, Code.REPORTED_LOSS_MISMATCH)
    assert finding.term == "mtp" and finding.steps.first == mismatched[0] and finding.steps.last == mismatched[-1]
    assert finding.steps.count == len(mismatched) and "mean of per-rank means" in finding.message


def _present_mean(counts: dict[int, int], step: int, world: int, group: str = "a") -> list[dict[str, Any]]:
    """One record per present rank of a step (`counts`: rank → its valid tokens), each a token mean over the ranks
    present: b = W·S/N, N their tokens."""
    tokens = sum(counts.values())
    return [
        dict(
            step=step, rank=rank, micro=0, world_size=world, group=group, valid_tokens=n,
            loss_sum=token_loss(step, rank, 0, n), backward_scalar=world * token_loss(step, rank, 0, n) / tokens,
        )
        for rank, n in counts.items()
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "verdict"),
    [
        ("rank 2 closed", "inconclusive"),
        ("rank 2 closed, a guard drops step 5", "inconclusive"),
        ("rank 1 missing once, never closed", "incorrect"),
        ("rank 1 stops unclosed", "incorrect"),
        ("another group's hole", "incorrect"),
    ],
)
def test_ranks_missing_past_a_close_are_said_under_join_only_where_every_missing_rank_closed_before(
    tmp_path: Path, case: str, verdict: str
) -> None:
    """W = 3: rank 2's recorder closed by the training code at step 2 (out of data under join()), ranks 0 and 1 on
    to step 7, each a token mean over the ranks present: right under join()'s default, not under
    divide_by_initial_world_size=False, so missing_rank is a warning (inconclusive). A rank missing that no close
    explains (rank 1 skipping step 5, or stopping at step 4 with no close, or a hole in another group at step 6)
    stays an error, wherever it falls among the steps past the close. An update a guard dropped past the close (every
    record skipped, b of a window the records do not hold all of) trained nothing: its weights say nothing there."""
    sizes = {0: 5, 1: 3, 2: 7}
    rows = []
    for step in range(8):
        present = {r: n + step for r, n in sizes.items() if r < 2 or step <= 2}
        if case.startswith("rank 1 missing") and step == 5 or case.startswith("rank 1 stops") and step > 4:
            present.pop(1)
        if "guard" in case and step == 5:  # N of the whole window, of which the guard let only these run
            rows += [
                dict(r, skipped=True, backward_scalar=r["backward_scalar"] / 2) for r in _present_mean(present, 5, 3)
            ]
        else:
            rows += _present_mean(present, step, 3)
        if case.startswith("another"):
            rows += _present_mean({r: n for r, n in {0: 4, 1: 6}.items() if (step, r) != (6, 0)}, step, 2, "b")
    closed = {PROVENANCE_KEY: b'{"closed": true}'}
    for group, rank in {(r["group"], r["rank"]) for r in rows}:
        mine = [r for r in rows if (r["group"], r["rank"]) == (group, rank)]
        write(
            tmp_path / "run" / f"{group}-{rank}.parquet", mine, metadata=closed if (group, rank) == ("a", 2) else None
        )
    report = audit([tmp_path / "run"])
    assert report.runs[0].verdict == verdict and {f.code for f in report.findings} == {Code.MISSING_RANK}
    (finding,) = report.findings
    assert bool(finding.undecidable) == (verdict == "inconclusive") and ("join()" in finding.message) == bool(
        finding.undecidable
    )


@pytest.mark.parametrize("stages", [("0", "0"), ("aux", "aux", "0")])
def test_an_update_a_guard_dropped_on_every_stage_is_said_once_as_information(
    tmp_path: Path, stages: tuple[str, ...]
) -> None:
    """Pipeline stages, each a group of 2 ranks under no_sync() over 2 microbatches, each recording a token mean on
    every microbatch: the loss ("0") on each, or on the last with "aux" on the others (which it stands for). At step
    1 a guard drops the update on every stage: the window stops before its last microbatch, no optimizer step, every
    record skipped. Nothing of it reached the weights (missing_sync, information). The cleared updates were counted
    per (group, step) and the missing ones per step number, repeated across groups: an error (incorrect) for two
    stages of the loss, a warning (inconclusive) for the stand-in of two."""
    counts = [[[5, 3], [2, 7]], [[4, 4], [9, 1]], [[3, 6], [6, 2]], [[2, 5], [4, 4]]]
    rows = [
        dict(r, term=term, group=f"s{index}", sync=r["micro"] == 1 and r["step"] != 1, skipped=r["step"] == 1)
        for index, term in enumerate(stages)
        for r in records(counts, token_mean)
        if (r["step"], r["micro"]) != (1, 1)
    ]
    report = _by_group(tmp_path, rows)
    assert report.runs[0].verdict == "correct"
    (finding,) = report.findings
    assert (finding.code, finding.severity, finding.term) == (Code.MISSING_SYNC, Severity.INFO, "0")
