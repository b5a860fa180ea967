"""Recorder in one process: a GradScaler's scale divided out and its skipped updates marked, skipped
updates found from zero_grad, loss terms told from chunks, and the fix helper in low precision."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tokaudit
from tests.hooks.syncs import count_host_syncs
from tests.logs import read_rows
from tokaudit.hooks import Recorder, token_mean_loss
from tokaudit.hooks._terms import Footprint


def amp_loop(
    rec: Recorder | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    overflow_step: int,
    steps: int = 4,
    prescaled: bool = False,
) -> list[float]:
    """W = 1, one microbatch per step, b = S/N; step `overflow_step` gets an infinite gradient."""
    scalars = []
    for step in range(steps):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        labels = torch.tensor([0, 1, 2, -100, 1, -100])
        logits = model(x)
        if step == overflow_step:
            logits.register_hook(lambda grad: grad * math.inf)
        per_token = F.cross_entropy(logits, labels, reduction="none")
        valid = labels != -100
        if rec is not None:
            per_token = rec.probe(per_token, valid)
        loss_sum = (per_token * valid).sum()
        scalar = loss_sum / valid.sum()
        scaled = scaler.scale(scalar) if prescaled else None
        if rec is not None:
            rec.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=scaled if prescaled else scalar)
        (scaled if prescaled else scaler.scale(scalar)).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scalars.append(float(scalar.detach()))
    return scalars


@pytest.mark.parametrize("prescaled", [False, True])
def test_a_grad_scaler_is_divided_out_and_its_skipped_update_marked(tmp_path: Path, prescaled: bool) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with Recorder(tmp_path, run_id="amp", optimizer=optimizer, scaler=scaler) as rec:
        scalars = amp_loop(rec, model, optimizer, scaler, overflow_step=1, prescaled=prescaled)
    rows = read_rows(tmp_path / "amp")
    assert [r["step"] for r in rows] == [0, 1, 2, 3], "the skipped update is its own step"
    # update() reads found_inf of every update: False where the optimizer stepped
    assert [r["skipped"] for r in rows] == [False, True, False, False]
    scales = [2.0**10, 2.0**10, 2.0**9, 2.0**9]
    assert [r["grad_scale"] for r in rows] == [1 / s for s in scales]
    # b in the log is what backward ran on, scale·loss, whether the user passed loss or scale(loss).
    for row, scalar, scale in zip(rows, scalars, scales, strict=True):
        assert row["backward_scalar"] == pytest.approx(scalar * scale, rel=1e-6)
        assert row["token_weight_sum"] / row["valid_tokens"] * row["grad_scale"] == pytest.approx(1 / 4, rel=1e-6)
    assert scaler.scale.__func__ is torch.amp.GradScaler.scale, "the scaler gets its own methods back"


def test_a_fused_optimizer_steps_through_an_overflow_and_found_inf_marks_it(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    except (RuntimeError, ValueError) as error:
        pytest.skip(f"no fused SGD on this device: {error}")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    hooked = []
    optimizer.register_step_post_hook(lambda *_: hooked.append(1))
    with Recorder(tmp_path, run_id="fused", optimizer=optimizer, scaler=scaler) as rec:
        amp_loop(rec, model, optimizer, scaler, overflow_step=2)
    rows = read_rows(tmp_path / "fused")
    assert len(hooked) == 4, "the step hook fired on the skipped update too"
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["skipped"] for r in rows] == [False, False, True, False]


def test_an_untold_scaler_shows_as_a_loss_scale(tmp_path: Path) -> None:
    from tokaudit._auditing import audit

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with Recorder(tmp_path, run_id="untold", optimizer=optimizer) as rec:
        amp_loop(rec, model, optimizer, scaler, overflow_step=1)
    rows = read_rows(tmp_path / "untold")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[1]["skipped"] is True  # found from zero_grad
    report = audit([tmp_path / "untold"])
    assert {f.code.value for f in report.findings} == {"loss_scale"} and report.runs[0].verdict == "inconclusive"


def test_recording_under_a_scaler_adds_no_host_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_host_syncs(monkeypatch)

    def syncs(record: bool) -> int:
        calls.clear()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        rec = Recorder(tmp_path, run_id=f"sync{record}", optimizer=optimizer, scaler=scaler) if record else None
        for step in range(3):
            x = torch.randn(6, 4)
            labels = torch.tensor([0, 1, 2, -100, 1, -100])
            per_token = F.cross_entropy(model(x), labels, reduction="none")
            if rec is not None:
                per_token = rec.probe(per_token, labels != -100)
            scalar = per_token.sum() / 4
            if rec is not None:
                rec.record(loss_sum=per_token.sum(), valid_tokens=(labels != -100).sum(), backward_scalar=scalar)
            scaler.scale(scalar).backward()
            scaler.step(optimizer)  # GradScaler itself reads found_inf on the host
            scaler.update()
            optimizer.zero_grad()
        count = len(calls)
        if rec is not None:
            monkeypatch.undo()
            rec.close()
        return count

    plain = syncs(False)
    assert syncs(True) == plain, "the recorder added host syncs to a GradScaler loop"


def test_zero_grad_ends_an_update_the_optimizer_skipped(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, run_id="guard", optimizer=optimizer) as rec:
        for step in range(4):
            for micro in range(2):
                scalar = model(torch.ones(1, 2)).sum()
                rec.record(loss_sum=1.0, valid_tokens=2, backward_scalar=scalar)
                scalar.backward()
            if step != 1:  # an inf/NaN guard skips step 1
                optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                rec.end_step(skipped=True)  # said by hand as well: no second boundary
    rows = read_rows(tmp_path / "guard")
    assert [(r["step"], r["micro"]) for r in rows] == [(s, m) for s in range(4) for m in range(2)]
    # the updates the watched optimizer stepped are said applied (False), the guard's skipped (True)
    assert [r["skipped"] for r in rows] == [False, False, True, True, False, False, False, False]


def test_a_skipped_update_cleared_through_the_model_is_closed_as_skipped(tmp_path: Path) -> None:
    """An inf/NaN guard skips update 1 and clears the gradients with model.zero_grad(), not the optimizer's: with the
    model given, the update is closed as skipped, not merged into the next."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, run_id="guard", model=model, optimizer=optimizer) as rec:
        for step in range(3):
            for _ in range(2):
                scalar = model(torch.ones(1, 2)).sum()
                rec.record(loss_sum=1.0, valid_tokens=2, backward_scalar=scalar)
                scalar.backward()
            if step != 1:
                optimizer.step()
            model.zero_grad()
    rows = read_rows(tmp_path / "guard")
    assert [(r["step"], r["micro"], r["skipped"]) for r in rows] == [(s, m, s == 1) for s in range(3) for m in range(2)]


@pytest.mark.parametrize("clears", ["model", "optimizer"])
def test_gradients_cleared_between_a_record_and_its_backward_close_no_update(tmp_path: Path, clears: str) -> None:
    """PyTorch's tutorials clear the gradients right before backward: `record(...)`, then `zero_grad()`, then
    `backward()` and `step()`. The record's backward has not run when they are cleared: no update is closed there,
    each is applied (skipped false), and a NaN the optimizer applies stays a non-finite value of an applied update."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, run_id=clears, model=model, optimizer=optimizer) as rec:
        for step in range(3):
            scalar = model(torch.ones(1, 2)).sum() * (math.nan if step == 1 else 1.0)
            rec.record(loss_sum=scalar, valid_tokens=1, backward_scalar=scalar)
            (model if clears == "model" else optimizer).zero_grad()
            scalar.backward()
            optimizer.step()
    rows = read_rows(tmp_path / clears)
    assert [(r["step"], r["micro"], r["skipped"]) for r in rows] == [(s, 0, False) for s in range(3)]
    report = tokaudit.audit([tmp_path / clears])
    assert report.verdicts == {clears: "incorrect"} and "nonfinite_values" in {f.code.value for f in report.findings}


@pytest.mark.parametrize("recorded", ["tensor", "no_grad", "float"])
def test_a_guard_s_skip_is_closed_whether_the_record_comes_before_or_after_backward(
    tmp_path: Path, recorded: str
) -> None:
    """b recorded after backward (hooked too late to be seen in it), under no_grad after backward, or as a Python
    number before backward: a guard that skips update 2's optimizer step and clears the gradients closes that update
    as skipped (a backward reached the optimizer's parameters in it), and the applied updates are said applied."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, run_id=recorded, optimizer=optimizer) as rec:
        for step in range(4):
            scalar = model(torch.ones(1, 2)).sum()
            if recorded == "float":
                rec.record(loss_sum=1.0, valid_tokens=2, backward_scalar=float(scalar.detach()))
            scalar.backward()
            if recorded == "tensor":
                rec.record(loss_sum=scalar, valid_tokens=2, backward_scalar=scalar)
            elif recorded == "no_grad":
                with torch.no_grad():
                    rec.record(loss_sum=scalar.detach(), valid_tokens=2, backward_scalar=scalar.detach())
            if step != 2:
                optimizer.step()
            optimizer.zero_grad()
    rows = read_rows(tmp_path / recorded)
    assert [(r["step"], r["micro"], r["skipped"]) for r in rows] == [(s, 0, s == 2) for s in range(4)]


def test_a_skip_whose_backward_missed_the_counted_parameters_and_a_step_on_cleared_gradients_stay_skipped(
    tmp_path: Path,
) -> None:
    """The backwards are counted on the optimizer's first and last parameters. Update 1's backward reaches neither
    (a head used on some batches only), and its guard skips the step: its record was seen in backward, so it is still
    closed as skipped. Update 3's guard clears the gradients and calls step() anyway: a step on cleared gradients
    applies nothing, and the update stays skipped."""
    first, middle, last = (torch.nn.Parameter(torch.ones(1)) for _ in range(3))
    optimizer = torch.optim.SGD([first, middle, last], lr=0.1)
    with Recorder(tmp_path, run_id="skips", optimizer=optimizer) as rec:
        for step in range(5):
            scalar = (middle * 2).sum() if step == 1 else (first + middle + last).sum()
            rec.record(loss_sum=scalar, valid_tokens=2, backward_scalar=scalar)
            scalar.backward()
            if step not in (1, 3):
                optimizer.step()
            optimizer.zero_grad()
            if step == 3:
                optimizer.step()  # nothing to apply: every gradient was cleared
    rows = read_rows(tmp_path / "skips")
    assert [(r["step"], r["micro"], r["skipped"]) for r in rows] == [(s, 0, s in (1, 3)) for s in range(5)]


def test_gradients_cleared_before_each_backward_of_a_number_leave_every_update_applied(tmp_path: Path) -> None:
    """A tutorial's order with b recorded as a Python number: `record(b.item())`, `zero_grad()`, `backward()`,
    `step()`. Every update was applied, from the first (no backward counted yet) on."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, run_id="numbers", optimizer=optimizer) as rec:
        for _ in range(3):
            scalar = model(torch.ones(1, 2)).sum()
            rec.record(loss_sum=1.0, valid_tokens=2, backward_scalar=float(scalar.detach()))
            optimizer.zero_grad()
            scalar.backward()
            optimizer.step()
    assert [(r["step"], r["skipped"]) for r in read_rows(tmp_path / "numbers")] == [(s, False) for s in range(3)]


def test_each_probe_goes_to_the_record_of_its_loss_term_block(tmp_path: Path) -> None:
    """docs/recording.md: probes inside `loss_term(name)` belong to that term. Both terms probed first, each in its
    block, then recorded, each in its block: each record carries its own term's weights (Σ∂b/∂ℓ = n/N of its own N),
    and the two token means are correct. A probe outside any block still goes to the next record."""
    weight = torch.ones(4, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    masks = [  # per microbatch: (main's valid tokens, aux's); N = 4 and N_aux = 3 over the update
        (torch.tensor([True, True, True, False]), torch.tensor([True, False, False, False])),
        (torch.tensor([True, False, False, False]), torch.tensor([True, True, False, False])),
    ]
    with Recorder(tmp_path, run_id="terms", optimizer=optimizer) as rec:
        for _ in range(2):
            for main_valid, aux_valid in masks:
                per_token = weight * torch.arange(1.0, 5.0)
                with rec.loss_term("main"):
                    main = rec.probe(per_token, main_valid)
                with rec.loss_term("aux"):
                    aux = rec.probe(per_token * 2, aux_valid)
                main_sum, aux_sum = (main * main_valid).sum(), (aux * aux_valid).sum()
                scalars = token_mean_loss(main_sum, 4), token_mean_loss(aux_sum, 3)
                with rec.loss_term("main"):
                    rec.record(loss_sum=main_sum, valid_tokens=main_valid.sum(), backward_scalar=scalars[0])
                with rec.loss_term("aux"):
                    rec.record(loss_sum=aux_sum, valid_tokens=aux_valid.sum(), backward_scalar=scalars[1])
                (scalars[0] + scalars[1]).backward()
            optimizer.step()
            optimizer.zero_grad()
        plain = rec.probe(weight * 1.0, torch.tensor([True, True, False, False]))
        rec.record(loss_sum=plain[:2].sum(), valid_tokens=2, backward_scalar=plain[:2].sum() / 2, term="late")
        (plain[:2].sum() / 2).backward()
        optimizer.step()
    rows = read_rows(tmp_path / "terms")
    weights = {(r["step"], r["micro"], r["term"]): r["token_weight_sum"] for r in rows}
    assert {key: pytest.approx(value) for key, value in weights.items()} == {
        **{(s, m, "main"): n / 4 for s in (0, 1) for m, n in ((0, 3), (1, 1))},
        **{(s, m, "aux"): n / 3 for s in (0, 1) for m, n in ((0, 1), (1, 2))},
        (2, 0, "late"): 1.0,
    }
    assert tokaudit.audit([tmp_path / "terms"]).verdicts == {"terms": "correct"}


def test_a_capture_before_zero_grad_belongs_to_the_next_update(tmp_path: Path) -> None:
    # Lightning clears gradients after the first microbatch's forward, before its backward.
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.tensor([0, 1, 2, -100])
    with Recorder(tmp_path, run_id="order", optimizer=optimizer) as rec, rec.capture_cross_entropy():
        for step in range(3):
            loss = F.cross_entropy(model(torch.randn(4, 4)), labels)
            optimizer.zero_grad()
            loss.backward()
            if step != 1:
                optimizer.step()
        rec.report_loss(0.75, step=2)  # the record moved to update 2 by its zero_grad is found there
    rows = read_rows(tmp_path / "order")
    assert [(r["step"], r["micro"], r["skipped"]) for r in rows] == [(0, 0, False), (1, 0, True), (2, 0, False)]
    assert [r["reported_loss"] for r in rows] == [None, None, 0.75]


def test_terms_are_told_from_chunks_by_their_targets(tmp_path: Path) -> None:
    torch.manual_seed(0)
    heads = [torch.nn.Linear(4, 5) for _ in range(3)]
    hidden = torch.randn(2, 6, 4)
    labels = torch.randint(0, 5, (2, 6))
    labels[0, 4:] = -100
    with Recorder(tmp_path, run_id="terms", flush_every=1000) as rec, rec.capture_cross_entropy():
        rec.begin_step(0)
        # main + auxiliary head over the same labels: two terms
        main = F.cross_entropy(heads[0](hidden).flatten(0, 1), labels.flatten(), reduction="sum")
        aux = F.cross_entropy(heads[1](hidden).flatten(0, 1), labels.flatten(), reduction="sum")
        (main + aux).backward()
        rec.begin_step(1)
        # one cross-entropy in two chunks of the flattened sequence: one term
        logits, flat = heads[0](hidden).flatten(0, 1), labels.flatten()
        (
            F.cross_entropy(logits[:5], flat[:5], reduction="sum")
            + F.cross_entropy(logits[5:], flat[5:], reduction="sum")
        ).backward()
        rec.begin_step(2)
        # chunks along the sequence of a 2-D batch (class dimension second): disjoint views, one term
        logits = heads[0](hidden).transpose(1, 2)
        (
            F.cross_entropy(logits[..., :3], labels[:, :3], reduction="sum")
            + F.cross_entropy(logits[..., 3:], labels[:, 3:], reduction="sum")
        ).backward()
        rec.begin_step(6)
        # two chunks, then a second head over the first chunk's labels: another term, though its
        # labels miss the last chunk
        logits, flat = heads[0](hidden).flatten(0, 1), labels.flatten()
        (
            F.cross_entropy(logits[:5], flat[:5], reduction="sum")
            + F.cross_entropy(logits[5:], flat[5:], reduction="sum")
            + F.cross_entropy(heads[1](hidden).flatten(0, 1)[:5], flat[:5], reduction="sum")
        ).backward()
        rec.begin_step(5)
        # chunks whose labels were copied (flatten of a 2-D slice) cannot be told from another head
        # by their targets: named, they are one term
        logits = heads[0](hidden)
        with rec.loss_term("0"):
            (
                F.cross_entropy(logits[:, :3].flatten(0, 1), labels[:, :3].flatten(), reduction="sum")
                + F.cross_entropy(logits[:, 3:].flatten(0, 1), labels[:, 3:].flatten(), reduction="sum")
            ).backward()
        rec.begin_step(3)
        # multi-token prediction: head k predicts the labels k positions on (overlapping views): 3 terms
        total = sum(
            F.cross_entropy(heads[k](hidden)[:, : 6 - k].flatten(0, 1), labels[:, k:].flatten(), reduction="sum")
            for k in range(3)
        )
        total.backward()
        rec.begin_step(4)
        # named terms: the user says which is which
        with rec.loss_term("lm"):
            main = F.cross_entropy(heads[0](hidden).flatten(0, 1), labels.flatten())
        with rec.loss_term("router"):
            aux = F.cross_entropy(heads[1](hidden).flatten(0, 1), labels.flatten())
        (main + aux).backward()
    rows = read_rows(tmp_path / "terms")
    valid = int((labels != -100).sum())
    shape = sorted((r["step"], r["term"], r["micro"], r["valid_tokens"]) for r in rows)
    assert shape == [
        (0, "0", 0, valid),
        (0, "1", 0, valid),
        (1, "0", 0, valid),
        (2, "0", 0, valid),
        (3, "0", 0, valid),
        (3, "1", 0, int((labels[:, 1:] != -100).sum())),
        (3, "2", 0, int((labels[:, 2:] != -100).sum())),
        (4, "lm", 0, valid),
        (4, "router", 0, valid),
        (5, "0", 0, valid),
        (6, "0", 0, valid),
        (6, "1", 0, int((flat[:5] != -100).sum())),
    ]
    for row in rows:  # every captured term's probe saw its own tokens' weights
        expected = 1 / valid if row["step"] == 4 else 1.0
        assert row["token_weight_sum"] / row["valid_tokens"] == pytest.approx(expected, rel=1e-6)


def test_chunks_whose_labels_are_copies_are_one_term_by_the_split_their_logits_come_from(tmp_path: Path) -> None:
    """torchtune's chunked cross-entropy: the hidden state (or the logits) chunked along the sequence, each
    chunk's labels `labels.chunk(k, dim=1)[i].reshape(-1)`, a copy in a batch of several rows. The labels share
    no storage; the logits are parts of one split: one term. Two heads cut from one projection along the
    classes, or two heads over one hidden state, stay two terms."""
    torch.manual_seed(0)
    head, wide = torch.nn.Linear(4, 5), torch.nn.Linear(4, 10)
    hidden = torch.tanh(torch.randn(2, 8, 4, requires_grad=True))
    labels = torch.randint(0, 5, (2, 8))
    labels[1, 5:] = -100
    parts = [target.reshape(-1) for target in labels.chunk(4, dim=1)]
    assert all(part.untyped_storage().data_ptr() != labels.untyped_storage().data_ptr() for part in parts)
    with Recorder(tmp_path, run_id="copies", flush_every=1000) as rec, rec.capture_cross_entropy():
        rec.begin_step(0)  # the hidden state chunked, each chunk through the output layer in float32
        sum(
            F.cross_entropy(head(chunk).float().reshape(-1, 5), target, reduction="sum")
            for chunk, target in zip(hidden.chunk(4, dim=1), parts)
        ).backward(retain_graph=True)
        rec.begin_step(1)  # the logits chunked
        sum(
            F.cross_entropy(chunk.reshape(-1, 5), target, reduction="sum")
            for chunk, target in zip(head(hidden).chunk(4, dim=1), parts)
        ).backward(retain_graph=True)
        rec.begin_step(2)  # two heads: one projection cut along its classes
        first, second = wide(hidden).chunk(2, dim=-1)
        (
            F.cross_entropy(first.reshape(-1, 5), labels.reshape(-1).clone(), reduction="sum")
            + F.cross_entropy(second.reshape(-1, 5), labels.reshape(-1).clone(), reduction="sum")
        ).backward()
    shape = sorted((r["step"], r["term"], r["valid_tokens"]) for r in read_rows(tmp_path / "copies"))
    valid = int((labels != -100).sum())
    assert shape == [(0, "0", valid), (1, "0", valid), (2, "0", valid), (2, "1", valid)]


def test_footprints() -> None:
    labels = torch.arange(24).view(4, 6)
    flat = labels.view(-1)
    assert Footprint.of(flat[:10]).disjoint(Footprint.of(flat[10:]))
    assert Footprint.of(labels[:, :3]).disjoint(Footprint.of(labels[:, 3:]))  # interleaved rows, no shared element
    assert not Footprint.of(labels[:, 1:]).disjoint(Footprint.of(labels[:, :-1]))  # shifted: overlap
    assert not Footprint.of(labels).disjoint(Footprint.of(labels))
    assert not Footprint.of(labels[:, :3].clone()).disjoint(Footprint.of(labels[:, 3:].clone()))  # other storage


@pytest.mark.parametrize("dtype, tokens", [(torch.float16, 70_000), (torch.bfloat16, 1001)])
def test_the_fix_divides_in_float32(dtype: torch.dtype, tokens: int) -> None:
    per_token = torch.full((8,), 2.0, dtype=dtype, requires_grad=True)
    loss_sum = per_token.sum()
    scalar = token_mean_loss(loss_sum, torch.tensor(tokens), world_size=2)
    assert scalar.dtype == torch.float32
    scalar.backward()
    assert per_token.grad is not None
    # ∂b/∂ℓ = W/N: finite and non-zero in float16 (N > 65504 is inf there) and, in float32, exact to 1e-6
    # before the gradient is rounded into ℓ's own dtype.
    weight = per_token.grad.double()
    assert torch.isfinite(weight).all() and (weight > 0).all()
    assert float(weight[0]) == pytest.approx(2 / tokens, rel=2**-7)
    assert float(scalar.detach()) == pytest.approx(2 * 16.0 / tokens, rel=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        narrow = loss_sum.detach() * 2 / torch.tensor(tokens).to(dtype)  # what casting N to the loss dtype gave
    assert not math.isclose(float(narrow), 2 * 16.0 / tokens, rel_tol=1e-4)


def test_a_loss_the_capture_cannot_see_is_said_at_the_first_step(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.tensor([0, 1, 2, 1])

    def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # what a fused kernel computes, without calling F.cross_entropy
        return -(logits.log_softmax(-1).gather(1, target[:, None])).mean()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="fused", optimizer=optimizer) as rec, rec.capture_cross_entropy():
            for _ in range(3):
                fused_cross_entropy(model(torch.randn(4, 4)), labels).backward()
                optimizer.step()
                optimizer.zero_grad()
    said = [str(w.message) for w in caught if "no cross-entropy call was captured" in str(w.message)]
    assert len(said) == 1 and "rec.probe" in said[0] and "step 0" in said[0]


def test_a_declared_weight_is_any_number_and_a_refused_one_says_why(tmp_path: Path) -> None:
    """`loss_term(name, weight=λ)` takes λ as a Python or numpy number, a one-element array or a CPU tensor (a
    schedule's value, as `record()` takes its numbers): each record of the term carries it. A weight it cannot take
    is left out with one warning that says what was wrong with it (its type, or its value), and the term is judged
    as a token mean (an np.float32 was refused, "a finite number ≥ 0" said of 0.5)."""
    import numpy as np

    given = [np.float32(0.5), torch.tensor(0.25, dtype=torch.float64), np.array([2.0]), np.int64(3), 1.5, 0]
    with Recorder(tmp_path, run_id="weights", announce=False) as rec:
        for step, weight in enumerate(given):
            rec.begin_step(step)
            with rec.loss_term("aux", weight=weight):
                rec.record(loss_sum=2.0, valid_tokens=4, backward_scalar=0.5)
    rows = read_rows(tmp_path / "weights")
    assert [row["term_weight"] for row in sorted(rows, key=lambda r: r["step"])] == [0.5, 0.25, 2.0, 3.0, 1.5, 0.0]

    for weight, said in [
        ("0.5", "not str"),
        (True, "not bool"),
        (torch.tensor([0.5, 0.5]), "not Tensor"),
        (-1.0, "finite and ≥ 0"),
        (math.nan, "finite and ≥ 0"),
        (np.float32("inf"), "finite and ≥ 0"),
    ]:
        with (
            warnings.catch_warnings(record=True) as caught,
            Recorder(tmp_path / "refused", run_id="refused", announce=False) as rec,
        ):
            warnings.simplefilter("always")
            with rec.loss_term("aux", weight=weight):
                rec.record(loss_sum=2.0, valid_tokens=4, backward_scalar=0.5)
        messages = [str(w.message) for w in caught if "loss_term" in str(w.message)]
        assert len(messages) == 1 and said in messages[0] and "left out" in messages[0], (weight, messages)
