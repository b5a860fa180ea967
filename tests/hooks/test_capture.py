"""capture_cross_entropy returns exactly what cross_entropy returns, and records what backward did."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from tokaudit.hooks import Recorder

C = 5


def inputs(shape: str, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    if shape == "unbatched":
        logits, target = torch.randn(C, generator=generator), torch.tensor(2)
    elif shape == "probabilities":
        logits = torch.randn(6, C, generator=generator)
        target = torch.softmax(torch.randn(6, C, generator=generator), dim=1)
    else:
        batch = (6,) if shape == "2d" else (3, 4)
        logits = torch.randn(batch[0], C, *batch[1:], generator=generator)
        target = torch.randint(0, C, batch, generator=generator)
        target.view(-1)[::3] = ignore_index
    return logits.requires_grad_(), target


GRID = list(
    itertools.product(
        ["mean", "sum", "none"], [-100, 3], [0.0, 0.1], [False, True], ["2d", "3d", "unbatched", "probabilities"]
    )
)


@pytest.mark.parametrize("reduction, ignore_index, smoothing, weighted, shape", GRID)
def test_capture_is_bit_identical_and_measures_the_weights(
    tmp_path: Path, reduction: str, ignore_index: int, smoothing: float, weighted: bool, shape: str
) -> None:
    weight = torch.linspace(0.5, 2.0, C) if weighted else None

    def run(capture: bool, module: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logits, target = inputs(shape, ignore_index)
        kwargs: dict[str, Any] = {"weight": weight, "reduction": reduction, "label_smoothing": smoothing}
        if not target.is_floating_point():
            kwargs["ignore_index"] = ignore_index
        with Recorder(tmp_path, run_id=f"{capture}-{module}") as rec:
            with rec.capture_cross_entropy() if capture else _null():
                loss_fn = (
                    torch.nn.CrossEntropyLoss(**kwargs) if module else (lambda x, y: F.cross_entropy(x, y, **kwargs))
                )
                out = loss_fn(logits, target)
                scale = torch.linspace(1, 2, out.numel()).view_as(out) if out.dim() else torch.tensor(3.0)
                (out * scale).sum().backward()
        assert logits.grad is not None
        return out.detach(), logits.grad

    for module in (False, True):
        plain_out, plain_grad = run(False, module)
        out, grad = run(True, module)
        assert torch.equal(plain_out, out) and torch.equal(plain_grad, grad)
        (row,) = pq.read_table(next((tmp_path / f"True-{module}").glob("*.parquet"))).to_pylist()
        assert row["backward_scalar"] is None
        logits, target = inputs(shape, ignore_index)
        reference_kwargs = {"weight": weight, "label_smoothing": smoothing}
        if not target.is_floating_point():
            reference_kwargs["ignore_index"] = ignore_index
        per_token = F.cross_entropy(logits, target, reduction="none", **reference_kwargs)
        valid = torch.ones_like(per_token, dtype=torch.bool) if target.is_floating_point() else target != ignore_index
        assert row["valid_tokens"] == int(valid.sum()) and row["positions"] == valid.numel()
        assert row["loss_sum"] == pytest.approx(float(per_token.detach().sum()), rel=1e-5)
        # ∂b/∂ℓᵢ by autograd, through the same reduction and scale as the run.
        per_token = per_token.detach().requires_grad_()
        if reduction == "none":
            reduced = per_token
        elif reduction == "sum":  # the reductions leave ignored positions out
            reduced = (per_token * valid).sum()
        elif target.is_floating_point():
            reduced = per_token.sum() / valid.numel()
        else:
            denominator = (weight[target.masked_fill(~valid, 0)] * valid).sum() if weight is not None else valid.sum()
            reduced = (per_token * valid).sum() / denominator
        scale = torch.linspace(1, 2, reduced.numel()).view_as(reduced) if reduced.dim() else torch.tensor(3.0)
        (reduced * scale).sum().backward()
        expected = per_token.grad[valid]
        assert row["token_weight_sum"] == pytest.approx(float(expected.sum()), rel=1e-5)
        if valid.any():
            assert row["token_weight_min"] == pytest.approx(float(expected.min()), rel=1e-5)
            assert row["token_weight_max"] == pytest.approx(float(expected.max()), rel=1e-5)
        # b = Σ scaleᵢ·ℓᵢ weighs ignored positions too, but their loss is an exact 0 (no gradient):
        # only masked positions whose loss is not 0 count.
        live = ~valid & (per_token.detach() != 0)
        assert not live.any()
        masked = per_token.grad[live].abs().sum()
        assert row["masked_weight_abs_sum"] == pytest.approx(float(masked), rel=1e-5, abs=1e-12)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_calls_without_grad_and_unused_losses_are_not_records(tmp_path: Path) -> None:
    logits, target = inputs("2d", -100)
    model_step = torch.optim.SGD([logits], lr=0.1)
    with Recorder(tmp_path, run_id="eval", optimizer=model_step) as rec, rec.capture_cross_entropy():
        with torch.no_grad():
            F.cross_entropy(logits, target)  # evaluation
        F.cross_entropy(logits, target)  # computed, never backpropagated
        F.cross_entropy(logits, target).backward()
        model_step.step()
    assert F.cross_entropy.__name__ == "cross_entropy", "the original is restored"
    rows = pq.read_table(next((tmp_path / "eval").glob("*.parquet"))).to_pylist()
    assert len(rows) == 1 and rows[0]["token_weight_sum"] == pytest.approx(1.0)


def test_start_capture_lasts_until_close(tmp_path: Path) -> None:
    original = F.cross_entropy
    rec = Recorder(tmp_path, run_id="started")
    rec.start_capture()
    assert F.cross_entropy is not original
    logits, target = inputs("2d", -100)
    F.cross_entropy(logits, target).backward()
    rec.close()
    assert F.cross_entropy is original
    assert len(pq.read_table(next((tmp_path / "started").glob("*.parquet")))) == 1


IN_PLACE = {
    "*=": lambda loss: loss.__imul__(4.0),
    "/=": lambda loss: loss.__itruediv__(2.0),
    "+=": lambda loss: loss.__iadd__(1.0),
    "mul_": lambda loss: loss.mul_(3.0),
}
WEIGHT_FACTOR = {"*=": 4.0, "/=": 0.5, "+=": 1.0, "mul_": 3.0}


@pytest.mark.parametrize("operation", sorted(IN_PLACE))
@pytest.mark.parametrize("path", ["captured mean", "captured none", "probe"])
def test_in_place_operations_after_the_probe_train_as_without_it(tmp_path: Path, operation: str, path: str) -> None:
    """A trainer's `loss *= k` after the probe (HF Trainer does it) must neither raise nor change the
    gradient; the probe then measures the weight k·∂loss/∂ℓᵢ that backward really gave."""

    def run(recording: bool) -> tuple[torch.Tensor, Path | None]:
        logits, target = inputs("3d", -100)
        if not recording:
            loss = F.cross_entropy(logits, target, reduction="none" if path != "captured mean" else "mean")
            IN_PLACE[operation](loss)
            loss.sum().backward()
            assert logits.grad is not None
            return logits.grad, None
        with Recorder(tmp_path, run_id=path.replace(" ", "_")) as rec:
            if path == "probe":
                per_token = F.cross_entropy(logits, target, reduction="none")
                loss = rec.probe(per_token, target != -100)
                rec.record(loss_sum=per_token.detach().sum(), valid_tokens=(target != -100).sum(), backward_scalar=None)
            else:
                with rec.capture_cross_entropy():
                    loss = F.cross_entropy(logits, target, reduction="none" if path == "captured none" else "mean")
            IN_PLACE[operation](loss)
            loss.sum().backward()
        assert logits.grad is not None
        return logits.grad, tmp_path / path.replace(" ", "_")

    plain_grad, _ = run(False)
    grad, folder = run(True)
    assert torch.equal(plain_grad, grad)
    assert folder is not None
    (row,) = pq.read_table(next(folder.glob("*.parquet"))).to_pylist()
    _, target = inputs("3d", -100)
    n = int((target != -100).sum())
    per_token_weight = WEIGHT_FACTOR[operation] / (n if path == "captured mean" else 1)
    assert row["valid_tokens"] == n
    assert row["token_weight_min"] == pytest.approx(per_token_weight)
    assert row["token_weight_max"] == pytest.approx(per_token_weight)
    assert row["token_weight_sum"] == pytest.approx(per_token_weight * n)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("fill", [1.0, 2.0, None])
def test_class_weights_are_said_in_the_footer_and_one_weight_for_every_class_is_the_plain_mean(
    tmp_path: Path, reduction: str, fill: float | None
) -> None:
    """weight= of one value c for every class (2.0) is the unweighted loss times c: recorded as it, S = Σℓ' over
    the unweighted per-token losses and each token's ∂b/∂ℓ', so the audit judges the plain token mean; weights that
    differ by class (None here: linspace) say `class_weights` in the footer; ones say nothing. The loss and its
    gradient stay those of the call, to the bit."""
    weight = torch.linspace(0.5, 2.0, C) if fill is None else torch.full((C,), fill)
    logits, target = inputs("2d", -100)
    with Recorder(tmp_path, run_id="run") as rec, rec.capture_cross_entropy():
        out = F.cross_entropy(logits, target, weight=weight, reduction=reduction)
        (3.0 * out).backward()
    shard = next((tmp_path / "run").glob("*.parquet"))
    (row,) = pq.read_table(shard).to_pylist()
    provenance = pq.read_metadata(shard).metadata[b"tokaudit.provenance"].decode()
    assert ('"class_weights": true' in provenance) == (fill is None)
    if fill is None:
        return
    plain = F.cross_entropy(logits.detach(), target, reduction="none")  # ℓ', the unweighted per-token losses
    valid = target != -100
    assert row["loss_sum"] == pytest.approx(float(plain[valid].sum()), rel=1e-6)
    # b = 3·out: of the mean, 3/n each (Σcℓ'/(c·n)); of the sum, 3·c each
    each = 3.0 / int(valid.sum()) if reduction == "mean" else 3.0 * fill
    assert row["token_weight_sum"] == pytest.approx(each * int(valid.sum()), rel=1e-6)
    assert row["token_weight_min"] == pytest.approx(each, rel=1e-6) and row["token_weight_max"] == pytest.approx(
        each, rel=1e-6
    )
