"""The recorder under faults: kills, signals, failing and full disks, two writers, bad values, a
Recorder made before the process group. Records made are counted against records read back."""

from __future__ import annotations

import math

import errno
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.logs import read_rows
from tokaudit._auditing import audit
from tokaudit.hooks import Recorder

ROOT = Path(__file__).resolve().parents[2]


def token_mean_records(rec: Recorder, steps: range, counts: tuple[int, int] = (3, 5)) -> None:
    """One process (W = 1), one microbatch per step, b = S/N: a correct log."""
    for step in steps:
        n = counts[step % 2]
        rec.record(loss_sum=2.0 * n, valid_tokens=n, backward_scalar=2.0, step=step)


def test_two_writers_of_one_rank_lose_nothing(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = Recorder(tmp_path, run_id="clash", flush_every=3)
        second = Recorder(tmp_path, run_id="clash", flush_every=3)
        for step in range(40):
            (first if step % 2 else second).record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0, step=step // 2)
        first.close()
        second.close()
    # the second writer to reach the folder finds the first one's shards from step 0: said once
    assert len([w for w in caught if "already holds shards of rank-00000" in str(w.message)]) == 1
    rows = read_rows(tmp_path / "clash")
    assert len(rows) == 40, "a shard was replaced"
    assert {f.code.value for f in audit([tmp_path / "clash"]).findings} >= {"duplicate_records"}


def test_one_bad_value_costs_one_record_and_is_written_down(tmp_path: Path) -> None:
    bad_values: list[dict[str, Any]] = [
        {"loss_sum": "2.0"},
        {"valid_tokens": [3]},
        {"backward_scalar": torch.ones(3)},
        {"valid_tokens": 1 << 70},
        {"valid_tokens": None},
        {"valid_tokens": -4},
        {"loss_sum": None},
        {"grad_scale": float("nan")},
        {"valid_tokens": 1 << 40},  # fits in 64 bits, not in the step table's 32: the auditor refuses it
        {"valid_tokens": True},  # a bool Arrow will not put in int64: the whole flush's table failed
        {"skipped": "no"},  # was written as True
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="bad", flush_every=4096) as rec:
            token_mean_records(rec, range(0, 10))
            for step, bad in enumerate(bad_values, start=10):
                good = {"loss_sum": 6.0, "valid_tokens": 3, "backward_scalar": 2.0, "step": step}
                rec.record(**{**good, **bad})
                rec.record(**{**good, "step": step + 100})
            token_mean_records(rec, range(200, 210))
    rows = read_rows(tmp_path / "bad")
    assert len(rows) == 10 + len(bad_values) + 10, "only the bad records are left out"
    assert {r["step"] for r in rows} & set(range(10, 10 + len(bad_values))) == set()
    assert sum("dropped" in str(w.message) or "left out" in str(w.message) for w in caught) <= 3, "warned once each"
    report = audit([tmp_path / "bad"])
    assert {f.code.value for f in report.findings} == {"records_dropped"} and report.runs[0].verdict == "inconclusive"
    finding = report.findings[0]
    assert finding.evidence["records"] == len(bad_values)
    assert finding.evidence["steps"] == list(range(10, 10 + len(bad_values)))


def test_values_given_beside_the_records_and_steps_of_numpy_are_taken_or_refused_alone(tmp_path: Path) -> None:
    """report_loss() and scale_grads() of a numpy number are the number it holds; of a list, a string or a tensor of
    several, refused with one warning, the records kept (they failed the whole flush's table, or a tensor of two
    spread its numbers over two records). A step or microbatch index of numpy or tensor integers is the number it
    holds, as begin_step takes it (the record was dropped). A record after close() is said once."""
    import numpy as np

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="values", flush_every=4096) as rec:
            for step, (loss, factor) in enumerate(
                [(np.array(1.5), np.array(1.0)), ("1.5", [1.0]), (torch.tensor([1.5, 2.5]), np.float32(1.0))]
            ):
                rec.begin_step(step)
                for micro in range(2):
                    rec.record(
                        loss_sum=6.0,
                        valid_tokens=3,
                        backward_scalar=1.0,
                        step=np.int64(step),
                        micro=torch.tensor(micro),
                    )
                rec.scale_grads(factor)
                rec.report_loss(loss)
        rec.record(loss_sum=6.0, valid_tokens=3, backward_scalar=1.0, step=9)
    rows = read_rows(tmp_path / "values")
    assert [(r["step"], r["micro"], r["reported_loss"], r["grad_scale"]) for r in rows] == [
        (0, 0, 1.5, 1.0),
        (0, 1, 1.5, 1.0),
        (1, 0, None, None),
        (1, 1, None, None),
        (2, 0, None, 1.0),
        (2, 1, None, 1.0),
    ]
    said = [str(w.message) for w in caught]
    assert sum("report_loss() left out" in s for s in said) == 1 and sum("gradient rescale" in s for s in said) == 1
    assert sum("record() after close()" in s for s in said) == 1


def test_numbers_no_column_holds_cost_their_own_record_or_value_never_the_flush(tmp_path: Path) -> None:
    """A numpy complex count, a complex reported loss, a NaN rescale and a step past 64 bits each lost every record
    of the flush or of its update (a complex passed the check as a numpy scalar; the step failed the table)."""
    import numpy as np

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="numbers", flush_every=4096) as rec:
            for step in range(4):
                rec.begin_step(step if step != 2 else 1 << 70)
                rec.record(loss_sum=6.0, valid_tokens=3, backward_scalar=1.0)
                rec.record(loss_sum=6.0, valid_tokens=np.complex128(3) if step == 0 else 3, backward_scalar=1.0)
                rec.report_loss(np.complex128(2.0) if step == 1 else 2.0)
                rec.scale_grads(float("nan") if step == 3 else 1.0)
    rows = read_rows(tmp_path / "numbers")
    assert len(rows) == 7 and sorted({r["step"] for r in rows}) == [0, 1, 2, 3]
    assert [r["reported_loss"] for r in rows if r["step"] == 1] == [None, None]
    assert {r["grad_scale"] for r in rows if r["step"] != 3} == {1.0}
    assert {r["grad_scale"] for r in rows if r["step"] == 3} == {None}


def test_an_impossible_number_of_positions_is_written_as_null_and_the_record_kept(tmp_path: Path) -> None:
    """T below n, negative, not whole or past 2³¹ − 1 would make the auditor refuse the whole shard: the
    recorder writes that T as null, keeps the record (and every good T), and warns once."""
    impossible = [2, -1, 3.5, 1 << 40]  # n = 3 on every record
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="positions", flush_every=4096) as rec:
            for step in range(12):
                rec.record(
                    loss_sum=6.0,
                    valid_tokens=3,
                    backward_scalar=2.0,
                    step=step,  # b = S/N
                    positions=impossible[step] if step < len(impossible) else 3 + step % 2 * 5.0,
                )
    rows = read_rows(tmp_path / "positions")
    assert [r["positions"] for r in sorted(rows, key=lambda r: r["step"])] == [None] * 4 + [3, 8] * 4
    assert sum("positions" in str(w.message) for w in caught) == 1
    report = audit([tmp_path / "positions"])
    assert not report.problems and not report.findings and report.runs[0].verdict == "correct"


def _failing_writes(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[int]:
    import tokaudit.hooks._shards as shards

    original = shards.pq.write_table
    attempts = [0]

    def write_table(*args: Any, **kwargs: Any) -> Any:
        attempts[0] += 1
        if attempts[0] <= failures:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(*args, **kwargs)

    monkeypatch.setattr(shards.pq, "write_table", write_table)
    return attempts


def test_a_disk_full_for_half_the_run_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """600 records flushed every 8; the disk is full for the first 40 flushes (the first half of the run), then
    free: the backlog (bounded in bytes, not in shards) keeps them, and every record is written once space is
    back, each once."""
    attempts = _failing_writes(monkeypatch, failures=40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="half", flush_every=8) as rec:
            for step in range(600):
                rec.record(loss_sum=2.0, valid_tokens=2, backward_scalar=1.0, step=step)
    assert attempts[0] > 40
    assert sorted(row["step"] for row in read_rows(tmp_path / "half")) == list(range(600))
    assert not [w for w in caught if "could not be written" in str(w.message) or "dropped" in str(w.message)]


def test_a_full_disk_loses_nothing_once_space_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_writes(monkeypatch, failures=3)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="full", flush_every=2) as rec:
            token_mean_records(rec, range(20))
    rows = read_rows(tmp_path / "full")
    assert sorted(r["step"] for r in rows) == list(range(20))
    report = audit([tmp_path / "full"])
    assert report.findings == [] and report.runs[0].verdict == "correct"


def test_a_long_outage_is_written_down_and_those_steps_are_not_judged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two ranks of W = 2; rank 1's disk is full for its first 12 flushes: the backlog (made 1 KiB here, three
    # tables of 2 records) cannot hold it all, so its oldest steps are dropped and noted.
    import tokaudit.hooks._identity as identity
    import tokaudit.hooks._uploads as uploads

    for rank in range(2):
        attempts = _failing_writes(monkeypatch, failures=12 if rank == 1 else 0)
        monkeypatch.setattr(uploads, "BACKLOG_BYTES", 1024)
        # this process records as rank `rank` of 2, as it would in a process group of two
        monkeypatch.setattr(identity, "resolve_identity", lambda group, rank=rank: identity.Identity(rank, 2, "0"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rec = Recorder(tmp_path, run_id="outage", flush_every=2, grad_divisor=2.0)
            for step in range(40):
                n = 3 + rank * 4
                rec.record(loss_sum=2.0 * n, valid_tokens=n, backward_scalar=2 * 2.0 * n / 10, step=step)
            rec.close()
        monkeypatch.undo()
        assert attempts[0] > 0
    rows = read_rows(tmp_path / "outage")
    assert {r["rank"] for r in rows} == {0, 1}
    kept = {r["step"] for r in rows if r["rank"] == 1}
    lost = set(range(40)) - kept
    assert lost, "the outage outlasted the backlog"
    report = audit([tmp_path / "outage"])
    codes = {f.code.value for f in report.findings}
    assert codes == {"records_dropped"}, codes  # no missing_rank, no false scale_mismatch
    finding = report.findings[0]
    assert finding.evidence["steps"] == sorted(lost) and finding.evidence["records"] == len(lost)
    assert report.runs[0].verdict == "inconclusive" and report.runs[0].steps == 40 - len(lost)


def terminate_when(script_text: str, tmp_path: Path, line: str, *args: str) -> int:
    """Run a recording script (its log folder is tmp_path), send SIGTERM once it prints `line`,
    and return its exit code."""
    script = tmp_path / "job.py"
    script.write_text(script_text.format(root=str(ROOT)))
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path), *args], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == line
        child.send_signal(signal.SIGTERM)
        return child.wait(timeout=30)
    finally:
        child.kill()


SIGNAL_SCRIPT = textwrap.dedent("""
    import signal, sys, time
    sys.path.insert(0, {root!r})
    from tokaudit.hooks import Recorder
    marker = sys.argv[2]
    if sys.argv[3] == "trainer":
        def handler(signum, frame):  # the trainer's own handler: must still run
            open(marker, "w").write("trainer handler ran")
            sys.exit(0)
        signal.signal(signal.SIGTERM, handler)
    rec = Recorder(sys.argv[1], run_id="signal", flush_every=100_000)
    for step in range(700):
        rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=0.5, step=step)
    print("ready", flush=True)
    time.sleep(60)
""")


@pytest.mark.slow
@pytest.mark.parametrize("handler", ["trainer", "default"])
def test_sigterm_flushes_every_record_and_keeps_the_trainers_handler(tmp_path: Path, handler: str) -> None:
    marker = tmp_path / "marker"
    code = terminate_when(SIGNAL_SCRIPT, tmp_path, "ready", str(marker), handler)
    assert len(read_rows(tmp_path / "signal")) == 700, "records lost on SIGTERM"
    if handler == "trainer":
        assert code == 0 and marker.read_text() == "trainer handler ran"
    else:
        assert code == -signal.SIGTERM, "the default action still ends the process"


FORKED_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    from tokaudit.hooks import Recorder
    rec = Recorder(sys.argv[1], run_id="forked", flush_every=100_000)
    for step in range(700):
        rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=0.5, step=step)
    child = os.fork()  # a DataLoader's worker: the handler and a copy of the records, inherited
    if child == 0 and sys.argv[2] == "exit":
        sys.exit(0)  # its interpreter's exit runs the recorder's at-exit close, in the child
    if child == 0 and sys.argv[2] == "flush":
        rec.flush()  # a worker_init_fn that flushes
        os._exit(0)
    if child == 0:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C reaches the whole process group
            time.sleep(5)
        except KeyboardInterrupt:
            pass
        os._exit(0)
    os.waitpid(child, 0)
    rec.close()
""")


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["signal", "exit", "flush"])
def test_a_signal_in_a_forked_worker_writes_none_of_the_parent_s_records(tmp_path: Path, ending: str) -> None:
    script = tmp_path / "job.py"
    script.write_text(FORKED_SCRIPT.format(root=str(ROOT)))
    subprocess.run([sys.executable, str(script), str(tmp_path), ending], check=True, timeout=60)
    assert len(list((tmp_path / "forked").glob("*.parquet"))) == 1
    assert len(read_rows(tmp_path / "forked")) == 700


KILL_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from tokaudit.hooks import Recorder
    rec = Recorder(sys.argv[1], run_id="killed", flush_every=50)
    step = 0
    while True:
        rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=0.5, step=step)
        step += 1
        if step % 50 == 0:
            print(step, flush=True)
""")


@pytest.mark.slow
def test_sigkill_during_flushes_leaves_only_whole_shards(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(KILL_SCRIPT.format(root=str(ROOT)))
    child = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        flushed = 0
        while flushed < 2000:
            flushed = int(child.stdout.readline())
        child.kill()
        child.wait(timeout=30)
    finally:
        child.kill()
    rows = read_rows(tmp_path / "killed")  # every published shard reads whole
    assert len(rows) >= flushed - 50 and len(rows) % 50 == 0
    assert sorted(r["step"] for r in rows) == list(range(len(rows)))
    report = audit([tmp_path / "killed"])
    assert report.problems == []
    # The next start of this rank removes what the killed writer left behind, at its first shard (the rank,
    # and so the names that are its own, is known from the first record on)
    with Recorder(tmp_path, run_id="killed") as again:
        again.record(loss_sum=1.0, valid_tokens=1, backward_scalar=0.5, step=len(rows))
    assert not list((tmp_path / "killed").glob(".*.tmp"))


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path: Path) -> None:
    folder = tmp_path / "stale"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = folder / f".rank-00000-000000.parquet.{int(dead.stdout)}.tmp"
    leftover.write_bytes(b"PAR1 half a shard")
    with Recorder(tmp_path, run_id="stale") as rec:
        rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=1.0)
    assert not leftover.exists() and len(read_rows(folder)) == 1


def test_recorded_values_are_snapshots(tmp_path: Path) -> None:
    accumulator = torch.zeros(())
    count = torch.tensor(3)
    with Recorder(tmp_path, run_id="snap") as rec:
        accumulator += 2.5
        rec.record(loss_sum=accumulator, valid_tokens=count, backward_scalar=accumulator / 3)
        accumulator += 100.0  # changed in place before the flush
        count += 7
    (row,) = read_rows(tmp_path / "snap")
    assert row["loss_sum"] == 2.5 and row["valid_tokens"] == 3


def test_evaluation_with_grad_takes_no_microbatch_and_no_term(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.tensor([0, 1, 2, -100])
    with Recorder(tmp_path, run_id="eval", optimizer=optimizer) as rec, rec.capture_cross_entropy():
        for step in range(2):
            for micro in range(2):
                F.cross_entropy(model(torch.randn(4, 4)), labels.clone())  # an evaluation with grad, never used
                F.cross_entropy(model(torch.randn(4, 4)), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
    rows = read_rows(tmp_path / "eval")
    assert [(r["step"], r["term"], r["micro"]) for r in rows] == [(0, "0", 0), (0, "0", 1), (1, "0", 0), (1, "0", 1)]


def test_a_captured_loop_that_fails_inside_an_update_leaves_that_update_out(tmp_path: Path) -> None:
    """capture_cross_entropy, 3 microbatches an update; an error after 2 of update 1's were backpropagated, before
    its optimizer step: the update under way is unfinished and left out, as with probe and record (a captured record
    is numbered at its backward, so its index said nothing, and the partial update was judged: q = 2/3)."""
    from tokaudit import audit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = [torch.tensor([0, 1, 2, -100]), torch.tensor([0, -100, -100, 1]), torch.tensor([2, 2, 2, 2])]  # N = 9
    with Recorder(tmp_path, run_id="failed", optimizer=optimizer, announce=False) as rec, rec.capture_cross_entropy():
        try:
            for step in range(2):
                for micro in range(3):
                    if (step, micro) == (1, 2):
                        raise RuntimeError("out of memory")
                    x = torch.randn(4, 4, dtype=torch.float64)
                    (F.cross_entropy(model(x), labels[micro], reduction="sum") / 9).backward()
                optimizer.step()
                optimizer.zero_grad()
        except RuntimeError:
            pass
    report = audit([tmp_path / "failed"])
    assert [(f.code.value, f.steps.first) for f in report.findings] == [("unfinished_update", 1)]
    assert (report.runs[0].verdict, report.runs[0].steps) == ("correct", 1)


@pytest.mark.parametrize("order", ["watched_first", "other_first"])
def test_a_guard_s_skip_reads_skipped_beside_a_second_optimizer(tmp_path: Path, order: str) -> None:
    """Two optimizers on one model (a split learning rate), both stepping every update, the recorder watching one; a
    NaN guard skips both steps of update 2 and clears through the model. That update reads skipped, the others applied:
    the second optimizer's step after the watched one's, which closed its update, applies nothing of the next (it did,
    and the skipped update was judged: nonfinite_values)."""
    from tokaudit import audit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, dtype=torch.float64)
    watched = torch.optim.SGD([model.weight], lr=0.1)
    other = torch.optim.SGD([model.bias], lr=0.1)
    labels = [torch.tensor([0, 1, 2, -100]), torch.tensor([0, -100, -100, 1])]  # N = 5
    with Recorder(tmp_path, run_id=order, model=model, optimizer=watched, announce=False) as rec:
        with rec.capture_cross_entropy():
            for step in range(4):
                for micro in range(2):
                    loss = F.cross_entropy(
                        model(torch.randn(4, 4, dtype=torch.float64)), labels[micro], reduction="sum"
                    )
                    (loss / 5 * (math.nan if step == 2 else 1.0)).backward()
                if step != 2:  # the guard: no step where a gradient is not finite
                    for optimizer in (watched, other) if order == "watched_first" else (other, watched):
                        optimizer.step()
                model.zero_grad()
    assert sorted({(r["step"], r["skipped"]) for r in read_rows(tmp_path / order)}) == [
        (0, False),
        (1, False),
        (2, True),
        (3, False),
    ]
    assert audit([tmp_path / order]).runs[0].verdict == "correct"


def test_an_evaluation_with_grad_after_the_last_step_leaves_no_update_unfinished(tmp_path: Path) -> None:
    """An evaluation with gradients after each optimizer step, the last one's before close(): no microbatch of an
    update, so the run did not stop inside one (the footers said update 2 was unfinished, and the audit said the run
    stopped there)."""
    from tokaudit import audit

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = torch.tensor([0, 1, 2, -100])
    with Recorder(tmp_path, run_id="eval", optimizer=optimizer, announce=False) as rec, rec.capture_cross_entropy():
        for step in range(2):
            (F.cross_entropy(model(torch.randn(4, 4)), labels, reduction="sum") / 3).backward()
            optimizer.step()
            optimizer.zero_grad()
            F.cross_entropy(model(torch.randn(4, 4)), labels)  # an evaluation with grad, never backpropagated
    report = audit([tmp_path / "eval"])
    assert report.findings == [] and (report.runs[0].verdict, report.runs[0].steps) == ("correct", 2)


DURING_FLUSH_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import tokaudit.hooks._shards as shards
    from tokaudit.hooks import Recorder
    original = shards.pq.write_table
    def slow(*args, **kwargs):  # a slow disk: the signal lands in the middle of a flush
        print("writing", flush=True)
        time.sleep(1.5)
        return original(*args, **kwargs)
    shards.pq.write_table = slow
    rec = Recorder(sys.argv[1], run_id="during", flush_every=100)
    for step in range(130):
        rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=0.5, step=step)
    time.sleep(60)
""")


@pytest.mark.slow
def test_sigterm_during_a_flush_waits_for_it_and_writes_each_record_once(tmp_path: Path) -> None:
    code = terminate_when(DURING_FLUSH_SCRIPT, tmp_path, "writing")
    assert code == -signal.SIGTERM
    steps = sorted(r["step"] for r in read_rows(tmp_path / "during"))
    assert steps == list(range(100)), "the shard in flight is whole and written once"


def test_a_failed_write_is_retried_alone_even_when_asking_the_store_about_it_fails() -> None:
    """A write failed; at the next flush the store cannot even say whether that write landed: the failed tables stay
    apart, so that the retry publishes them alone, under the name they had, and what came since after them."""
    import pyarrow as pa

    from tokaudit.hooks._uploads import Backlog

    written: list[int] = []

    class Store:
        down, cannot_tell = True, True

        def landed(self) -> bool:
            if self.cannot_tell:
                raise OSError("the store does not answer")
            return False

        def write(self, table: pa.Table, metadata: object) -> None:
            if self.down:
                raise OSError("the store does not answer")
            written.append(table.num_rows)

    store = Store()
    backlog = Backlog(lambda key, message: None, "s3://bucket/runs")
    backlog.add(pa.table({"step": [0, 1]}))
    assert backlog.write(lambda: store, lambda dropped: {}) is not None
    backlog.add(pa.table({"step": [2]}))
    assert backlog.write(lambda: store, lambda dropped: {}) is not None
    store.down = store.cannot_tell = False
    assert backlog.write(lambda: store, lambda dropped: {}) is None
    assert written == [2, 1]


INTERRUPTED_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import torch
    from tokaudit.hooks import Recorder
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(sys.argv[1], run_id="stopped", optimizer=optimizer, announce=False)
    for update in range(4):
        counts = (2, 7)  # the update's N = 9 over its two microbatches, counted before the first backward
        for micro, n in enumerate(counts):
            x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
            loss_sum = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
            rec.record(loss_sum=loss_sum, valid_tokens=n, backward_scalar=loss_sum / sum(counts))
            (loss_sum / sum(counts)).backward()
            if update == int(sys.argv[2]) and micro == 0:
                print("inside", flush=True)  # SIGTERM now: the update's second microbatch never comes
                time.sleep(60)
        optimizer.step()
        optimizer.zero_grad()
""")


@pytest.mark.slow
@pytest.mark.parametrize("stopped", [3, 0], ids=["inside update 3", "inside the first update"])
def test_a_job_stopped_inside_an_update_is_judged_on_the_updates_before_it(tmp_path: Path, stopped: int) -> None:
    """SIGTERM between the two microbatches of an update of a correct loop: the log holds that update's first
    microbatch alone (N over it is not the update's: its weights would read 2/9 of 1/N, scale_mismatch). The
    recorder says the update was never stepped; the audit leaves it out (unfinished_update, information) and the run
    is correct on the updates before it; stopped inside its first update, it has none, and is inconclusive."""
    from tokaudit import audit

    code = terminate_when(INTERRUPTED_SCRIPT, tmp_path, "inside", str(stopped))
    assert code == -signal.SIGTERM
    assert sorted({(r["step"], r["micro"]) for r in read_rows(tmp_path / "stopped")})[-1] == (stopped, 0)
    report = audit([tmp_path / "stopped"])
    assert [(f.code.value, f.steps.first) for f in report.findings] == [("unfinished_update", stopped)]
    assert (report.runs[0].verdict, report.runs[0].steps) == (("correct", 3) if stopped else ("inconclusive", 0))


PREEMPTION_FLAG_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    import torch
    from tokaudit.hooks import Recorder
    torch.manual_seed(0)
    notices = []
    signal.signal(signal.SIGTERM, lambda signum, frame: notices.append(signum))  # a preemption notice: go on
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(sys.argv[1], run_id="noticed", optimizer=optimizer, announce=False)
    for update in range(4):
        counts = (2, 7)
        for micro, n in enumerate(counts):
            x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
            loss_sum = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
            rec.record(loss_sum=loss_sum, valid_tokens=n, backward_scalar=loss_sum / sum(counts))
            (loss_sum / sum(counts)).backward()
            if update == 1 and micro == 0:
                os.kill(os.getpid(), signal.SIGTERM)
        optimizer.step()
        optimizer.zero_grad()
    rec.close()
    assert notices == [signal.SIGTERM]
""")


@pytest.mark.slow
def test_a_sigterm_whose_handler_lets_training_go_on_ends_no_update(tmp_path: Path) -> None:
    """A trainer's SIGTERM handler that notes the notice and returns (a preemption flag, checked at a later step):
    the update under way goes on and is stepped. The recorder wrote what was closed at the signal, and said no
    update was left unstepped (it said update 1 was, and the audit left it out as unfinished_update)."""
    from tokaudit import audit

    script = tmp_path / "job.py"
    script.write_text(PREEMPTION_FLAG_SCRIPT.format(root=str(ROOT)))
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, timeout=60)
    assert len(read_rows(tmp_path / "noticed")) == 8
    report = audit([tmp_path / "noticed"])
    assert [f.code.value for f in report.findings] == []
    assert (report.runs[0].verdict, report.runs[0].steps) == ("correct", 4)


def test_an_update_dropped_on_an_error_between_record_and_backward_is_not_judged(tmp_path: Path) -> None:
    """The loop's usual guard: a microbatch that fails (an out-of-memory error, simulated) after its loss was
    recorded, the gradients cleared, the update never stepped. Every update stepped is the token mean (the float64
    reference of ΣS/N over its tokens); the dropped one changed no weight, so its partial records are not judged."""
    from tokaudit import audit

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counts = (2, 5, 3)
    agree = []
    with (
        warnings.catch_warnings(record=True) as caught,
        Recorder(tmp_path, run_id="guarded", model=model, optimizer=optimizer, announce=False) as rec,
    ):
        warnings.simplefilter("always")
        for update in range(4):
            batches = [(torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))) for n in counts]
            try:
                for micro, (x, y) in enumerate(batches):
                    losses = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
                    loss_sum = rec.probe(losses, torch.ones_like(y, dtype=torch.bool)).sum()  # the weights measured
                    rec.record(loss_sum=loss_sum, valid_tokens=len(y), backward_scalar=loss_sum / sum(counts))
                    if update == 2 and micro == 1:
                        raise RuntimeError("out of memory (simulated)")
                    (loss_sum / sum(counts)).backward()
            except RuntimeError:
                optimizer.zero_grad()
                continue
            reference = torch.autograd.grad(
                sum(torch.nn.functional.cross_entropy(model(x), y, reduction="sum") for x, y in batches) / sum(counts),
                list(model.parameters()),
            )
            agree.append(all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), reference)))
            optimizer.step()
            optimizer.zero_grad()
    assert agree == [True, True, True]
    report = audit([tmp_path / "guarded"])
    assert report.runs[0].verdict == "correct" and report.runs[0].skipped_steps == 1, report.findings
    # the failed microbatch's record is the dropped update's, kept there, not the next update's
    dropped = sorted((r["micro"], r["skipped"]) for r in read_rows(tmp_path / "guarded") if r["step"] == 2)
    assert dropped == [(0, True), (1, True)]
    assert not [w for w in caught if "never went through backward" in str(w.message)]


def test_a_log_folder_removed_while_training_is_made_again_at_the_next_flush(tmp_path: Path) -> None:
    import shutil

    with Recorder(tmp_path, run_id="removed", flush_every=10, announce=False) as rec:
        for step in range(10):
            rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=0.5, step=step)
        rec.flush()
        shutil.rmtree(tmp_path / "removed")  # a clean-up job, a user's rm
        for step in range(10, 20):
            rec.record(loss_sum=1.0, valid_tokens=1, backward_scalar=0.5, step=step)
        rec.flush()
        assert sorted(row["step"] for row in read_rows(tmp_path / "removed")) == list(range(10, 20))


@pytest.mark.parametrize("optimizer", [True, False], ids=["optimizer given", "no optimizer"])
def test_updates_whose_ends_the_recorder_was_not_told_are_never_called_correct_or_incorrect(
    tmp_path: Path, optimizer: bool
) -> None:
    """One process, 3 microbatches an update: the token mean (b = S/N, N over the update) and a per-microbatch mean
    (b = S/n). Told the optimizer, the recorder knows each update: correct and incorrect, as the float64 reference
    of ΣS/N says. Told nothing, it takes each backward for an update, where the token mean reads as light weights
    and the per-microbatch mean as the token mean: both are inconclusive, said as such."""
    from tokaudit import audit

    counts = (2, 7, 4)
    verdicts, truth = {}, {}
    for name in ("token_mean", "micro_mean"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3, dtype=torch.float64)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        given = {"optimizer": sgd} if optimizer else {}
        agree = True
        with Recorder(tmp_path / name, run_id=name, announce=False, **given) as rec:
            for _ in range(3):
                batches = [(torch.randn(n, 4, dtype=torch.float64), torch.randint(0, 3, (n,))) for n in counts]
                for x, y in batches:
                    loss_sum = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
                    b = loss_sum / (sum(counts) if name == "token_mean" else len(y))
                    rec.record(loss_sum=loss_sum, valid_tokens=len(y), backward_scalar=b)
                    b.backward()
                total = sum(torch.nn.functional.cross_entropy(model(x), y, reduction="sum") for x, y in batches)
                reference = torch.autograd.grad(total / sum(counts), list(model.parameters()))
                agree = agree and all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), reference))
                sgd.step()
                sgd.zero_grad()
        truth[name] = agree
        report = audit([tmp_path / name / name])
        verdicts[name] = (report.runs[0].verdict, "update_ends_guessed" in {f.code.value for f in report.findings})
    assert truth == {"token_mean": True, "micro_mean": False}
    if optimizer:
        assert verdicts == {"token_mean": ("correct", False), "micro_mean": ("incorrect", False)}
    else:
        assert verdicts == {"token_mean": ("inconclusive", True), "micro_mean": ("inconclusive", True)}


def test_a_skip_said_alone_leaves_the_other_updates_ends_as_they_were_read(tmp_path: Path) -> None:
    """No optimizer: each backward is an update. A guard says one skip with `end_step(skipped=True)`, as the docs
    ask where the gradients are cleared another way: the updates after it stay updates of their own."""
    model = torch.nn.Linear(4, 3)
    with Recorder(tmp_path, run_id="guard", announce=False) as rec:
        for update in range(4):
            loss_sum = torch.nn.functional.cross_entropy(
                model(torch.randn(2, 4)), torch.tensor([0, 1]), reduction="sum"
            )
            rec.record(loss_sum=loss_sum, valid_tokens=2, backward_scalar=loss_sum / 2)
            if update == 1:
                rec.end_step(skipped=True)  # the guard's own skip; no backward
                continue
            (loss_sum / 2).backward()
    steps = sorted((row["step"], bool(row["skipped"])) for row in read_rows(tmp_path / "guard"))
    assert steps == [(0, False), (1, True), (2, False), (3, False)]
