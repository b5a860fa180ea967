"""The verdict on hand-made logs of the set-ups people run: AMP loss scales, skipped updates, several
loss terms, unseen divisors, elastic resizes, rounded logged losses, noisy low-precision logs, long
runs. A correct construction is never `incorrect`, a broken one never `correct`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.logs import audit_rows, codes, only, UNEVEN, UNEVEN_GA, local_mean, records, token_mean, write
from tokaudit._auditing import audit
from tokaudit.codes import Code, Severity
from tokaudit._render.json_report import render_json
from tokaudit._report import AuditReport


def verdict(report: AuditReport) -> str:
    (run,) = report.runs
    return run.verdict


def scaled(rows: list[dict[str, Any]], scale: Any) -> list[dict[str, Any]]:
    """b as the probe sees it under a loss scale (scale(step) per step)."""
    return [dict(row, backward_scalar=row["backward_scalar"] * scale(row["step"])) for row in rows]


def test_an_unrecorded_loss_scale_is_inconclusive_and_a_recorded_one_is_correct(tmp_path: Path) -> None:
    dynamic = scaled(records(UNEVEN_GA * 2, token_mean), lambda step: 2.0**16 if step < 3 else 2.0**15)
    report = audit_rows(tmp_path / "untold", dynamic)
    finding = only(report, Code.LOSS_SCALE)
    assert finding.severity == Severity.WARNING and finding.steps.count == 6
    assert finding.evidence["loss_scale_exponents"] == [15, 16]
    assert "Recorder(..., scaler=scaler)" in finding.fix
    assert codes(report) == {"loss_scale"} and verdict(report) == "inconclusive"

    told = [dict(row, grad_scale=1 / (2.0**16 if row["step"] < 3 else 2.0**15)) for row in dynamic]
    report = audit_rows(tmp_path / "told", told)
    assert report.findings == [] and verdict(report) == "correct"


def test_an_unrecorded_scale_lowered_by_overflows_is_one_scaler_not_a_world_size_factor(tmp_path: Path) -> None:
    """A dynamic scaler halved from 2^16 at each of 10 overflows, then held at 2^6 = 64, never recorded: 64 alone
    would read as a hard-coded W (q = 64 on W = 2), but beside the scaler's larger powers it is the same scaler, and
    the run is inconclusive. A run whose only factor is 64 (no scaler seen) is still judged a W mistake."""
    lowered = scaled(records(UNEVEN_GA * 6, token_mean), lambda step: 2.0 ** max(16 - step, 6))
    report = audit_rows(tmp_path / "lowered", lowered)
    assert codes(report) == {"loss_scale"} and verdict(report) == "inconclusive", codes(report)
    assert only(report, Code.LOSS_SCALE).evidence["loss_scale_exponents"][0] == 6  # 64 among the scaler's powers
    alone = audit_rows(tmp_path / "alone", scaled(records(UNEVEN_GA * 2, token_mean), lambda step: 64.0))
    assert verdict(alone) == "incorrect" and codes(alone) == {"world_size_mismatch"}
    # 2^16, then q = 2 at once (a resume in bf16 with W hard-coded twice): no scaler falls 15 halvings in one step
    gap = scaled(records(UNEVEN_GA * 4, token_mean), lambda step: 2.0**16 if step < 6 else 2.0)
    assert verdict(audit_rows(tmp_path / "gap", gap)) == "incorrect"


def test_ranks_that_disagree_on_skipping_an_update_with_tokens_are_an_error(tmp_path: Path) -> None:
    """Every weight the token mean's, but at step 1 rank 0 skipped the update and rank 1 applied it (a guard on a
    rank's own loss): the replicas' weights part there, skip_mismatch, incorrect. Every rank skipping together
    (a GradScaler's overflow) is no finding."""
    rows = [dict(r, skipped=r["step"] == 1 and r["rank"] == 0) for r in records(UNEVEN_GA, token_mean)]
    report = audit_rows(tmp_path / "apart", rows)
    finding = only(report, Code.SKIP_MISMATCH)
    assert verdict(report) == "incorrect" and codes(report) == {"skip_mismatch"}
    assert finding.severity == Severity.ERROR and (finding.steps.first, finding.steps.count) == (1, 1)
    together = [dict(r, skipped=r["step"] == 1) for r in records(UNEVEN_GA, token_mean)]
    assert audit_rows(tmp_path / "together", together).findings == []


def test_a_skipped_update_with_non_finite_values_is_not_an_error(tmp_path: Path) -> None:
    rows = records(UNEVEN_GA, token_mean)
    for row in rows:
        if row["step"] == 1:
            row.update(skipped=True, backward_scalar=math.inf if row["rank"] == 0 else row["backward_scalar"])
    report = audit_rows(tmp_path, rows)
    assert report.findings == [] and verdict(report) == "correct"
    assert report.runs[0].skipped_steps == 1
    # Not skipped, the same value is an error.
    for row in rows:
        row["skipped"] = None
    assert Code.NONFINITE_VALUES in {f.code for f in audit_rows(tmp_path / "unskipped", rows).findings}


def test_loss_terms_are_audited_each_on_its_own(tmp_path: Path) -> None:
    main = records(UNEVEN_GA, token_mean, term="0")
    aux = [
        dict(row, term="aux", loss_sum=row["loss_sum"] / 3, backward_scalar=row["backward_scalar"] / 3) for row in main
    ]  # W·S_aux/N over the same tokens
    report = audit_rows(tmp_path / "ok", main + aux)
    assert report.findings == [] and verdict(report) == "correct"
    assert report.runs[0].terms == ["0", "aux"]

    aux_local = [dict(row, backward_scalar=local_mean(S=row["loss_sum"], n=row["valid_tokens"])) for row in aux]
    report = audit_rows(tmp_path / "bad", main + aux_local)
    finding = only(report, Code.LOCAL_MEAN)
    assert finding.term == "aux" and "[term aux]" in finding.message
    assert verdict(report) == "incorrect"
    document = json.loads(render_json(report))
    assert [f.get("term") for f in document["findings"]] == ["aux"]
    assert document["report_version"] == 1
    assert {(s["term"], s["denominator"]) for s in document["runs"][0]["segments"]} == {("0", "N"), ("aux", "n_micro")}


def test_an_unseen_divisor_is_never_correct_but_local_means_still_show(tmp_path: Path) -> None:
    for name, scalar in (("right_for_a_sum", lambda S, N, **_: S / N), ("right_for_an_average", token_mean)):
        report = audit_rows(tmp_path / name, records(UNEVEN_GA, scalar, divisor_known=False))
        assert codes(report) == {"unknown_divisor"} and verdict(report) == "inconclusive", name
    finding = only(
        audit_rows(tmp_path / "w", records(UNEVEN_GA, token_mean, divisor_known=False)), Code.UNKNOWN_DIVISOR
    )
    assert finding.evidence["distortion_if_average"] == pytest.approx(1.0)
    assert finding.evidence["distortion_if_sum"] == pytest.approx(2.0)
    report = audit_rows(tmp_path / "local", records(UNEVEN_GA, local_mean, divisor_known=False))
    assert codes(report) == {"unknown_divisor", "local_mean"} and verdict(report) == "incorrect"


def test_a_stale_world_size_after_an_elastic_resize_is_an_error_naming_both(tmp_path: Path) -> None:
    before = records([[[2], [5], [1]], [[4], [3], [6]]], token_mean)  # W = 3, correct
    after = records([[[2], [7]], [[5], [1]], [[3], [3]]], lambda S, N, **_: 3 * S / N, step_offset=2)  # W = 2, stale 3
    report = audit_rows(tmp_path, before + after)
    finding = only(report, Code.WORLD_SIZE_MISMATCH)
    assert finding.severity == Severity.ERROR and (finding.steps.first, finding.steps.last) == (2, 4)
    assert finding.evidence["world_sizes"] == [3, 2] and "W=3" in finding.message and "W=2" in finding.message
    assert Code.WORLD_SIZE_CHANGED in {f.code for f in report.findings} and verdict(report) == "incorrect"


def test_a_near_miss_is_named_approximately(tmp_path: Path) -> None:
    counts = [[[40], [90]], [[70], [25]], [[55], [61]]]
    rows = records(counts, lambda S, n_r, **_: S / (n_r + 2))  # one extra label per row, 2 rows per rank
    finding = only(audit_rows(tmp_path, rows), Code.LOCAL_MEAN)
    assert finding.evidence["approximate"] is True and 0 < finding.evidence["approximation_error"] < 0.05
    assert "only approximately" in finding.message


def test_a_mean_per_microbatch_divided_by_m_reads_in_the_users_words(tmp_path: Path) -> None:
    finding = only(audit_rows(tmp_path, records(UNEVEN_GA, lambda S, n, M, **_: S / n / M)), Code.LOCAL_MEAN)
    assert "loss.mean() / gradient_accumulation_steps" in finding.message and "M=2" in finding.message


def test_a_rounded_logged_loss_is_not_a_mismatch(tmp_path: Path) -> None:
    rows = [
        dict(row, loss_sum=row["loss_sum"] / 12.3456789, backward_scalar=row["backward_scalar"] / 12.3456789)
        for row in records(UNEVEN, token_mean)
    ]  # losses near 0.18
    for row in rows:
        step_rows = [r for r in rows if r["step"] == row["step"]]
        truth = sum(r["loss_sum"] for r in step_rows) / sum(r["valid_tokens"] for r in step_rows)
        row["reported_loss"] = round(truth, 4)  # logged to 4 decimals, as transformers does
        assert row["reported_loss"] != truth
    report = audit_rows(tmp_path / "rounded", rows)
    assert report.findings == [] and verdict(report) == "correct"
    # Rounded or not, the mean of local means is still told apart when it differs by more than the rounding.
    for step in range(len(UNEVEN)):
        mine = [r for r in rows if r["step"] == step]
        local = sum(r["loss_sum"] / r["valid_tokens"] for r in mine) / len(mine)
        for row in mine:
            row["reported_loss"] = round(local, 4)
    finding = only(audit_rows(tmp_path / "local", rows), Code.REPORTED_LOSS_MISMATCH)
    assert "mean of per-rank means" in finding.message


def test_factors_that_are_no_plausible_world_size(tmp_path: Path) -> None:
    report = audit_rows(tmp_path, records(UNEVEN_GA, lambda S, N, W, **_: 1234.93 * W * S / N))
    assert codes(report) == {"scale_mismatch"} and verdict(report) == "incorrect"


def test_a_noisy_bf16_log_at_a_wide_rtol_is_one_finding_and_one_segment(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    counts = [[[int(rng.integers(1, 400))], [int(rng.integers(1, 400))]] for _ in range(30)]
    rows = records(counts, local_mean)
    for row in rows:  # b and S rounded to bfloat16's 8 bits of mantissa
        row["backward_scalar"] *= 1 + rng.uniform(-(2**-8), 2**-8)
    report = audit_rows(tmp_path, rows, rtol=1e-2)
    assert codes(report) == {"local_mean"} and only(report, Code.LOCAL_MEAN).steps.count == 30
    assert len(report.runs[0].segments) == 1


@pytest.mark.parametrize(("weights", "want"), [(token_mean, "correct"), (local_mean, "incorrect")])
def test_a_log_stored_in_float16_is_judged_at_float16_s_precision(tmp_path: Path, weights: Any, want: str) -> None:
    """S and b stored as float16 (a half tensor's .numpy() written by pandas or pyarrow) hold 11 significant bits,
    whatever precision_bits says or not: a right run is judged at that rounding (not at --rtol's 1e-4, where its
    rounding reads as unexplained weights), and a rank-local mean stays incorrect."""
    table = pa.Table.from_pylist(records(UNEVEN_GA, weights))
    for name in ("loss_sum", "backward_scalar"):
        table = table.set_column(table.column_names.index(name), name, table[name].cast(pa.float16()))
    (tmp_path / "run").mkdir()
    pq.write_table(table, tmp_path / "run" / "half.parquet")
    report = audit([tmp_path / "run"])
    assert verdict(report) == want and report.runs[0].precision_bits == 11, codes(report)
    assert codes(report) == (set() if want == "correct" else {"local_mean"})


def test_numbers_that_must_not_pass(tmp_path: Path) -> None:
    cases: dict[str, Any] = {
        "inf_grad_scale": lambda rows: rows[0].update(grad_scale=math.inf),
        "subnormal_divisor": lambda rows: rows[0].update(grad_divisor=5e-324),
        "nan_masked_weight": lambda rows: rows[0].update(masked_weight_abs_sum=math.nan),
    }
    for name, spoil in cases.items():
        rows = records(UNEVEN, token_mean)
        for row in rows:
            row.setdefault("grad_divisor", float(row["world_size"]))
            row.setdefault("masked_weight_abs_sum", 0.0)
        spoil(rows)
        report = audit_rows(tmp_path / name, rows)
        assert verdict(report) == "incorrect" and Code.NONFINITE_VALUES in {f.code for f in report.findings}, name


def test_records_without_a_usable_weight_are_not_correct(tmp_path: Path) -> None:
    rows = records(UNEVEN, token_mean)
    for row in rows:
        row.update(loss_sum=0.0, backward_scalar=0.0)  # S = 0 and no probe: c = 0/0
    report = audit_rows(tmp_path, rows)
    assert codes(report) == {"no_weights"} and verdict(report) == "inconclusive"
    assert only(report, Code.NO_WEIGHTS).evidence["steps_without_weight"] == 3


def test_a_long_run_with_a_constant_per_step_mistake_is_one_finding(tmp_path: Path) -> None:
    # 100,000 steps, 2 ranks; b = W·S/(N + 4): uniform in every step, q = N/(N+4) different in each.
    steps = 100_000
    rng = np.random.default_rng(1)
    counts = rng.integers(1, 512, size=(steps, 2))
    tokens = counts.sum(axis=1)
    folder = tmp_path / "long"
    folder.mkdir()
    for rank in range(2):
        n = counts[:, rank]
        loss = n * 2.3
        pq.write_table(
            pa.table(
                {
                    "step": pa.array(np.arange(steps), pa.int64()),
                    "micro": pa.array(np.zeros(steps), pa.int32()),
                    "rank": pa.array(np.full(steps, rank), pa.int32()),
                    "world_size": pa.array(np.full(steps, 2), pa.int32()),
                    "loss_sum": loss,
                    "valid_tokens": pa.array(n, pa.int64()),
                    "backward_scalar": 2 * loss / (tokens + 4),
                }
            ),
            folder / f"rank-{rank:05d}-000000.parquet",
        )
    report = audit([folder])
    (finding,) = report.findings
    assert finding.code == Code.SCALE_MISMATCH and finding.steps.count == steps
    low, high = finding.evidence["distortion_range"]
    assert low == pytest.approx(float((tokens / (tokens + 4)).min()))
    assert high == pytest.approx(float((tokens / (tokens + 4)).max()))


def test_the_gate_and_the_summary_read_one_weight_ratio(tmp_path: Path) -> None:
    """A rank-local mean recorded with a probe that saw the tokens of each record weighted unevenly (by 0.5× and
    2× the record's mean): the heaviest token over the lightest is 4× the records' mean ratio. The summary's max
    ratio and the finding's `weight_ratio` are that one ratio, so --min-ratio between the two ratios keeps the
    finding as severe as it was, as the ratio the summary shows says it must."""
    from tests.logs import UNEVEN_GA, local_mean, records, write_by_rank
    from tokaudit._auditing import audit

    rows = records(UNEVEN_GA, local_mean)
    for row in rows:
        mean = row["backward_scalar"] / row["loss_sum"]  # c = b/S, each valid token's mean weight
        row.update(
            token_weight_sum=mean * row["valid_tokens"], token_weight_min=0.5 * mean, token_weight_max=2.0 * mean
        )
    log = write_by_rank(tmp_path / "run", rows)
    report = audit([log])
    (finding,) = [f for f in report.findings if f.code.value == "local_mean"]
    (run,) = report.runs
    assert finding.evidence["weight_ratio"] == run.max_weight_ratio
    records_ratio = finding.evidence["heaviest"]["effective_weight"] / finding.evidence["lightest"]["effective_weight"]
    assert run.max_weight_ratio > 3.9 * records_ratio
    gated = audit([log], min_ratio=2 * records_ratio)
    # the gate leaves it as severe as it was (a warning, after the probe's own finding, which leads)
    assert [f.severity.value for f in gated.findings if f.code.value == "local_mean"] == ["warning"]
    assert [f.severity.value for f in report.findings if f.code.value == "local_mean"] == ["warning"]


def _bfloat16_loop(rng: np.random.Generator, **columns: Any) -> tuple[list[Any], list[dict[str, Any]]]:
    """A right loop in bfloat16 (8 steps, 4 ranks, 2 microbatches of 100 to 400 tokens): S summed in float32, b =
    S_bf16·W/N computed in bfloat16. Its counts and records."""
    import torch

    counts = [[[int(rng.integers(100, 400)) for _ in range(2)] for _ in range(4)] for _ in range(8)]
    rows = records(counts, token_mean, **columns)
    for row in rows:
        per_token = torch.tensor(rng.uniform(1.5, 3.0, size=row["valid_tokens"])).to(torch.bfloat16)
        tokens = sum(r["valid_tokens"] for r in rows if r["step"] == row["step"])
        row["loss_sum"] = float(per_token.float().sum())
        row["backward_scalar"] = float(per_token.sum() * row["world_size"] / tokens)  # rounded in bfloat16
    return counts, rows


def test_weights_within_two_bfloat16_roundings_are_neither_incorrect_nor_correct(tmp_path: Path) -> None:
    """A right loop in bfloat16 whose logger sums S in float32 while b = S_bf16·W/N is computed in bfloat16: each
    weight b/S rounds twice, and two records' weights may be 2⁻⁶ apart where the run is judged at 2⁻⁷ (it read
    incorrect, padded_denominator). A near miss, S/(n + 1) at n of 100 to 400, weighs its tokens as little apart:
    the logs cannot tell the two, and neither is called correct."""
    rng = np.random.default_rng(0)
    counts, rows = _bfloat16_loop(rng, precision_bits=8)
    report = audit_rows(tmp_path / "rounded", rows)
    assert verdict(report) == "inconclusive" and all(f.undecidable for f in report.findings), report.findings

    near = records(counts, lambda S, n, **_: S / (n + 1), precision_bits=8)
    assert verdict(audit_rows(tmp_path / "near", near)) != "correct"

    # each microbatch over its positions, T = 2n + 1, n of 100 or 101: weights within 1% of each other, but q = e·N
    # near 4, far beyond any rounding (it was cannot-tell too)
    alike = [[[100 + int(rng.integers(0, 2)) for _ in range(2)] for _ in range(4)] for _ in range(8)]
    padded = records(alike, lambda S, n, W, **_: W * S / (2 * n + 1), precision_bits=8)
    for row in padded:
        row["positions"] = 2 * row["valid_tokens"] + 1
    assert verdict(audit_rows(tmp_path / "padded", padded)) == "incorrect"


def test_backward_scalars_rounded_in_bfloat16_and_logged_as_python_numbers_read_as_bfloat16s(tmp_path: Path) -> None:
    """The right bfloat16 loop above, logged by a hand-written logger: b as a Python float (float64 in the file), no
    precision_bits. Every b holding 8 significant bits says where it was computed, so the weights two roundings apart
    are judged at bfloat16's as if the records said so (it read incorrect, unexplained_weighting). A near miss in
    float32, whose b holds more bits, is still incorrect."""
    rng = np.random.default_rng(1)
    counts, rows = _bfloat16_loop(rng)
    report = audit_rows(tmp_path / "rounded", rows)
    assert verdict(report) == "inconclusive" and all(f.undecidable for f in report.findings), report.findings

    near = records(counts, lambda S, N, W, **_: W * S / N * (1 + 0.006 * rng.random()))  # float32: weights 0.6% apart
    assert verdict(audit_rows(tmp_path / "near", near)) == "incorrect"
    # the bfloat16 loop, then the near miss in float32: its steps' b say nothing of bfloat16, and decide
    switched = rows + records(counts, lambda S, N, W, **_: W * S / N * (1 + 0.006 * rng.random()), step_offset=8)
    assert verdict(audit_rows(tmp_path / "switched", switched)) == "incorrect"
    # round numbers hold 8 bits too: integer losses whose N is one token short, 0.4% off, are never correct
    short = records([[[64], [193]]] * 4, lambda S, N, W, **_: W * S / (N - 1))
    short = [dict(row, loss_sum=float(row["valid_tokens"] * 2)) for row in short]
    short = [dict(row, backward_scalar=2 * row["loss_sum"] / 256) for row in short]
    assert verdict(audit_rows(tmp_path / "short", short)) == "inconclusive"
    # the bfloat16 loop launched again over an earlier float32 launch of the same steps: the copies left out say
    # nothing of the records kept
    for launch, logged in enumerate((records(counts, token_mean), rows)):
        path = write(tmp_path / "relaunched" / f"all-{launch}.parquet", logged)
        os.utime(path, ns=((1_700_000_000 + 60 * launch) * 1_000_000_000,) * 2)
    assert audit([tmp_path / "relaunched"]).runs[0].verdict == "inconclusive"


def test_a_logged_loss_stored_in_float16_is_compared_within_its_rounding(tmp_path: Path) -> None:
    """The token mean logged from a half tensor (a float16 column, or its values in a float64 one): off by up to
    2⁻¹¹ of itself, no mismatch (it read "differs beyond rounding; 1× the token mean"). The mean of local means,
    logged so, is still told apart."""
    rows = records(UNEVEN_GA, token_mean)
    for step in range(len(UNEVEN_GA)):
        mine = [r for r in rows if r["step"] == step]
        truth = sum(r["loss_sum"] for r in mine) / sum(r["valid_tokens"] for r in mine)
        local = np.mean(
            [
                sum(r["loss_sum"] for r in mine if r["rank"] == k)
                / sum(r["valid_tokens"] for r in mine if r["rank"] == k)
                for k in (0, 1)
            ]
        )
        for row in mine:
            row["reported_loss"], row["local"] = float(np.float16(truth)), float(np.float16(local))
    assert any(row["reported_loss"] != row["loss_sum"] for row in rows)
    for name, stored in (("half", pa.float16()), ("double", pa.float64())):
        table = pa.Table.from_pylist([{k: v for k, v in r.items() if k != "local"} for r in rows])
        table = table.set_column(
            table.column_names.index("reported_loss"), "reported_loss", table["reported_loss"].cast(stored)
        )
        (tmp_path / name).mkdir()
        pq.write_table(table, tmp_path / name / "log.parquet")
        report = audit([tmp_path / name])
        assert report.findings == [] and verdict(report) == "correct", (name, report.findings)
    local_rows = [dict(r, reported_loss=r["local"]) for r in rows]
    for row in local_rows:
        del row["local"]
    assert "reported_loss_mismatch" in codes(audit_rows(tmp_path / "local", local_rows))


def test_weights_all_zero_say_no_count_was_balanced(tmp_path: Path) -> None:
    """Every gradient multiplied by 0 (g = 0): each token weighs 0, which every denominator fits at α = 0. The run is
    incorrect (scale_mismatch), and no balanced_counts says the ranks held the same count where they did not."""
    report = audit_rows(tmp_path / "zero", records(UNEVEN, token_mean, grad_scale=0.0))
    assert verdict(report) == "incorrect"
    assert [f.code.value for f in report.findings] == ["scale_mismatch"], report.findings


def test_a_term_only_some_ranks_hold_weighs_right_where_its_missing_ranks_recorded_the_main_loss(
    tmp_path: Path,
) -> None:
    """An auxiliary loss of data only rank 0 has (image tokens in its batch alone), each token 1/N of the term's own
    tokens: rank 1 recorded the main loss at every step, so it ran backward and the collectives. Said (info), not an
    error; the same term normalized by a count that holds tokens no record has stays missing_rank, an error."""
    main = records(UNEVEN_GA, token_mean, term="0", sync=None)
    aux_counts = [[[3, 4]], [[2, 5]], [[6, 1]]]  # rank 0's alone, W = 2: N_aux = its own tokens
    aux = records(aux_counts, token_mean, world_size=2, term="aux")
    report = audit_rows(tmp_path / "ok", main + aux)
    finding = only(report, Code.MISSING_RANK)
    assert verdict(report) == "correct" and finding.severity == Severity.INFO
    assert finding.term == "aux" and finding.evidence["missing_ranks"] == [1]
    assert "recorded the main loss" in finding.message and "find_unused_parameters" in finding.fix

    # N_aux + 4: the weights there are 7/11, 7/11, 7/11 of 1/N, no token of rank 1 makes them up
    padded = records(aux_counts, lambda S, N, W, **_: W * S / (N + 4), world_size=2, term="aux")
    report = audit_rows(tmp_path / "padded", main + padded)
    assert only(report, Code.MISSING_RANK).severity == Severity.ERROR and verdict(report) == "incorrect"

    # rank 1 records neither term at step 1: that step is the main term's missing rank, an error
    gone = [r for r in main if not (r["step"] == 1 and r["rank"] == 1)]
    report = audit_rows(tmp_path / "gone", gone + aux)
    assert {f.severity for f in report.findings if f.code == Code.MISSING_RANK} >= {Severity.ERROR}
    assert verdict(report) == "incorrect"


def test_one_rank_that_says_it_never_synchronized_stepped_on_the_whole_gradient(tmp_path: Path) -> None:
    """W = 1: no collective, so the local gradient is the update's. Records of sync false on every microbatch (a
    single process's loop, no DDP) are no missing_sync; a local mean there is still one."""
    counts = [[[5, 17, 3]], [[2, 6, 9]], [[8, 4, 1]]]
    report = audit_rows(tmp_path / "ok", records(counts, token_mean, sync=False))
    assert report.findings == [] and verdict(report) == "correct"
    local = records(counts, lambda S, n, M, **_: S / n / M, sync=False)
    report = audit_rows(tmp_path / "local", local)
    assert Code.MISSING_SYNC not in {f.code for f in report.findings} and verdict(report) == "incorrect"


def test_records_repeated_in_a_log_of_some_ranks_alone_are_said_beside_the_ranks_not_recorded(tmp_path: Path) -> None:
    """Only rank 0's file of a run of W = 2, its records written twice with other values: nothing about the
    normalization is judged (ranks_not_recorded), and the copies are still said (they were left out in silence)."""
    rows = [r for r in records(UNEVEN_GA, token_mean) if r["rank"] == 0]
    report = audit_rows(tmp_path, rows + [dict(r, loss_sum=r["loss_sum"] * 2) for r in rows])
    assert codes(report) == {"ranks_not_recorded", "duplicate_records"} and verdict(report) == "inconclusive"
    assert only(report, Code.DUPLICATE_RECORDS).evidence["dropped_records"] == len(rows)


def test_a_last_microbatch_synchronized_by_another_term_s_own_backward_is_inconclusive_not_missing_sync(
    tmp_path: Path,
) -> None:
    """Each microbatch runs the main loss's backward and then the auxiliary loss's, each of its own, all under
    no_sync() but the last microbatch's auxiliary one: that all-reduce carries what the main loss accumulated (DDP
    reduces at the first synchronized backward), but had it run first, the main loss's last gradients stayed local.
    The step table cannot tell: a warning that says so (it read missing_sync, an error). Where no record of the last
    microbatch synchronized, it is still missing_sync."""
    main = [dict(r, sync=False) for r in records(UNEVEN_GA, token_mean, term="0")]
    aux = [
        dict(r, term="aux", loss_sum=r["loss_sum"] / 3, backward_scalar=r["backward_scalar"] / 3, sync=r["micro"] == 1)
        for r in records(UNEVEN_GA, token_mean)
    ]
    report = audit_rows(tmp_path / "separate", main + aux)
    finding = only(report, Code.MISSING_SYNC)
    assert verdict(report) == "inconclusive" and finding.severity == Severity.WARNING and finding.undecidable
    assert finding.evidence["synchronized_by_another_term"] is True and "cannot tell which ran last" in finding.message

    unsynced = [dict(r, sync=False) for r in aux]
    report = audit_rows(tmp_path / "never", main + unsynced)
    assert only(report, Code.MISSING_SYNC).severity == Severity.ERROR and verdict(report) == "incorrect"


def test_a_record_of_no_valid_token_in_bfloat16_leaves_a_float32_run_judged_at_float32(tmp_path: Path) -> None:
    """Every record computed in float32 (24 bits) but one of no valid token that says 8: the run divides by N + 2, q =
    N/(N + 2) ≈ 0.9967 at N ≈ 600, off by far more than float32 rounds and less than bfloat16's two roundings of 2⁻⁷.
    The empty record weighs nothing: it does not make the tolerance bfloat16's (it read correct)."""
    counts = [[[150, 140], [160, 0]], [[155, 145], [150, 0]], [[148, 152], [151, 0]]]
    rows = records(counts, lambda S, N, W, **_: W * S / (N + 2), precision_bits=24)
    rows = [dict(r, precision_bits=8) if r["valid_tokens"] == 0 else r for r in rows]
    report = audit_rows(tmp_path, rows)
    assert verdict(report) == "incorrect" and report.runs[0].precision_bits == 24, codes(report)


@pytest.mark.parametrize("world, kept", [(128, 100), (8, 6)])
def test_a_run_given_with_the_files_of_its_first_ranks_alone_is_inconclusive_whatever_w(
    tmp_path: Path, world: int, kept: int
) -> None:
    """A correct run of W = 128 (or 8) whose files of ranks 100–127 (6–7) were not given: N lacks their tokens in every
    step, so nothing about the normalization is judged (past 64 ranks it read missing_rank, an error)."""
    counts = [[[3 + (rank + step) % 5] for rank in range(world)] for step in range(3)]
    rows = [r for r in records(counts, token_mean) if r["rank"] < kept]
    report = audit_rows(tmp_path, rows)
    finding = only(report, Code.RANKS_NOT_RECORDED)
    assert verdict(report) == "inconclusive" and codes(report) == {"ranks_not_recorded"}
    assert finding.evidence["ranks_not_recorded"] == list(range(kept, world))


def test_an_elastic_run_whose_larger_world_s_last_ranks_were_not_given_is_inconclusive(tmp_path: Path) -> None:
    """W = 8 for steps 0–2, then 4: the files of ranks 6 and 7, which only the W = 8 steps had, were not given. Those
    steps' N lacks their tokens: ranks not recorded at W = 8, inconclusive (it read missing_rank, an error: W was taken
    as the least any record says, 4)."""
    before = records([[[2 + (r + s) % 3] for r in range(8)] for s in range(3)], token_mean)
    after = records([[[4 + r] for r in range(4)] for _ in range(3)], token_mean, step_offset=3)
    report = audit_rows(tmp_path, [r for r in before if r["rank"] < 6] + after)
    assert verdict(report) == "inconclusive" and Code.MISSING_RANK not in {f.code for f in report.findings}
    assert only(report, Code.RANKS_NOT_RECORDED).evidence == {
        "world_size": 8,
        "ranks_not_recorded": [6, 7],
        "group": "0",
    }


def test_a_log_of_some_ranks_alone_says_no_weight_ratio_and_its_logged_loss_unjudged(tmp_path: Path) -> None:
    """Rank 0's file alone of a run whose logged loss is the mean of local means: no step's N nor ΣS/N is known, so
    the run says no weight ratio (null: a rank's own records weigh alike, and read 1, as a correct run) and its logged
    loss `unjudged` (it read `matches`)."""
    rows = records(UNEVEN_GA, local_mean)
    for row in rows:  # the mean over ranks of S_r/n_r, on every record of the step
        ranks = [[r for r in rows if r["step"] == row["step"] and r["rank"] == k] for k in (0, 1)]
        means = [sum(r["loss_sum"] for r in mine) / sum(r["valid_tokens"] for r in mine) for mine in ranks]
        row["reported_loss"] = sum(means) / 2
    report = audit_rows(tmp_path, [r for r in rows if r["rank"] == 0])
    (run,) = json.loads(render_json(report))["runs"]
    assert run["verdict"] == "inconclusive" and run["reporting"] == "unjudged" and run["max_weight_ratio"] is None
