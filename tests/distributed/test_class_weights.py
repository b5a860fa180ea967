"""Class-weighted cross-entropy (`F.cross_entropy(weight=…)`) under `capture_cross_entropy` in real DDP on 2 gloo
processes, 2 microbatches a rank. The float64 reference is the weighted token mean over every rank and microbatch,
Σ w_y·ℓ / Σ w_y: the loop that divides by the global Σw matches it and must never read `incorrect` (its tokens weigh
N/Σw of 1/N, which no record can show right: `inconclusive`, saying why); each rank's own weighted mean averaged by
DDP does not match it and stays `incorrect`, as does a loss of weights all 1 that leaves W out (half the mean). Every
class weighing 2 is the plain token mean, its losses doubled: `correct` (it read as W applied twice)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scenarios.class_weights import COUNTS, job, reference_gradient, variant_weights
from scenarios.harness import run_ddp_each
from tokaudit._auditing import audit

pytestmark = pytest.mark.distributed


def test_a_class_weighted_token_mean_is_never_incorrect_and_a_local_one_is(tmp_path: Path) -> None:
    variants = ["global", "local", "ones_without_w", "every_class_two"]
    for variant, ranks in zip(variants, run_ddp_each(job, 2, variants, str(tmp_path))):
        matches = []
        for step in range(len(COUNTS)):
            record = ranks[0]["history"][step]
            want = reference_gradient(record["before"], step, variant_weights(variant))
            matches.append(all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(record["grads"], want)))
        report = audit([tmp_path / f"class_weights_{variant}"])
        verdict = report.runs[0].verdict
        if variant == "every_class_two":  # every class weighing 2 is the plain token mean: recorded as one
            assert all(matches) and verdict == "correct", report.findings
        elif variant == "global":
            assert all(matches)
            assert verdict == "inconclusive", report.findings
            assert all(f.undecidable for f in report.findings if f.severity.value != "info"), report.findings
            assert any("cross_entropy(weight=...)" in f.message for f in report.findings), report.findings
        else:
            assert not any(matches)
            assert verdict == "incorrect", report.findings
