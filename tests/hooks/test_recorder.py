"""Recorder and probe in one process: identity, no host sync, atomic shards, never crashing training."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch

import tokaudit
from tests.hooks.syncs import count_host_syncs
from tests.logs import read_rows
from tokaudit.hooks import Recorder
from tokaudit.hooks._buffer import RecordBuffer
from tokaudit.hooks._columns import Packed
from tokaudit.hooks._probe import ProbeResult
from tokaudit.hooks._record import Record, new_record
from tokaudit._schema import WRITER_SCHEMA


@pytest.mark.parametrize("shape", [(7,), (2, 5), (3, 2, 4)])
@pytest.mark.parametrize("valid_fraction", [0.0, 0.4, 1.0])
def test_probe_is_identity_to_the_bit_and_measures_each_weight(
    tmp_path: Path, shape: tuple[int, ...], valid_fraction: float
) -> None:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(*shape, generator=generator, requires_grad=True)
    valid = torch.rand(*shape, generator=generator) < valid_fraction
    token_scale = torch.rand(*shape, generator=generator) + 0.5  # every token a different weight

    def backward(probe: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logits.grad = None
        per_token = logits.sigmoid() * 3
        with Recorder(tmp_path, run_id=f"probe{probe}") as rec:
            if probe:
                per_token = rec.probe(per_token, valid)
            scalar = (per_token * token_scale * valid).sum() / 3 + (per_token * ~valid).sum() * 0.25
            out = scalar.detach()
            rec.record(loss_sum=(per_token * valid).sum(), valid_tokens=valid.sum(), backward_scalar=scalar)
            scalar.backward()
        assert logits.grad is not None
        return logits.grad.clone(), out

    plain, _ = backward(False)
    probed, _ = backward(True)
    assert torch.equal(plain, probed)
    (row,) = read_rows(tmp_path / "probeTrue")
    expected = (token_scale / 3)[valid]
    assert row["valid_tokens"] == int(valid.sum())
    assert row["token_weight_sum"] == pytest.approx(float(expected.sum()), rel=1e-6)
    assert row["masked_weight_abs_sum"] == pytest.approx(0.25 * int((~valid).sum()), rel=1e-6)
    if valid.any():
        assert row["token_weight_min"] == pytest.approx(float(expected.min()), rel=1e-6)
        assert row["token_weight_max"] == pytest.approx(float(expected.max()), rel=1e-6)
    else:
        assert row["token_weight_min"] is None and row["token_weight_max"] is None


@pytest.mark.parametrize("padding_label, counted", [(-100, False), (0, True)])
def test_weight_on_an_exact_zero_loss_is_not_counted_as_masked_weight(
    tmp_path: Path, padding_label: int, counted: bool
) -> None:
    """per_token.sum() / N over ignore_index positions (exact 0 loss, no gradient) is a token mean;
    padding labelled as a real token (a loss that is not 0) summed the same way is not."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 5, generator=generator, requires_grad=True)
    labels = torch.randint(0, 5, (2, 6), generator=generator)
    valid = torch.rand(2, 6, generator=generator) < 0.6
    labels = labels.masked_fill(~valid, padding_label)
    with Recorder(tmp_path, run_id="masked") as rec:
        per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
        per_token = rec.probe(per_token, valid)
        scalar = per_token.sum() / valid.sum()
        rec.record(loss_sum=per_token.sum(), valid_tokens=valid.sum(), backward_scalar=scalar)
        scalar.backward()
    (row,) = read_rows(tmp_path / "masked")
    masked_losses = per_token.detach()[~valid]
    assert bool((masked_losses != 0).all()) is counted
    if counted:
        assert row["masked_weight_abs_sum"] == pytest.approx(int((~valid).sum()) / int(valid.sum()))
    else:
        assert row["masked_weight_abs_sum"] == 0.0
    assert row["token_weight_sum"] == pytest.approx(1.0)


def test_no_host_sync_between_flushes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_host_syncs(monkeypatch)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(tmp_path, run_id="sync", optimizer=optimizer, flush_every=1000)
    for step in range(5):
        for micro in range(2):
            x = torch.randn(6, 4)
            labels = torch.tensor([0, 1, 2, -100, 1, -100])
            per_token = torch.nn.functional.cross_entropy(model(x), labels, reduction="none")
            per_token = rec.probe(per_token, labels != -100)
            loss_sum = per_token.sum()
            valid_tokens = (labels != -100).sum()
            scalar = loss_sum / 8
            rec.record(
                loss_sum=loss_sum,
                valid_tokens=valid_tokens,
                backward_scalar=scalar,
                positions=6,
                reported_loss=scalar.detach(),
            )
            scalar.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert calls == [], f"host syncs while recording: {calls}"
    monkeypatch.undo()
    rec.close()
    rows = read_rows(tmp_path / "sync")
    assert [(r["step"], r["micro"]) for r in rows] == [(s, m) for s in range(5) for m in range(2)]
    assert all(r["valid_tokens"] == 4 and r["positions"] == 6 for r in rows)


def _varied_loop(rec: Recorder, optimizer: torch.optim.Optimizer, model: torch.nn.Module, steps: int) -> None:
    """Steps of 2 microbatches whose values come in several dtypes: a float32 loss sum, an int32 count, a
    bfloat16 backward scalar, a tensor position count and grad_scale, a reported loss stamped after the step."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for _ in range(2):
            x = torch.randn(6, 4, generator=generator)
            labels = torch.tensor([0, 1, 2, -100, 1, -100])
            valid = labels != -100
            per_token = rec.probe(torch.nn.functional.cross_entropy(model(x), labels, reduction="none"), valid)
            loss_sum = (per_token * valid).sum()
            scalar = loss_sum / 7
            rec.record(
                loss_sum=loss_sum,
                valid_tokens=valid.sum().to(torch.int32),
                backward_scalar=scalar.detach().to(torch.bfloat16),
                positions=torch.tensor(6),
                grad_scale=torch.tensor(0.5, dtype=torch.float64),
            )
            scalar.backward()
        optimizer.step()
        optimizer.zero_grad()
        rec.report_loss(torch.tensor(1.25, dtype=torch.float16))


def _buffered(step: int, backward_done: bool) -> Record:
    """A record of `step` whose values are one-number tensors of several dtypes, with a probe."""
    probe = ProbeResult()
    if backward_done:
        probe.add(torch.tensor([0.25, 0.25, 0.0]), torch.tensor([True, True, False]), torch.tensor([False] * 3))
    return new_record(
        step=step,
        micro=0,
        term="0",
        loss_sum=torch.tensor(1.5),
        valid_tokens=torch.tensor(2),
        backward_scalar=torch.tensor(0.5, dtype=torch.bfloat16),
        positions=torch.tensor(3),
        reported_loss=None,
        skipped=None,
        grad_scale=torch.tensor(1.0, dtype=torch.float64),
        loss_scale=None,
        prescaled=False,
        sync=None,
        probe=probe,
        captured=False,
        accelerate=None,
    )


def test_closed_updates_are_packed_into_one_slab_not_a_tensor_each() -> None:
    """The mechanism behind the recorder's cost on a CPU heap: a flush's records must not hold thousands of
    one-number tensors; once an update closes (its backward done), its values are one tensor."""
    buffer = RecordBuffer()
    records = [_buffered(step, backward_done=True) for step in range(3) for _ in range(2)]
    records.append(_buffered(3, backward_done=False))  # the open update, its backward still to come
    for record in records:
        buffer.add(record)
    buffer.pack(open_step=3)
    for record in records[:-1]:
        values = [
            getattr(record, name) for name in ("loss_sum", "valid_tokens", "backward_scalar", "positions", "grad_scale")
        ]
        values += [getattr(record.probe, name) for name in ("weight_sum", "weight_min", "weight_max")]
        assert all(isinstance(v, Packed) for v in values), f"step {record.step} holds tensors of its own"
    assert len({id(r.loss_sum.values) for r in records[:-1] if isinstance(r.loss_sum, Packed)}) == 1, (
        "the updates are packed into one slab, not a tensor each"
    )
    assert isinstance(records[-1].loss_sum, torch.Tensor) and buffer.unpacked == [records[-1]]
    for _ in range(2):  # a value set again on a packed record: it waits for the next pack, once
        buffer.set_value(records[0], "reported_loss", torch.tensor(0.5))
    buffer.mark_skipped(1, torch.tensor(False))  # a scaler's found_inf, packed with its update
    assert [sum(r is record for r in buffer.unpacked) for record in records[:3]] == [1, 0, 1]
    buffer.pack(open_step=3)
    assert isinstance(records[0].reported_loss, Packed) and isinstance(records[2].skipped, Packed)
    assert float(records[0].reported_loss.tensor()) == 0.5 and float(records[2].skipped.tensor()) == 0.0


def test_packed_records_write_the_shards_unpacked_ones_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def shards(name: str) -> list[dict[str, Any]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with Recorder(tmp_path, run_id=name, optimizer=optimizer, flush_every=5) as rec:
            _varied_loop(rec, optimizer, model, 6)
        return [{k: v for k, v in row.items() if k != "time"} for row in read_rows(tmp_path / name)]

    packed = shards("packed")
    monkeypatch.setattr("tokaudit.hooks._columns.SLAB_NUMBERS", 50)  # two updates a slab: a flush takes two
    small_slabs = shards("small_slabs")
    monkeypatch.setattr("tokaudit.hooks._buffer.pack", lambda holders, slabs=None: None)
    unpacked = shards("unpacked")
    assert len(packed) == 12 and packed[0]["positions"] == 6 and packed[0]["grad_scale"] == 0.5
    assert packed[0]["reported_loss"] == 1.25 and packed[0]["token_weight_sum"] is not None
    assert [{**r, "run_id": ""} for r in packed] == [{**r, "run_id": ""} for r in unpacked]
    assert [{**r, "run_id": ""} for r in small_slabs] == [{**r, "run_id": ""} for r in unpacked]


def test_a_pack_that_fails_warns_once_and_loses_no_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(holders: Any, slabs: Any = None) -> None:
        raise RuntimeError("device lost")

    expected = None
    for name in ("plain", "failing"):
        if name == "failing":
            monkeypatch.setattr("tokaudit.hooks._buffer.pack", failing)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Recorder(tmp_path, run_id=name, optimizer=optimizer, flush_every=5) as rec:
                _varied_loop(rec, optimizer, model, 4)
        rows = [{k: v for k, v in row.items() if k not in ("time", "run_id")} for row in read_rows(tmp_path / name)]
        if expected is None:
            expected = rows
            continue
        packing = [w for w in caught if "could not pack" in str(w.message)]
        assert len(packing) == 1 and "device lost" in str(packing[0].message)
    assert rows == expected and len(rows) == 8


def test_packs_fill_a_slab_then_take_a_new_one_and_keep_every_value() -> None:
    from tokaudit.hooks._columns import Slabs, pack

    slabs = Slabs(numbers=5)
    updates = [
        SimpleNamespace(a=torch.tensor(float(i)), b=torch.tensor(i, dtype=torch.int32), c=torch.tensor(-i / 4))
        for i in range(4)
    ]
    for update in updates:
        pack([(update, name) for name in ("a", "b", "c")], slabs)
    held = [value for update in updates for value in vars(update).values()]
    assert all(isinstance(value, Packed) for value in held)
    # three places an update, five a slab: each update whole in one slab, a new slab when it would not fit
    assert [len({id(value.values) for value in vars(update).values()}) for update in updates] == [1, 1, 1, 1]
    assert len({id(value.values) for value in held}) == 4
    assert [float(value.tensor()) for update in updates for value in vars(update).values()] == [
        v for i in range(4) for v in (float(i), float(i), -i / 4)
    ]


def test_a_flush_copies_the_places_its_records_hold_not_the_whole_slab() -> None:
    from tokaudit.hooks._columns import PackedHost, Slabs, pack

    updates = [SimpleNamespace(a=torch.tensor(i + 0.5), b=torch.tensor(i, dtype=torch.int64)) for i in range(6)]
    slabs = Slabs()
    for update in updates:
        pack([(update, "a"), (update, "b")], slabs)
    host = PackedHost()
    host.copy([updates[1].a, updates[2].b])
    assert host.copied == 4  # places 2…5 of 2¹⁴
    assert host.number(updates[1].a) == 1.5 and host.number(updates[2].b) == 2.0
    host.copy([updates[0].a, updates[1].b])  # partly outside what was copied: the span widened
    host.copy([updates[2].a])  # inside it: nothing copied again
    assert host.copied == 6
    assert [host.number(getattr(u, name)) for u in updates[:3] for name in ("a", "b")] == [0.5, 0.0, 1.5, 1.0, 2.5, 2.0]


def test_a_probe_reached_again_after_its_update_was_packed_adds_to_what_it_held() -> None:
    from tokaudit.hooks._columns import pack
    from tokaudit.hooks._probe import ProbeResult

    valid = torch.tensor([True, True, False])
    live = torch.tensor([False, False, True])
    first, second = torch.tensor([0.25, 0.5, 0.125]), torch.tensor([1.0, -2.0, 4.0])
    packed, plain = ProbeResult(), ProbeResult()
    for result in (packed, plain):
        result.add(first, valid, live)
    pack([(packed, name) for name in ("weight_sum", "weight_min", "weight_max", "masked_abs_sum", "valid_count")])
    for result in (packed, plain):
        result.add(second, valid, live)
    for name in ("weight_sum", "weight_min", "weight_max", "masked_abs_sum", "valid_count"):
        assert float(getattr(packed, name)) == float(getattr(plain, name)), name


def test_shards_rotate_atomically_and_a_resumed_run_never_overwrites(tmp_path: Path) -> None:
    for attempt in range(2):
        with Recorder(tmp_path, run_id="resume", flush_every=3) as rec:
            for step in range(4):
                rec.record(loss_sum=1.0, valid_tokens=2, backward_scalar=0.5, step=step + 10 * attempt)
    names = sorted(p.name for p in (tmp_path / "resume").iterdir())
    assert names == [f"rank-00000-{i:06d}.parquet" for i in range(4)]
    steps = [row["step"] for row in read_rows(tmp_path / "resume")]
    assert steps == [0, 1, 2, 3, 10, 11, 12, 13]
    for shard in (tmp_path / "resume").iterdir():
        assert pq.read_schema(shard).equals(WRITER_SCHEMA, check_metadata=False)


def test_write_failure_warns_once_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = Recorder(tmp_path, run_id="broken", flush_every=1)
        for step in range(3):
            rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0, step=step)
        rec.close()
        rec.close()  # idempotent
    messages = [str(w.message) for w in caught if "could not write" in str(w.message)]
    assert len(messages) == 1 and "disk full" in messages[0]
    assert not list((tmp_path / "broken").glob("*.parquet"))


def test_unwritable_log_dir_warns_once_and_close_says_what_was_lost(tmp_path: Path) -> None:
    """A folder that cannot be created: one warning when it is found, none at each failed write after it, and
    one at close() naming the records it could not write."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = Recorder(blocker / "logs", flush_every=1)
        for step in range(3):
            rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0, step=step)
        rec.close()
    said = [str(w.message) for w in caught]
    assert len(said) == 2 and "cannot create" in said[0], said
    assert "3 record(s) could not be written" in said[1] and "steps 0–2" in said[1]


def test_steps_come_from_the_optimizer_and_explicit_values_win(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, run_id="steps", optimizer=optimizer) as rec:
        for _ in range(2):
            for _ in range(3):
                rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0)
            optimizer.step()
        rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0, step=42, micro=7)
    keys = [(r["step"], r["micro"]) for r in read_rows(tmp_path / "steps")]
    assert keys == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (42, 7)]


def test_without_optimizer_or_step_every_backward_of_unknown_sync_is_its_own_update(tmp_path: Path) -> None:
    with Recorder(tmp_path, run_id="auto") as rec:
        for _ in range(3):
            rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0)
    rows = read_rows(tmp_path / "auto")
    assert [(r["step"], r["micro"], r["world_size"], r["rank"]) for r in rows] == [
        (0, 0, 1, 0),
        (1, 0, 1, 0),
        (2, 0, 1, 0),
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_device_sync_on_cuda(tmp_path: Path) -> None:
    """On a GPU, CUDA's own sync detector errors on any synchronizing call while recording."""
    model = torch.nn.Linear(16, 8).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(tmp_path, run_id="cuda", optimizer=optimizer, flush_every=1000)
    labels = torch.tensor([0, 1, 2, -100, 1, -100], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            per_token = torch.nn.functional.cross_entropy(
                model(torch.randn(6, 16, device="cuda")), labels, reduction="none"
            )
            per_token = rec.probe(per_token, labels != -100)
            loss_sum = per_token.sum()
            scalar = loss_sum / 4
            rec.record(loss_sum=loss_sum, valid_tokens=(labels != -100).sum(), backward_scalar=scalar)
            scalar.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rec.close()
    assert [row["valid_tokens"] for row in read_rows(tmp_path / "cuda")] == [4, 4, 4]


def test_begin_step_and_report_loss(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, run_id="resumed", optimizer=optimizer) as rec:
        rec.begin_step(100)  # a run resumed at update 100
        for _ in range(2):
            for _ in range(2):
                rec.record(loss_sum=2.0, valid_tokens=4, backward_scalar=0.25)
            optimizer.step()
            rec.report_loss(0.5)  # the trainer's log for the update just closed
    rows = read_rows(tmp_path / "resumed")
    assert [(r["step"], r["micro"], r["reported_loss"]) for r in rows] == [
        (100, 0, 0.5),
        (100, 1, 0.5),
        (101, 0, 0.5),
        (101, 1, 0.5),
    ]


@pytest.mark.parametrize("when", ["before the optimizer step", "after it"])
def test_a_loss_logged_before_or_after_the_optimizer_step_is_stamped_on_its_own_update(
    tmp_path: Path, when: str
) -> None:
    """A loop that logs its loss after backward but before `optimizer.step()` (the update still under way)
    and one that logs it after the step (the update just closed) both stamp each update with its own token
    mean: the audit finds the reported loss right, and the run correct. Stamped on the update before, a
    correct run was called incorrect (reported_loss_mismatch, '0.92× the token mean')."""
    from tokaudit._auditing import audit

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 11)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    with Recorder(tmp_path, run_id="logged", optimizer=optimizer) as rec:
        for _ in range(4):
            batches = [
                (torch.randn(4, 6, 8, generator=generator), torch.randint(0, 11, (4, 6), generator=generator))
                for _ in range(3)
            ]
            for index, (_, labels) in enumerate(batches):
                labels[torch.rand(4, 6, generator=generator) < 0.3 * index] = -100
            count = sum(int((labels != -100).sum()) for _, labels in batches)
            total = torch.zeros(())
            for x, labels in batches:
                valid = labels.flatten() != -100
                per_token = rec.probe(
                    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), labels.flatten(), reduction="none"), valid
                )
                loss_sum = per_token.sum()
                scalar = loss_sum / count
                rec.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=scalar)
                scalar.backward()
                total = total + loss_sum.detach()
            if when == "before the optimizer step":
                rec.report_loss(total / count)
            optimizer.step()
            optimizer.zero_grad()
            if when == "after it":
                rec.report_loss(total / count)
    rows = read_rows(tmp_path / "logged")
    assert len(rows) == 12 and all(row["reported_loss"] is not None for row in rows)
    report = audit([tmp_path / "logged"])
    assert [f.code.value for f in report.findings] == [] and report.runs[0].verdict == "correct"


@pytest.mark.slow
def test_records_are_flushed_at_interpreter_exit(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "from tokaudit.hooks import Recorder\n"
        f"rec = Recorder({str(tmp_path)!r}, run_id='exit')\n"
        "rec.record(loss_sum=1.0, valid_tokens=2, backward_scalar=0.5)\n"
    )  # no close()
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert [row["valid_tokens"] for row in read_rows(tmp_path / "exit")] == [2]


def test_manual_step_boundaries_without_optimizer(tmp_path: Path) -> None:
    with Recorder(tmp_path, run_id="manual") as rec:
        for step in range(2):
            rec.begin_step(step)
            rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0)
            rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0)
    keys = [(r["step"], r["micro"]) for r in read_rows(tmp_path / "manual")]
    assert keys == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_step_given_to_record_numbers_its_own_microbatches(tmp_path: Path) -> None:
    """docs/recording.md: without an optimizer, begin_step(step) or step= says the update. Given to record() alone
    (no micro=), each step's records are microbatches 0, 1, …: not every one microbatch 0 (a duplicate the audit
    would drop). The same with a watched optimizer and a trainer's own numbering (its global step, from 1)."""
    with Recorder(tmp_path, run_id="given") as rec:
        for step in range(3):
            for n in (1, 3):  # a token mean: b = S/N, N = 4
                rec.record(loss_sum=float(n), valid_tokens=n, backward_scalar=n / 4, step=step)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, run_id="global", optimizer=optimizer) as rec:
        for step in range(1, 4):
            for n in (1, 3):
                rec.record(loss_sum=float(n), valid_tokens=n, backward_scalar=n / 4, step=step)
            optimizer.step()
    assert [(r["step"], r["micro"]) for r in read_rows(tmp_path / "given")] == [
        (s, m) for s in range(3) for m in (0, 1)
    ]
    assert [(r["step"], r["micro"]) for r in read_rows(tmp_path / "global")] == [
        (s, m) for s in range(1, 4) for m in (0, 1)
    ]
    report = tokaudit.audit([tmp_path / "given", tmp_path / "global"])
    assert report.verdicts == {"given": "correct", "global": "correct"}


class _Unhookable:
    """A model and an optimizer the recorder cannot hook: every hook it tries raises."""

    require_backward_grad_sync = True

    def register_forward_pre_hook(self, hook: Any) -> None:
        raise RuntimeError("no hooks here")

    @property
    def optimizer(self) -> Any:
        raise AttributeError("_optimizer_step_post_hooks")


def test_the_recorder_never_raises_at_construction_and_records_on(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = Recorder(
            tmp_path,
            run_id="unhookable",
            model=_Unhookable(),
            optimizer=_Unhookable(),  # type: ignore[arg-type]
            flush_every=0,
        )
        rec.record(loss_sum=torch.tensor(3.0), valid_tokens=3, backward_scalar=torch.tensor(1.0))
        rec.close()
    messages = " ".join(str(w.message) for w in caught)
    assert "cannot hook the model" in messages and "cannot hook the optimizer" in messages
    assert "flush_every" in messages
    (row,) = read_rows(tmp_path / "unhookable")
    assert row["valid_tokens"] == 3 and row["loss_sum"] == 3.0


MISUSES = {
    "begin_step(None)": lambda rec: rec.begin_step(None),
    "begin_step(-1)": lambda rec: rec.begin_step(-1),
    "probe(0.0)": lambda rec: rec.probe(0.0),
}


@pytest.mark.parametrize("misuse", list(MISUSES))
def test_a_call_given_what_it_cannot_use_warns_and_training_goes_on(tmp_path: Path, misuse: str) -> None:
    """The recorder never raises into the training loop: begin_step given no update number (it used to make the
    optimizer's next step raise, and close() after it), probe() given a number: one warning, the update goes on
    being recorded where it was, and every record is written."""
    weight = torch.ones(2, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="misused", optimizer=optimizer) as rec:
            for step in range(2):
                if step == 1:
                    returned = MISUSES[misuse](rec)
                    assert misuse != "probe(0.0)" or returned == 0.0
                loss = (weight * 2).sum()
                rec.record(loss_sum=loss, valid_tokens=2, backward_scalar=loss / 2)
                (loss / 2).backward()
                optimizer.step()
                optimizer.zero_grad()
    assert [(r["step"], r["micro"]) for r in read_rows(tmp_path / "misused")] == [(0, 0), (1, 0)]
    said = [str(w.message) for w in caught if "tokaudit:" in str(w.message)]
    assert len([m for m in said if "begin_step" in m or "probe()" in m]) == 1, said


def test_begin_step_takes_a_whole_number_of_any_type_and_numbers_on_past_what_is_none(tmp_path: Path) -> None:
    """A trainer's step computed with `/` (2.0), a numpy or tensor integer: the update it says. None or 2.5 (no update
    number): one warning, and the update still begins, numbered after the last; the microbatches stay together."""
    import numpy as np

    given = {"floats": [0.0, 1.0, 2.0], "numbers": [np.int64(0), torch.tensor(1), np.float64(2.0)]}
    given["nothing"] = [None, None, 2.5]
    for run, steps in given.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Recorder(tmp_path, run_id=run) as rec:
                for step in steps:
                    rec.begin_step(step)
                    for n in (1, 3):
                        rec.record(loss_sum=float(n), valid_tokens=n, backward_scalar=n / 4)
        assert [(r["step"], r["micro"]) for r in read_rows(tmp_path / run)] == [
            (s, m) for s in range(3) for m in (0, 1)
        ]
        said = [str(w.message) for w in caught if "begin_step" in str(w.message)]
        assert len(said) == (1 if run == "nothing" else 0), said
    assert tokaudit.audit([tmp_path]).verdicts == {"floats": "correct", "numbers": "correct", "nothing": "correct"}


def test_the_last_shard_says_the_training_code_closed_the_recorder_and_never_at_an_error(tmp_path: Path) -> None:
    """close() called by the training code (or a `with` block left normally) is a deliberate end, which the last
    shard's footer says ("closed"): the audit then reads a rank whose records end early as missing, not killed.
    A `with` block left by an error, or a close() in a `finally` while the error is in flight, says nothing of it."""
    import json

    from tokaudit._schema import PROVENANCE_KEY

    def said(run: str) -> list[bool]:
        shards = sorted((tmp_path / run).glob("*.parquet"))
        return [json.loads(pq.read_metadata(s).metadata[PROVENANCE_KEY]).get("closed") is True for s in shards]

    with Recorder(tmp_path, run_id="closed", flush_every=2) as rec:
        for step in range(3):
            rec.begin_step(step)
            rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0)
    with pytest.raises(RuntimeError, match="out of memory"):
        with Recorder(tmp_path, run_id="errored") as rec:
            rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0)
            raise RuntimeError("out of memory")
    rec = Recorder(tmp_path, run_id="finally")
    with pytest.raises(RuntimeError, match="out of memory"):
        try:
            rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0)
            raise RuntimeError("out of memory")
        finally:
            rec.close()  # the error still in flight
    rec = Recorder(tmp_path, run_id="ran_out")
    try:
        rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0)
        next(iter([]))
    except StopIteration:  # the data ran out: no error
        rec.close()
    assert said("closed")[-1] and not any(said("closed")[:-1])
    assert said("errored") == [False] and said("finally") == [False] and said("ran_out") == [True]


def test_every_shard_says_where_it_came_from(tmp_path: Path) -> None:
    """Each shard's footer holds `tokaudit.provenance`: tokaudit's and torch's versions, the W the recorder saw,
    and the trainer an integration names (which the audit's fixes then speak in)."""
    import json

    import tokaudit

    rec = Recorder(tmp_path, run_id="prov", flush_every=2)
    rec.provenance.update(trainer="transformers", trainer_version="5.24.0")  # what the HF callback adds
    for step in range(3):
        rec.record(loss_sum=torch.tensor(2.0), valid_tokens=2, backward_scalar=torch.tensor(1.0), step=step)
    rec.close()
    shards = sorted((tmp_path / "prov").glob("*.parquet"))
    assert len(shards) == 2
    launches = set()
    for index, shard in enumerate(shards):
        note = json.loads(pq.read_schema(shard).metadata[b"tokaudit.provenance"])
        launch = note.pop("launch")
        launches.add((launch["id"], launch["first_shard"]))
        assert note.pop("closed", False) == (index == len(shards) - 1)  # written at close()
        assert note == {
            "tokaudit": tokaudit.__version__,
            "torch": torch.__version__,
            "world_size": 1,
            "launch_world_size": 1,
            "trainer": "transformers",
            "trainer_version": "5.24.0",
        }
    assert len(launches) == 1 and next(iter(launches))[1] == 0  # one launch, its first shard numbered 0


HOSTILE_RUN_IDS = ["../../escaped", "../sibling", "..", "a/../../../up3", "runs/../../x", "/tmp/absolute", "./", "a\0b"]


@pytest.mark.parametrize("run_id", HOSTILE_RUN_IDS)
def test_a_run_id_that_would_leave_log_dir_lands_inside_it_with_one_warning(tmp_path: Path, run_id: str) -> None:
    """Run ids come from job names: one that is a path out of log_dir (.., an absolute path) becomes one name
    inside it, said once; training goes on and the audit reads the run under that name."""
    from tokaudit._auditing import audit

    log_dir = tmp_path / "deep" / "logs"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(log_dir, run_id=run_id, flush_every=2) as rec:
            for step in range(3):
                rec.record(loss_sum=2.0, valid_tokens=2, backward_scalar=1.0, step=step)
    said = [str(w.message) for w in caught if "would leave log_dir" in str(w.message)]
    assert len(said) == 1, said
    written = sorted(p for p in tmp_path.rglob("*.parquet"))
    assert written and all(log_dir in p.parents for p in written), written
    (folder,) = {p.parent for p in written}
    assert folder.parent == log_dir and rec.run_id == folder.name and "/" not in folder.name
    report = audit([log_dir])
    assert [r.run for r in report.runs] == [folder.name] and report.problems == []


def test_a_run_id_of_nested_names_that_stay_inside_is_kept(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning
        with Recorder(tmp_path, run_id="sweep/trial-3", flush_every=1) as rec:
            rec.record(loss_sum=2.0, valid_tokens=2, backward_scalar=1.0, step=0)
    assert [p.parent for p in tmp_path.rglob("*.parquet")] == [tmp_path / "sweep" / "trial-3"]
    assert [row["run_id"] for row in read_rows(tmp_path / "sweep" / "trial-3")] == ["sweep/trial-3"]


def test_each_record_says_the_precision_its_values_and_gradients_had(tmp_path: Path) -> None:
    """precision_bits: the fewest significant bits of S, b and the probe's gradient (8 bfloat16, 24 float32);
    none where the values are Python numbers, which say nothing of how they were computed."""
    import torch.nn.functional as F

    logits = torch.randn(6, 5, requires_grad=True)
    labels = torch.tensor([0, 1, 2, -100, 3, 4])
    with Recorder(tmp_path, run_id="bits", flush_every=16) as rec:
        rec.record(loss_sum=2.0, valid_tokens=2, backward_scalar=1.0, step=0)
        rec.record(loss_sum=torch.tensor(2.0), valid_tokens=2, backward_scalar=torch.tensor(1.0), step=1)
        rec.record(
            loss_sum=torch.tensor(2.0, dtype=torch.float64),
            valid_tokens=2,
            backward_scalar=torch.tensor(1.0, dtype=torch.bfloat16),
            step=2,
        )
        with rec.capture_cross_entropy():  # the loss on bf16 logits: its gradient is bf16
            F.cross_entropy(logits.to(torch.bfloat16), labels).backward()
            rec.end_step()
    assert [row["precision_bits"] for row in read_rows(tmp_path / "bits")] == [None, 24, 8, 8]


def test_a_second_run_into_a_folder_that_holds_shards_from_step_0_is_warned(tmp_path: Path) -> None:
    """A resumed run that does not say its step (begin_step) starts at 0 again beside the first run's shards: one
    warning names it; a resume that continues its numbering says nothing."""

    def run(first: int) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Recorder(tmp_path, run_id="again", flush_every=2) as rec:
                rec.begin_step(first)
                for step in range(first, first + 3):
                    rec.record(loss_sum=2.0, valid_tokens=2, backward_scalar=1.0, step=step)
        return [str(w.message) for w in caught if "already holds shards" in str(w.message)]

    assert run(0) == [] and run(3) == []
    (said,) = run(0)
    assert "begin_step" in said and "duplicate_records" in said


def test_a_warning_points_at_the_training_script_s_line(tmp_path: Path) -> None:
    """The recorder's warnings name the user's line that led to them, not a line of tokaudit or torch."""
    script = tmp_path / "train.py"
    script.write_text(
        "from tokaudit.hooks import Recorder\n"
        f"rec = Recorder({str(tmp_path / 'logs')!r}, flush_every=0, announce=False)\n"
        "rec.close()\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    first = done.stderr.splitlines()[0]
    assert first.startswith(f"{script}:2: RuntimeWarning: tokaudit: flush_every"), done.stderr


def test_a_shard_is_written_on_time_so_a_live_audit_sees_the_run(tmp_path: Path) -> None:
    """Far fewer records than flush_every, but older than flush_seconds: the next record writes the closed
    updates to a shard (the open one waits), so `check --live` has something to audit during training."""
    import time

    from tokaudit._auditing import audit

    rec = Recorder(tmp_path, run_id="live", flush_seconds=0.2, announce=False)
    for step in range(3):
        rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0, step=step)
    assert not list((tmp_path / "live").glob("*.parquet"))
    time.sleep(0.3)
    rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0, step=3)
    assert len(list((tmp_path / "live").glob("*.parquet"))) == 1
    assert audit([tmp_path / "live"], live=True).runs[0].steps >= 3
    rec.close()
    assert sorted(r["step"] for r in read_rows(tmp_path / "live")) == [0, 1, 2, 3]


def test_the_later_launch_wins_whatever_its_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch on a node whose clock ran 3 h ahead recorded steps 0–5 wrongly (S/n on one rank), then died; the fixed
    launch resumed at step 3 into the same folder with the right clock. Its shards say it is the later launch (its
    first shard numbered after the other's): the audit judges its records, so the mistake shows on steps 0–2."""
    import time as clock
    from datetime import datetime, timezone

    from tokaudit._auditing import audit

    real = clock.time_ns
    monkeypatch.setattr("tokaudit.hooks._record.time.time_ns", lambda: real() + 3 * 3600 * 10**9)
    with Recorder(tmp_path, run_id="exp", announce=False) as dead:
        for step in range(6):
            dead.record(loss_sum=6.0, valid_tokens=3, backward_scalar=6.0, step=step)  # b = S: no denominator
    monkeypatch.setattr("tokaudit.hooks._record.time.time_ns", real)
    with Recorder(tmp_path, run_id="exp", announce=False) as fixed:
        for step in range(3, 6):
            fixed.record(loss_sum=6.0, valid_tokens=3, backward_scalar=6.0 / 3, step=step)  # b = S/N
    rows = read_rows(tmp_path / "exp")
    assert len(rows) == 9 and max(r["time"] for r in rows) > datetime.now(timezone.utc)  # the dead launch's, ahead
    report = audit([tmp_path / "exp"])
    found = {f.code.value: f for f in report.findings}
    assert (found["duplicate_records"].steps.first, found["duplicate_records"].steps.last) == (3, 5)
    (wrong,) = [f for f in report.findings if f.severity.value == "error"]  # q = N/1 = 3 on the dead launch's steps
    assert (wrong.steps.first, wrong.steps.last, wrong.steps.count) == (0, 2, 3)


def test_a_record_never_backpropagated_is_left_out_only_where_its_update_s_others_were(tmp_path: Path) -> None:
    """In one process, two updates of two microbatches and a third loss recorded with gradients but never
    backpropagated: left out (with one warning) where the update's other records went through backward. A loop
    whose recorded b is always a second copy of the loss it trains on (never itself backpropagated) loses
    nothing: no record of its updates was seen, so none can be told apart."""
    weight = torch.ones(3, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def loop(run: str, copied: bool) -> list[dict[str, Any]]:
        with Recorder(tmp_path, run_id=run, optimizer=optimizer) as rec:
            for _ in range(2):
                for micro in range(3):
                    loss_sum = (weight * (micro + 1)).sum()
                    scalar = loss_sum / 9
                    rec.record(loss_sum, 3, (weight * (micro + 1)).sum() / 9 if copied else scalar)
                    if micro < 2:
                        scalar.backward()  # the third is an evaluation: recorded, never trained on
                optimizer.step()
                optimizer.zero_grad()
        return read_rows(tmp_path / run)

    with pytest.warns(RuntimeWarning, match="never went through backward while the update's others did"):
        rows = loop("evaluated", copied=False)
    assert sorted((row["step"], row["micro"]) for row in rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copies = loop("copied", copied=True)
    assert sorted((row["step"], row["micro"]) for row in copies) == [(s, m) for s in (0, 1) for m in (0, 1, 2)]


def test_a_loss_recorded_under_no_grad_is_no_microbatch_of_the_update_it_falls_in(tmp_path: Path) -> None:
    """A loss helper that always records, called for an evaluation under torch.no_grad() between updates: that record
    would be microbatch 0 of the next update (its n in N, no probe). It is left out (with one warning) where the
    update's other records went through backward; the run is a correct token mean."""
    weight = torch.ones(4, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    masks = [torch.tensor([True, True, True, False]), torch.tensor([True, False, False, False])]  # N = 4

    def loss_of(rec: Recorder, valid: torch.Tensor, tokens: int) -> torch.Tensor:
        per_token = rec.probe(weight * torch.arange(1.0, 5.0), valid)
        loss_sum = (per_token * valid).sum()
        scalar = loss_sum / tokens
        rec.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=scalar)
        return scalar

    with pytest.warns(RuntimeWarning, match="never went through backward"):
        with Recorder(tmp_path, run_id="evaluated", optimizer=optimizer) as rec:
            for step in range(4):
                for valid in masks:
                    loss_of(rec, valid, 4).backward()
                optimizer.step()
                optimizer.zero_grad()
                if step in (0, 2):
                    with torch.no_grad():
                        loss_of(rec, torch.tensor([True, True, False, False]), 2)
    rows = read_rows(tmp_path / "evaluated")
    assert sorted((r["step"], r["valid_tokens"]) for r in rows) == [(s, n) for s in range(4) for n in (1, 3)]
    assert tokaudit.audit([tmp_path / "evaluated"]).verdicts == {"evaluated": "correct"}


def test_a_term_recorded_after_backward_under_no_grad_is_kept_beside_one_recorded_before(tmp_path: Path) -> None:
    """Term "main" recorded before backward (b requires grad, seen in backward), term "aux" recorded after it in a
    no_grad metrics block with a detached b: aux was trained on, and a record is left out as never trained only
    where records of its own term were seen. Here aux divides each microbatch by its own count (a local mean), which
    the audit must then still see."""
    weight = torch.ones(4, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    masks = [torch.tensor([True, True, True, False]), torch.tensor([True, False, False, False])]  # N = 4
    with Recorder(tmp_path, run_id="metrics", optimizer=optimizer) as rec:
        for _ in range(2):
            for valid in masks:
                per_token = weight * torch.arange(1.0, 5.0)
                main_sum, aux_sum = (per_token * valid).sum(), (per_token * 2 * valid).sum()
                scalar, aux_scalar = main_sum / 4, aux_sum / valid.sum()
                rec.record(loss_sum=main_sum, valid_tokens=valid.sum(), backward_scalar=scalar, term="main")
                (scalar + aux_scalar).backward()
                with torch.no_grad():
                    rec.record(aux_sum.detach(), valid.sum(), aux_scalar.detach(), term="aux")
            optimizer.step()
            optimizer.zero_grad()
    assert sorted((r["step"], r["term"]) for r in read_rows(tmp_path / "metrics")) == [
        (s, t) for s in (0, 1) for t in ("aux", "aux", "main", "main")
    ]
    report = tokaudit.audit([tmp_path / "metrics"])
    assert report.verdicts == {"metrics": "incorrect"} and {(f.code.value, f.term) for f in report.findings} == {
        ("local_mean", "aux")
    }


@pytest.mark.parametrize("flush_every", [4096, 3])
def test_a_step_counter_reset_each_epoch_is_named_in_the_duplicates(tmp_path: Path, flush_every: int) -> None:
    """A loop that gives the recorder each epoch's batch index as the step records every epoch's updates under the
    same steps. Where the copies share a shard (one process wrote it) the finding says the step went back; where
    an epoch starts a new shard it lists that beside a re-launch and a resume. Either way the fix names the step."""
    from tokaudit import audit
    from tokaudit.codes import Code

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, run_id="epochs", optimizer=optimizer, flush_every=flush_every) as rec:
        for _epoch in range(2):
            for batch in range(3):
                rec.begin_step(batch)  # the mistake: the epoch's batch index, not the global step
                x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
                loss_sum = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
                rec.record(loss_sum=loss_sum, valid_tokens=5, backward_scalar=loss_sum / 5)
                (loss_sum / 5).backward()
                optimizer.step()
                optimizer.zero_grad()
    (finding,) = [f for f in audit([tmp_path]).findings if f.code == Code.DUPLICATE_RECORDS]
    assert finding.evidence["dropped_records"] == 3 and finding.evidence["in_one_file"] is (flush_every > 3)
    said = "the step it was given went back" if flush_every > 3 else "a step that went back"
    assert said in finding.message and "global step" in finding.fix


def test_a_backward_recorded_twice_is_kept_once_with_one_warning(tmp_path: Path) -> None:
    """record() called twice with the same backward_scalar (a loop that records before and after backward): the
    second call would be read as a second microbatch, each token then weighing 2/N, a W applied twice. It is left
    out with one warning, and the run is correct."""
    from tokaudit import audit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="twice", optimizer=optimizer, announce=False) as rec:
            for _ in range(3):
                x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
                loss_sum = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
                b = loss_sum / 5
                rec.record(loss_sum=loss_sum, valid_tokens=5, backward_scalar=b)
                b.backward()
                rec.record(loss_sum=loss_sum, valid_tokens=5, backward_scalar=b)  # again, after backward
                optimizer.step()
                optimizer.zero_grad()
    said = [str(w.message) for w in caught if "twice" in str(w.message)]
    assert len(said) == 1 and "left out" in said[0]
    assert [(r["step"], r["micro"]) for r in read_rows(tmp_path / "twice")] == [(0, 0), (1, 0), (2, 0)]
    report = audit([tmp_path / "twice"])
    assert report.findings == [] and report.runs[0].verdict == "correct"


@pytest.mark.parametrize("flush_every", [1, 2, 4096])
def test_a_microbatch_recorded_before_its_backward_is_kept_whatever_the_shard_size(
    tmp_path: Path, flush_every: int
) -> None:
    """Two microbatches an update, each recorded before its backward: with shards of one record the buffer passed
    twice a shard before the second microbatch's backward, and that record was left out as one that never
    trained (a false warning, and a false incorrect). Every record is kept, without a warning."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="small", optimizer=optimizer, flush_every=flush_every, announce=False) as rec:
            for _ in range(3):
                batches = [(torch.randn(5, 4), torch.randint(0, 3, (5,))) for _ in range(2)]
                for x, y in batches:
                    loss_sum = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
                    b = loss_sum / 10  # N = 10 over the update's two microbatches
                    rec.record(loss_sum=loss_sum, valid_tokens=5, backward_scalar=b)
                    b.backward()
                optimizer.step()
                optimizer.zero_grad()
    assert not [w for w in caught if "tokaudit" in str(w.message)], [str(w.message) for w in caught]
    rows = read_rows(tmp_path / "small")
    assert sorted((r["step"], r["micro"]) for r in rows) == [(s, m) for s in range(3) for m in range(2)]


def test_a_probe_called_under_no_grad_leaves_the_loss_trainable_and_says_so(tmp_path: Path) -> None:
    """probe() inside torch.no_grad() (a loop that wraps its bookkeeping so): its output would hold no gradient and
    the backward after it would raise. It returns its input, one warning says it measured nothing there, and
    training goes on as without the recorder."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="nograd", announce=False) as rec:
            per_token = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            with torch.no_grad():
                probed = rec.probe(per_token, torch.ones(5, dtype=torch.bool))
            assert probed is per_token and probed.requires_grad
            loss_sum = probed.sum()
            rec.record(loss_sum=loss_sum, valid_tokens=5, backward_scalar=loss_sum / 5)
            (loss_sum / 5).backward()
    assert model.weight.grad is not None
    assert sum("no_grad" in str(w.message) for w in caught) == 1
    (row,) = read_rows(tmp_path / "nograd")
    assert row["token_weight_sum"] is None  # nothing measured: the record is judged from b/S


def test_numpy_numbers_and_zero_dimensional_arrays_are_recorded_as_numbers(tmp_path: Path) -> None:
    """A loop computing its counts and sums with numpy: 0-d arrays and numpy scalars are the numbers they hold
    (Arrow takes no 0-d array: every record was lost at the flush)."""
    import numpy as np

    with Recorder(tmp_path, run_id="numpy", announce=False) as rec:
        rec.record(loss_sum=np.array(6.0), valid_tokens=np.array(4), backward_scalar=np.float64(1.5))
        rec.record(loss_sum=np.float32(2.0), valid_tokens=np.int64(2), backward_scalar=np.array([0.5]))
    rows = read_rows(tmp_path / "numpy")
    assert [(r["loss_sum"], r["valid_tokens"], r["backward_scalar"]) for r in rows] == [(6.0, 4, 1.5), (2.0, 2, 0.5)]


def test_a_relaunch_under_the_same_run_id_replaces_the_earlier_launch_s_steps_whole(tmp_path: Path) -> None:
    """A run launched with 4 microbatches an update, then launched again into the same folder under the same run id
    with 2: each launch trains the token mean of its own updates. The later launch's steps are its own records
    alone; the earlier launch's microbatches 2 and 3, which no later record repeats, are no part of them (kept,
    they made the steps' weights differ: a wrong verdict on a right run)."""
    from tokaudit import audit

    def launch(microbatches: int) -> None:
        torch.manual_seed(microbatches)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the folder already holds shards: said, and tested elsewhere
            with Recorder(tmp_path, run_id="again", optimizer=optimizer, announce=False) as rec:
                for _ in range(3):
                    counts = [2 + 3 * m for m in range(microbatches)]
                    for n in counts:
                        x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
                        loss_sum = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
                        b = loss_sum / sum(counts)  # W = 1: S/N over the update's microbatches
                        rec.record(loss_sum=loss_sum, valid_tokens=n, backward_scalar=b)
                        b.backward()
                    optimizer.step()
                    optimizer.zero_grad()

    launch(4)
    launch(2)
    report = audit([tmp_path / "again"])
    (finding,) = report.findings
    assert finding.code.value == "duplicate_records"
    assert report.runs[0].verdict == "correct" and report.runs[0].microbatches == 2
    # said, not left out in silence: microbatches 0–1 of 3 updates repeated, 2–3 of the earlier launch superseded
    assert (finding.evidence["dropped_records"], finding.evidence["superseded_records"]) == (6, 6)
    assert "6 more record(s) of the earlier launch's" in finding.message


def test_an_update_a_launch_stopped_inside_and_a_later_launch_redid_is_judged(tmp_path: Path) -> None:
    """A launch closed inside update 3 (its first microbatch recorded, never stepped: the recorder notes it
    unfinished), then the run launched again into the same folder and trained updates 0–3 whole: update 3 is the
    later launch's, complete, and judged; the earlier launch's note no longer leaves it out. A launch that stops
    inside an update no later launch redid still has it left out."""
    from tokaudit import audit

    def launch(updates: int, stop_inside: bool) -> None:
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the folder already holds shards: said, and tested elsewhere
            with Recorder(tmp_path, run_id="redone", optimizer=optimizer, announce=False) as rec:
                for update in range(updates + stop_inside):
                    for n in (2, 7)[: 1 if update == updates else 2]:
                        x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
                        loss_sum = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
                        rec.record(loss_sum=loss_sum, valid_tokens=n, backward_scalar=loss_sum / 9)
                        (loss_sum / 9).backward()
                    if update < updates:
                        optimizer.step()
                        optimizer.zero_grad()

    launch(3, stop_inside=True)
    report = audit([tmp_path / "redone"])
    assert [f.code.value for f in report.findings] == ["unfinished_update"] and report.runs[0].steps == 3
    launch(4, stop_inside=False)
    report = audit([tmp_path / "redone"])
    assert [f.code.value for f in report.findings] == ["duplicate_records"], report.findings
    assert report.runs[0].verdict == "correct" and report.runs[0].steps == 4
    launch(4, stop_inside=True)  # a third launch stops inside update 4, which nobody redid
    report = audit([tmp_path / "redone"])
    assert sorted((f.code.value, f.steps.first) for f in report.findings)[-1] == ("unfinished_update", 4)
    assert report.runs[0].verdict == "correct" and report.runs[0].steps == 4


def test_a_model_given_to_the_recorder_saves_and_copies_as_it_did(tmp_path: Path) -> None:
    """The recorder watches `model.zero_grad` from an attribute of the model: `torch.save(model)` still pickles it,
    and a copy (an EMA model) clears its own gradients, not the original's, and holds nothing of the recorder."""
    import copy
    import io

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(tmp_path, run_id="saved", model=model, optimizer=optimizer, announce=False):
        assert "zero_grad" in vars(model)  # (what is watched)
        model(torch.randn(4, 3)).sum().backward()
        torch.save(model, io.BytesIO())
        ema = copy.deepcopy(model)
        ema.zero_grad()
        assert model.weight.grad is not None and ema.weight.grad is None
        assert "zero_grad" not in vars(ema) or vars(ema)["zero_grad"].__self__ is ema
