"""Audits for experiment trackers, in one process: the metrics of a recorded run against the audit,
text logged as written, and a tracker that fails or hangs never holding up or breaking training."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.logs import read_rows
from tokaudit._auditing import audit
from tokaudit.hooks import Recorder, trackers
from tokaudit.hooks.trackers import VERDICT_VALUES, AuditMetrics, as_trackers, audit_metrics

COUNTS = ((3, 5), (6, 1), (2, 2), (4, 7), (1, 6), (5, 3), (7, 2), (2, 4))
"""Valid tokens per step and microbatch: uneven, so a mean per microbatch is not the token mean."""


def train(
    log_dir: Path,
    run_id: str,
    local_mean: bool,
    steps: int = 4,
    term: str | None = None,
    between_steps: Any = None,
    **options: Any,
) -> Recorder:
    """W = 1, two microbatches per optimizer step, b = S/N or the per-microbatch local mean S/(n·M);
    returns the closed Recorder."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    positions = options.pop("count_positions", False)  # valid_tokens counts padding too: the probe contradicts it
    rec = Recorder(log_dir, run_id=run_id, optimizer=optimizer, **options)
    for step in range(steps):
        labels = [torch.tensor([i % 5 if i < n else -100 for i in range(8)]) for n in COUNTS[step]]
        total = sum(int((y != -100).sum()) for y in labels)
        for micro, y in enumerate(labels):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + micro))
            valid = y != -100
            per_token = rec.probe(F.cross_entropy(model(x), y, ignore_index=-100, reduction="none"), valid)
            loss_sum = (per_token * valid).sum()
            b = loss_sum / valid.sum() / len(labels) if local_mean else loss_sum / total
            counted = valid.numel() if positions else valid.sum()
            rec.record(loss_sum=loss_sum, valid_tokens=counted, backward_scalar=b, term=term)
            b.backward()
        optimizer.step()
        optimizer.zero_grad()
        if between_steps is not None:
            between_steps(step)
    rec.close()
    return rec


class Collecting:
    """A tracker that keeps what it is given (a `Tracker`: anything with log_audit)."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, AuditMetrics]] = []

    def log_audit(self, metrics: AuditMetrics, step: int) -> None:
        self.logged.append((step, metrics))


@pytest.mark.parametrize("local_mean", [False, True])
def test_the_metrics_of_a_recorded_run_are_what_the_audit_says(tmp_path: Path, local_mean: bool) -> None:
    train(tmp_path, "run", local_mean)
    report = audit([tmp_path / "run"])
    (summary,) = report.runs
    metrics = audit_metrics(report)
    assert summary.verdict == ("incorrect" if local_mean else "correct")
    codes = {f.code.value: 1 for f in report.findings}
    assert ("local_mean" in codes) is local_mean
    assert metrics.run == "run"
    assert metrics.scalars == {
        "tokaudit/verdict": float(VERDICT_VALUES[summary.verdict]),
        "tokaudit/max_weight_ratio": summary.max_weight_ratio,
        "tokaudit/steps": 4.0,
        "tokaudit/findings": float(len(report.findings)),
        **{f"tokaudit/code/{code}": 1.0 for code in codes},
    }
    if local_mean:
        # S/(n·M): a token's weight is 1/(n·M), so the ratio in a step is n_max/n_min (step 1: 6/1).
        assert summary.max_weight_ratio == pytest.approx(6.0)
        assert metrics.scalars["tokaudit/verdict"] == 2.0
    else:
        assert summary.max_weight_ratio == pytest.approx(1.0) and metrics.scalars["tokaudit/verdict"] == 0.0
    assert metrics.text["tokaudit/verdict_text"] == summary.verdict
    lines = metrics.text["tokaudit/findings_text"].splitlines()
    if report.findings:
        assert lines == [
            f"{f.severity.value} {f.code.value} steps {f.steps.first}–{f.steps.last} ({f.steps.count}): {f.message}"
            for f in report.findings
        ]
    else:
        assert lines == ["no findings"]


def test_several_runs_need_a_name_and_a_prefix_keeps_them_apart(tmp_path: Path) -> None:
    train(tmp_path, "good", False)
    train(tmp_path, "bad", True)
    report = audit([tmp_path])
    with pytest.raises(ValueError, match="2 runs"):
        audit_metrics(report)
    with pytest.raises(ValueError, match="no run named 'other'"):
        audit_metrics(report, "other")
    bad = audit_metrics(report, "bad", prefix="tokaudit/bad")
    assert bad.scalars["tokaudit/bad/verdict"] == 2.0 and bad.scalars["tokaudit/bad/code/local_mean"] == 1.0
    assert audit_metrics(report, "good").scalars["tokaudit/verdict"] == 0.0


def test_text_from_the_log_is_logged_as_written_and_tensorboard_shows_it_literally(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    term = "**aux** <b>head</b> [x](y)"  # a loss-term name from the log: Markdown and HTML, as data
    train(tmp_path, "run", True, term=term)
    metrics = audit_metrics(audit([tmp_path / "run"]))
    text = metrics.text["tokaudit/findings_text"]
    assert f"[term {term}]" in text
    writer = SummaryWriter(tmp_path / "tb")
    writer.close()  # as transformers' TensorBoardCallback leaves it at train end
    as_trackers(writer)[0].log_audit(metrics, 7)
    assert writer.all_writers is None, "a writer found closed is closed again"
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("tokaudit/verdict")] == [(7, 2.0)]
    (logged,) = events.Tensors("tokaudit/findings_text/text_summary")
    shown = logged.tensor_proto.string_val[0].decode()
    # An indented code block: TensorBoard's Markdown renders every line as written.
    assert shown.splitlines() == ["    " + line for line in text.splitlines()]


def test_the_recorder_logs_every_k_steps_and_at_close(tmp_path: Path) -> None:
    tracker = Collecting()
    done: list[int] = []

    def wait_for_each_audit(step: int) -> None:
        # Audits run in the background; wait for each here so that none is skipped as still running.
        deadline = time.monotonic() + 20
        while len(tracker.logged) < step // 3 and time.monotonic() < deadline:  # started at step 3, 6
            time.sleep(0.02)
        done.append(step)

    train(tmp_path, "run", True, steps=8, trackers=[tracker], audit_every=3, between_steps=wait_for_each_audit)
    # Blocks of 3 steps: audits at the first record of steps 3 and 6 (steps 0-2 and 0-5), then at
    # close (steps 0-7, logged at step 8).
    assert [step for step, _ in tracker.logged] == [3, 6, 8]
    assert [m.scalars["tokaudit/steps"] for _, m in tracker.logged] == [3.0, 6.0, 8.0]
    final = audit_metrics(audit([tmp_path / "run"]))
    assert tracker.logged[-1][1] == final
    assert {r["step"] for r in read_rows(tmp_path / "run")} == set(range(8))


def test_options_the_recorder_cannot_use_warn_and_recording_goes_on(tmp_path: Path) -> None:
    tracker = Collecting()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path, "run", False, steps=3, trackers=tracker, audit_every="often")  # one tracker, not a list
    assert [str(w.message) for w in caught if "audit_every" in str(w.message)] == [
        "tokaudit: audit_every must be an int of at least 1, got 'often'; the run is audited for the trackers at "
        "close() only"
    ]
    assert [step for step, _ in tracker.logged] == [3]
    assert len(read_rows(tmp_path / "run")) == 6


def test_a_tracker_that_raises_never_breaks_training_and_warns_once(tmp_path: Path) -> None:
    class Failing:
        calls = 0

        def log_audit(self, metrics: AuditMetrics, step: int) -> None:
            Failing.calls += 1
            raise ConnectionError("tracker is down")

    good = Collecting()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(
            tmp_path,
            "run",
            False,
            steps=6,
            trackers=[Failing(), object(), good],
            audit_every=1,
            between_steps=lambda step: time.sleep(0.05),
        )
    messages = [str(w.message) for w in caught if "tokaudit" in str(w.message)]
    assert len([m for m in messages if "tracker is down" in m]) == 1, messages
    assert len([m for m in messages if "cannot log an audit to a builtins.object" in m]) == 1, messages
    assert Failing.calls == 1 and good.logged, "tried once; the other trackers still get every audit"
    assert good.logged[-1][1] == audit_metrics(audit([tmp_path / "run"]))
    assert len(read_rows(tmp_path / "run")) == 12, "every record written"


def test_a_tensorboard_writer_that_cannot_write_any_more_is_tried_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A SummaryWriter the trainer closed, whose folder is gone (a file in its place): reopening it fails; one
    warning, it is not reopened at every audit, and no writer thread's traceback reaches stderr."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(tmp_path / "tb")
    writer.close()
    shutil.rmtree(tmp_path / "tb")
    (tmp_path / "tb").write_text("not a folder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(
            tmp_path,
            "run",
            False,
            steps=6,
            trackers=[writer],
            audit_every=1,
            between_steps=lambda step: time.sleep(0.05),
        )
    said = [str(w.message) for w in caught if "could not log the audit to TensorBoardTracker" in str(w.message)]
    assert len(said) == 1 and "not tried again" in said[0], said
    assert "Traceback" not in capfd.readouterr().err
    assert len(read_rows(tmp_path / "run")) == 12


def test_a_hanging_tracker_never_holds_up_a_step_and_close_waits_a_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trackers, "CLOSE_TIMEOUT_S", 1.0)
    release = threading.Event()

    class Hanging:
        def __init__(self) -> None:
            self.entered = threading.Event()
            self.active = 0
            self.most_active = 0

        def log_audit(self, metrics: AuditMetrics, step: int) -> None:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            self.entered.set()
            release.wait(30)
            self.active -= 1

    hanging = Hanging()
    steps_done: list[int] = []

    def after(step: int) -> None:
        if step == 1:
            assert hanging.entered.wait(20), "the audit started at step 1 reached the tracker"
        steps_done.append(step)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        train(tmp_path, "run", False, steps=6, trackers=[hanging], audit_every=1, between_steps=after)
        elapsed = time.monotonic() - start
    release.set()
    # Training went on while the tracker hung (steps 2-5 ran with it blocked); close() gave up after
    # its bound and said so; never two audits at once.
    assert steps_done == list(range(6)) and hanging.most_active == 1
    assert elapsed < 15
    assert any("did not finish within 1 s" in str(w.message) for w in caught)
    assert len(read_rows(tmp_path / "run")) == 12


@pytest.mark.parametrize("local_mean", [False, True])
def test_the_recorder_says_where_it_records_and_the_verdict_at_close(
    tmp_path: Path, local_mean: bool, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Global rank 0 says one line at its first record (where the shards go, W and D) and one at close() with the
    run's verdict (what `tokaudit check` says of it); announce=False, or TOKAUDIT_QUIET=1, says nothing."""
    monkeypatch.delenv("TOKAUDIT_QUIET", raising=False)
    train(tmp_path, "run", local_mean)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("tokaudit:")]
    verdict = audit([tmp_path / "run"]).runs[0].verdict
    assert lines == [
        f"tokaudit: recording run 'run' to {tmp_path / 'run'} (W=1, D=1); "
        f"`tokaudit check {tmp_path / 'run'}` audits it",
        f"tokaudit: run 'run' is {verdict} ({1 if local_mean else 0} finding(s)); "
        f"`tokaudit check {tmp_path / 'run'}` says why",
    ], lines
    # a run id from a job name: a space quoted for the shell, an escape code shown, never sent to the terminal
    for name in ("my run", "esc\x1b[31m red"):
        train(tmp_path, name, local_mean)
        said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("tokaudit: recording")]
        folder = str(tmp_path / name)
        shown = repr(folder) if "\x1b" in name else folder
        command = repr(folder) if "\x1b" in name else f"'{folder}'"
        assert said == [f"tokaudit: recording run {name!r} to {shown} (W=1, D=1); `tokaudit check {command}` audits it"]
    # every step set aside (the probe contradicts each count): the records are all there, said at once
    start = time.monotonic()
    train(tmp_path, "miscounted", local_mean, count_positions=True)
    said = [line for line in capfd.readouterr().err.splitlines() if "miscounted" in line]
    assert time.monotonic() - start < 10 and "not every rank" not in " ".join(said), said
    assert said[-1].startswith("tokaudit: run 'miscounted' is inconclusive")
    train(tmp_path, "quiet", local_mean, announce=False)
    monkeypatch.setenv("TOKAUDIT_QUIET", "1")
    train(tmp_path, "quieter", local_mean)
    assert not [line for line in capfd.readouterr().err.splitlines() if line.startswith("tokaudit:")]


def test_a_rank_is_told_apart_from_rank_0_while_its_group_is_up_not_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A worker of rank 1 that destroys its process group before exit (the recorder closed at exit): at close the
    group is gone and, without RANK in the environment (mp.spawn sets none), any process reads as rank 0. Who says
    the verdict line is decided while the group is up, so rank 1 says nothing then either."""
    monkeypatch.delenv("TOKAUDIT_QUIET", raising=False)
    monkeypatch.setattr(trackers, "_global_rank", lambda: 1)  # rank 1 while training
    rec = Recorder(tmp_path, run_id="worker1")
    rec.record(loss_sum=2.0, valid_tokens=4, backward_scalar=0.5)
    monkeypatch.setattr(trackers, "_global_rank", lambda: 0)  # the group destroyed: the environment's default
    rec.close()
    assert not [line for line in capfd.readouterr().err.splitlines() if line.startswith("tokaudit:")]
