"""The CLI as a user drives it: exit codes, formats, post-mortems; one real subprocess run."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.logs import UNEVEN, UNEVEN_GA, bench_synthetic, local_mean, records, token_mean, write, write_by_rank
from tokaudit.cli import main


@pytest.fixture()
def logs(tmp_path: Path) -> Path:
    write_by_rank(tmp_path / "good", records(UNEVEN_GA, token_mean))
    rows = records(UNEVEN, local_mean)
    for row in rows:  # reports the mean of local means, as such code does
        mine = [r for r in rows if r["step"] == row["step"]]
        row["reported_loss"] = sum(r["loss_sum"] / r["valid_tokens"] for r in mine) / len(mine)
    write_by_rank(tmp_path / "bad", rows)
    return tmp_path


def invoke(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_exit_codes_follow_fail_on(logs: Path) -> None:
    assert invoke("check", str(logs / "good"))[0] == 0
    assert invoke("check", str(logs))[0] == 1
    assert invoke("check", str(logs), "--fail-on", "never")[0] == 0
    assert invoke("check", str(logs), "--run", "bad", "--fail-on", "error")[0] == 1
    write_by_rank(logs / "info_only" / "x", records([[[2], [3]], [[0], [0]]], token_mean, skipped=True))
    assert invoke("check", str(logs / "info_only"))[0] == 0
    assert invoke("check", str(logs / "info_only"), "--fail-on", "info")[0] == 1
    code, _, err = invoke("check", str(logs), "--run", "nope")
    assert code == 2 and "no run named 'nope'" in err
    assert invoke("check", str(logs), "--rtol", "2")[0] == 2
    assert invoke("check")[0] == 2  # click usage error


def test_a_run_called_incorrect_never_exits_0_under_the_default(tmp_path: Path) -> None:
    """Uniform weights 1.3× the token mean's: a warning (scale_mismatch), and the run's verdict `incorrect`.
    Under the default --fail-on the exit is 1 (a run reported incorrect never exits 0); --fail-on never is 0."""
    write_by_rank(tmp_path / "scaled", records(UNEVEN_GA, lambda S, N, W, **_: 1.3 * W * S / N))
    code, out, _ = invoke("check", str(tmp_path), "--format", "json")
    report = json.loads(out)
    assert {f["severity"] for f in report["findings"]} == {"warning"}
    assert report["runs"][0]["verdict"] == "incorrect" and code == 1
    assert invoke("check", str(tmp_path), "--fail-on", "never")[0] == 0


def test_json_report_follows_the_spec(logs: Path) -> None:
    code, out, _ = invoke("check", str(logs), "--format", "json")
    report = json.loads(out)
    assert code == 1 and set(report) >= {"tokaudit_version", "runs", "findings"}
    runs = {r["run"]: r for r in report["runs"]}
    for run in runs.values():
        assert set(run) >= {
            "run",
            "rows",
            "steps",
            "ranks",
            "world_size",
            "verdict",
            "normalization",
            "max_weight_ratio",
        }
        assert set(run["normalization"]) == {"denominator", "factor"}
    assert runs["good"]["verdict"] == "correct" and runs["good"]["max_weight_ratio"] == pytest.approx(1.0)
    assert runs["good"]["normalization"] == {"denominator": "N", "factor": 2.0}
    assert runs["bad"]["verdict"] == "incorrect" and runs["bad"]["world_size"] == [2]
    assert runs["bad"]["rows"] == 6 and runs["bad"]["steps"] == 3 and runs["bad"]["ranks"] == 2
    finding = next(f for f in report["findings"] if f["code"] == "local_mean")
    assert set(finding) == {"run", "code", "severity", "steps", "message", "fix", "evidence", "fix_code"}
    assert finding["severity"] == "error" and finding["steps"] == {"first": 0, "last": 2, "count": 3}
    codes = [f["code"] for f in report["findings"]]
    assert codes == ["local_mean", "reported_loss_mismatch"]  # most severe first


def test_table_markdown_and_output_file(logs: Path, tmp_path: Path) -> None:
    code, out, _ = invoke("check", str(logs))
    assert code == 1 and "local_mean" in out and "incorrect" in out and "b·g = 2·S/N" in out
    code, out, _ = invoke("check", str(logs), "--format", "markdown")
    assert out.startswith("<!-- tokaudit-report -->") and "| `bad` |" in out and "<code>local_mean</code>" in out
    target = tmp_path / "report.json"
    code, out, _ = invoke("check", str(logs), "--format", "json", "--output", str(target))
    assert code == 1 and out == "" and json.loads(target.read_text())["runs"]
    target = tmp_path / "report.txt"
    invoke("check", str(logs), "--output", str(target))
    assert "findings, most severe first" in target.read_text() and "\x1b[" not in target.read_text()


def test_weights_shows_q_per_record(logs: Path) -> None:
    code, out, _ = invoke("weights", str(logs), "--run", "bad", "--step", "0", "--format", "csv")
    rows = list(csv.DictReader(out.splitlines()))
    assert code == 0 and [int(r["rank"]) for r in rows] == [0, 1]
    # local mean, n = (1, 3), W = 2: q = N/(W·n) = 2 and 2/3
    assert [round(float(r["q"]), 6) for r in rows] == [2.0, round(2 / 3, 6)]
    code, out, _ = invoke("weights", str(logs), "--run", "bad", "--step", "0")
    assert code == 0 and "q = e·N" in out
    code, _, err = invoke("weights", str(logs), "--step", "0")
    assert code == 2 and "choose one with --run" in err
    target = logs.parent / "weights.csv"  # -o: the same CSV into a file, nothing on stdout
    assert invoke("weights", str(logs), "--run", "bad", "--step", "0", "--format", "csv", "-o", str(target))[:2] == (
        0,
        "",
    )
    assert target.read_text() == invoke("weights", str(logs), "--run", "bad", "--step", "0", "--format", "csv")[1]
    assert invoke("weights", str(logs), "--run", "bad", "--step", "99")[0] == 2
    # -o's extension names the format, as check's does: .json is JSON, and one that names none is refused
    named = logs.parent / "weights.json"
    assert invoke("weights", str(logs), "--run", "bad", "--step", "0", "-o", str(named))[0] == 0
    assert json.loads(named.read_text())["step"] == 0
    code, _, err = invoke("weights", str(logs), "--run", "bad", "--step", "0", "-o", str(logs.parent / "w.xyz"))
    assert code == 2 and "cannot tell the format from the extension '.xyz'" in err


def test_curve_refuses_one_file_for_its_csv_and_its_plot(logs: Path, tmp_path: Path) -> None:
    code, _, err = invoke(
        "curve", str(logs), "--run", "bad", "--csv", str(tmp_path / "c.png"), "--plot", str(tmp_path / "c.png")
    )
    assert code == 2 and "--csv and --plot name one file" in err and not (tmp_path / "c.png").exists()
    shard = next((logs / "bad").glob("*.parquet"))
    for option in ("--csv", "--plot"):  # an input is refused in the words of the option that named it
        code, _, err = invoke("curve", str(logs), "--run", "bad", option, str(shard))
        assert (
            code == 2
            and err == f"tokaudit: error: {shard}: is one of the logs being audited; choose another {option}\n"
        )


def test_input_that_cannot_be_read_is_one_line_in_every_command(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for args in (
        ["weights", str(tmp_path / "nowhere"), "--step", "1"],
        ["curve", str(tmp_path / "empty")],
        ["check", str(tmp_path / "nowhere")],
    ):
        code, out, err = invoke(*args)
        assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("tokaudit: error: "), args


def test_curve_and_weights_say_which_steps_lack_some_ranks(tmp_path: Path) -> None:
    """A log still being written: rank 1's last step not flushed yet. Its N counts rank 0 alone, so its weights and
    its ΣS/N are rank 0's: said, where the numbers would otherwise pass for the whole step's."""
    rows = [r for r in records(UNEVEN_GA, token_mean) if not (r["rank"] == 1 and r["step"] == 2)]
    write_by_rank(tmp_path / "run", rows)
    note = (
        "tokaudit: note: step(s) 2 lack some ranks' records (a log still being written, or a rank that did not record)"
    )
    code, _, err = invoke("curve", str(tmp_path / "run"), "--format", "json")
    assert code == 0 and note in err
    code, _, err = invoke("weights", str(tmp_path / "run"), "--step", "2")
    assert code == 0 and note in err
    assert note not in invoke("weights", str(tmp_path / "run"), "--step", "1")[2]


def test_weights_shows_a_term_s_declared_weight_and_q_against_it(tmp_path: Path) -> None:
    """A second term weighed λ = 0.3 and declared: its records show λ, e = c·g/(D·λ) and q = 1."""
    main = records(UNEVEN_GA, token_mean)
    aux = [dict(r, term="aux", term_weight=0.3, backward_scalar=0.3 * r["backward_scalar"]) for r in main]
    write_by_rank(tmp_path / "weighed", main + aux)
    code, out, _ = invoke("weights", str(tmp_path / "weighed"), "--step", "0", "--format", "csv")
    rows = list(csv.DictReader(out.splitlines()))
    assert code == 0 and {(r["term"], float(r["term_weight"])) for r in rows} == {("0", 1.0), ("aux", 0.3)}
    assert all(abs(float(r["q"]) - 1) < 1e-12 for r in rows)
    code, out, _ = invoke("weights", str(tmp_path / "weighed"), "--step", "0")
    assert code == 0 and "λ" in out and "0.3" in out


def test_weights_of_a_term_switched_off_shows_its_c_of_0_and_no_e(tmp_path: Path) -> None:
    """λ = 0: c = b/S = 0 is measured, e = c·g/(D·λ) has no value (c was shown as unknown, from e)."""
    main = records(UNEVEN_GA, token_mean)
    off = [dict(r, term="aux", term_weight=0.0, backward_scalar=0.0) for r in main]
    write_by_rank(tmp_path / "off", main + off)
    code, out, _ = invoke("weights", str(tmp_path / "off"), "--step", "0", "--format", "csv")
    rows = [r for r in csv.DictReader(out.splitlines()) if r["term"] == "aux"]
    assert (
        code == 0 and rows and {(r["implied_weight"], r["effective_weight"], r["q"]) for r in rows} == {("0.0", "", "")}
    )


def test_a_run_whose_every_term_is_switched_off_says_nothing_weighs_its_tokens(tmp_path: Path) -> None:
    """Every record λ = 0 and b = 0 (uneven counts): inconclusive, and the headline said "balanced counts"."""
    rows = [dict(r, term_weight=0.0, backward_scalar=0.0) for r in records(UNEVEN_GA, token_mean)]
    write_by_rank(tmp_path / "off", rows)
    code, out, _ = invoke("check", str(tmp_path / "off"))
    assert code == 0 and "off: inconclusive" in out and "not judged: no record weighs its tokens" in out, out


def test_weights_in_a_pipe_at_80_columns_never_splits_a_number(tmp_path: Path) -> None:
    """Too narrow for the table, each record is a block of key=value words that wrap between words only: every
    value reads back whole, the same as the CSV's."""
    write_by_rank(tmp_path / "bad", records([[[3, 1], [12, 7]], [[2, 9], [4, 4]]], local_mean, sync=True))
    code, out, _ = invoke("weights", str(tmp_path / "bad"), "--step", "0")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 80
    pairs = [word.split("=", 1) for word in out.split() if "=" in word and not word.startswith("=")]
    shown = [(key, value) for key, value in pairs if key in ("n", "q", "S")]
    rows = list(
        csv.DictReader(invoke("weights", str(tmp_path / "bad"), "--step", "0", "--format", "csv")[1].splitlines())
    )
    assert [value for key, value in shown if key == "n"] == [r["valid_tokens"] for r in rows]
    assert [float(value) for key, value in shown if key == "q"] == [float(f"{float(r['q']):.4g}") for r in rows]
    assert [float(value) for key, value in shown if key == "S"] == [float(f"{float(r['loss_sum']):.5g}") for r in rows]


def test_weights_shows_the_probe_s_extremes_and_each_loss_term(tmp_path: Path) -> None:
    """With a probe, `weights` shows the lightest and heaviest token it measured as q, and marks a record
    whose own q (Σ∂b/∂ℓ / n over N) lies outside them: its n is not the probe's count. Two loss terms of one
    step are told apart by a term column."""
    rows = records(UNEVEN_GA, token_mean)
    for row in rows:
        weight = row["backward_scalar"] / row["loss_sum"]
        row.update(token_weight_sum=weight * row["valid_tokens"], token_weight_min=weight, token_weight_max=weight)
    rows[5]["valid_tokens"] += 2  # step 1, rank 0, microbatch 1: counts 2 tokens the probe did not see
    write(tmp_path / "run" / "a.parquet", rows + [dict(r, term="aux") for r in records(UNEVEN_GA, token_mean)])
    result = CliRunner().invoke(main, ["weights", str(tmp_path / "run"), "--step", "1"], env={"COLUMNS": "200"})
    code, out = result.exit_code, result.stdout
    assert code == 0
    header = next(line for line in out.splitlines() if line.strip().startswith("group"))
    assert header.split() == [
        "group",
        "term",
        "rank",
        "micro",
        "n",
        "S",
        "b",
        "c",
        "D",
        "g",
        "e",
        "=",
        "c·g/D",
        "q",
        "=",
        "e·N",
        "probe",
        "q",
        "sync",
    ]
    # (the mark of a record whose q lies outside its probe q, in words: one cell)
    table = [
        line.replace(" (q outside)", "(q-outside)").split()
        for line in out.splitlines()
        if line.strip().startswith("0 ")
    ]
    # step 1: labelled counts (2, 6 | 6, 2), N = 16 as the probe saw; the log's N is 18 for term 0: every token
    # weighs 18/16 = 1.125 in q, and the miscounted record's mean 1.125·6/8 = 0.84375, outside it
    first_term = [cells for cells in table if cells[1] == "0"]
    assert [cells[-2] for cells in first_term] == ["1.125", "1.125(q-outside)", "1.125", "1.125"]
    assert [cells[-3] for cells in first_term] == ["1.125", "0.8438", "1.125", "1.125"]
    assert [cells[-2] for cells in table if cells[1] == "aux"] == ["–"] * 4  # no probe on that term
    assert "count_mismatch" in out and "a q outside its probe q" in out


def test_a_run_whose_every_step_is_left_out_says_so(tmp_path: Path) -> None:
    """The recorded run whose counts the probe contradicts at every step: no step is judged, which the
    table says (not "no valid tokens"), with the warning below the default --fail-on (exit 0); the
    markdown and --fail-on warning agree."""
    log = Path(__file__).parent.parent / "sample_logs" / "counted_positions"
    result = CliRunner().invoke(main, ["check", str(log)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if line.strip().startswith("counted_positions"))
    assert row.split()[:3] == ["counted_positions", "inconclusive", "0"] and "no step judged" in row
    assert "count_mismatch" in result.stdout and "4 step(s) are left out" in result.stdout.replace("\n", " ")
    narrow = CliRunner().invoke(main, ["check", str(log)], env={"COLUMNS": "70"}).stdout
    assert "no step judged: every step left out (see the findings)" in narrow and " W ," not in narrow
    code, out, _ = invoke("check", str(log), "--format", "markdown", "--fail-on", "warning")
    assert code == 1 and "no step judged" in out and "<code>count_mismatch</code>" in out


def test_curve_writes_csv_and_png(logs: Path, tmp_path: Path) -> None:
    csv_path, png_path = tmp_path / "curve.csv", tmp_path / "curve.png"
    code, out, _ = invoke("curve", str(logs), "--run", "bad", "--csv", str(csv_path), "--plot", str(png_path))
    assert code == 0 and "ΣS/N (true)" in out and "●" in out
    rows = list(csv.DictReader(csv_path.read_text().splitlines()))
    step0 = rows[0]
    loss = [r for r in records(UNEVEN, local_mean) if r["step"] == 0]
    true_mean = sum(r["loss_sum"] for r in loss) / sum(r["valid_tokens"] for r in loss)
    local = sum(r["loss_sum"] / r["valid_tokens"] for r in loss) / 2
    assert float(step0["token_mean"]) == pytest.approx(true_mean)
    assert float(step0["mean_of_local_means"]) == pytest.approx(local)
    assert float(step0["reported"]) == pytest.approx(local)
    assert float(step0["optimized"]) == pytest.approx(local)  # the optimizer followed the local means
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_curve_of_a_window_reads_only_the_shards_that_can_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """curve --steps: the window's rows are the whole curve's rows for those steps, read from the shards
    whose footers overlap it and aggregated a range at a time as the whole log would be."""
    import tokaudit._opening as opening

    counts = [[[3, 1], [0, 4]], [[2, 2], [5, 1]], [[1, 1], [1, 6]]] * 20  # 60 steps
    rows = records(counts, local_mean)
    for rank in range(2):
        for part in range(6):  # one shard per rank and 10 steps
            write(
                tmp_path / "run" / f"rank-{rank:05d}-{part:06d}.parquet",
                [r for r in rows if r["rank"] == rank and 10 * part <= r["step"] < 10 * part + 10],
            )
    whole_csv, window_csv = tmp_path / "whole.csv", tmp_path / "window.csv"
    assert invoke("curve", str(tmp_path / "run"), "--csv", str(whole_csv))[0] == 0
    read: list[int] = []
    original = opening.Engine.open

    def counting(shards: list, *args: object, **kwargs: object) -> object:
        read.append(len(shards))
        return original(shards, *args, **kwargs)

    monkeypatch.setattr(opening.Engine, "open", counting)
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", "20")  # several ranges inside the window
    code, out, err = invoke("curve", str(tmp_path / "run"), "--steps", "15:33", "--csv", str(window_csv))
    assert code == 0, err
    whole = list(csv.DictReader(whole_csv.read_text().splitlines()))
    window = list(csv.DictReader(window_csv.read_text().splitlines()))
    assert [int(r["step"]) for r in window] == list(range(15, 34))
    assert window == [r for r in whole if 15 <= int(r["step"]) <= 33]
    assert read and set(read) == {6}, "the shards of steps 10-39 only (in each lane's engine)"
    assert invoke("curve", str(tmp_path / "run"), "--steps", "50:")[0] == 0


@pytest.mark.parametrize(
    "window, words",
    [
        ("abc", "expected FIRST:LAST"),
        ("12", "expected FIRST:LAST"),
        ("5:2", "at most the last"),
        ("0:9223372036854775808", "whole numbers of 64 bits"),  # 2^63: past every step
        ("100:200", "no step from 100 to 200"),
    ],
)
def test_curve_window_that_cannot_be_read_is_one_line(logs: Path, window: str, words: str) -> None:
    code, _, err = invoke("curve", str(logs / "good"), "--steps", window)
    lines = [line for line in err.splitlines() if line.startswith("tokaudit: error:")]
    assert code == 2 and len(lines) == 1 and words in lines[0], err


def test_a_curve_window_a_run_holds_no_step_of_says_so_not_that_there_is_no_such_run(tmp_path: Path) -> None:
    """--run R --steps A:B where R's steps lie outside the window (another run's inside): it said "no run named R";
    an open end, as the end of int64's range."""
    write_by_rank(tmp_path / "short", records(UNEVEN, token_mean))
    write_by_rank(tmp_path / "long", records(UNEVEN * 3, token_mean))
    code, _, err = invoke("curve", str(tmp_path), "--run", "short", "--steps", "5:8")
    assert code == 2 and err.strip() == (
        "tokaudit: error: no run named 'short' with a step from 5 to 8 (runs with steps there: long)"
    )
    code, _, err = invoke("curve", str(tmp_path), "--run", "shrot", "--steps", "5:")  # an open end is said so
    assert code == 2 and err.strip() == (
        "tokaudit: error: no run named 'shrot' with a step from 5 on (runs with steps there: long)"
    )


def test_a_curve_csv_that_does_not_fit_names_its_file(logs: Path) -> None:
    """The last of a CSV is written as it is closed: a full disk there said "output", not the file."""
    code, _, err = invoke("curve", str(logs / "good"), "--csv", "/dev/full")
    assert code == 2 and err.strip() == "tokaudit: error: /dev/full: cannot write the CSV (No space left on device)"


def test_a_curve_window_of_negative_steps_reads_a_log_of_negative_steps(tmp_path: Path) -> None:
    """A log's steps are int64s: one that counts from −3 is drawn in a window of them (it was refused: the first
    step must be at least 0), and an open start takes them in."""
    rows = records(UNEVEN, token_mean, step_offset=-2)
    for rank in {row["rank"] for row in rows}:
        write(tmp_path / "run" / f"rank-{rank:05d}-000000.parquet", [r for r in rows if r["rank"] == rank])
    for window, steps in (("-2:-1", [-2, -1]), (":-2", [-2])):
        code, out, err = invoke("curve", str(tmp_path / "run"), "--steps", window, "--format", "json")
        assert code == 0 and [s["step"] for s in json.loads(out)["steps"]] == steps, err


def test_explain_every_code() -> None:
    from tokaudit.codes import Code

    code, out, _ = invoke("explain")
    assert code == 0 and all(c.value in out for c in Code)
    for known in Code:
        code, out, _ = invoke("explain", known.value)
        assert code == 0 and "Worked example" in out and "Fix" in out
        # the prose wrapped to the terminal (80 columns in a pipe), no word cut: the text is the same words; the code
        # to paste after it (where the fix is the token mean) is never wrapped
        from tokaudit._explain import explain as explain_text, explain_code

        prose = out.split("\nThe token mean in ")[0]
        assert all(len(line) <= 80 or " " not in line.strip() for line in prose.splitlines()), known
        assert out.split() == (explain_text(known) + explain_code(known)).split()
    assert invoke("explain", "nonsense")[0] == 2


@pytest.mark.slow
def test_real_subprocess_and_no_torch_import(logs: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tokaudit.cli", "check", str(logs), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and json.loads(done.stdout)["findings"]
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, tokaudit, tokaudit.cli, tokaudit._auditing; tokaudit.audit; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.stdout.strip() == "False"


def test_live_leaves_out_steps_not_every_rank_has_flushed(tmp_path: Path) -> None:
    rows = records(UNEVEN_GA * 2, token_mean)
    # Rank 1 has flushed through step 3 only; rank 0 through step 5 (training goes on).
    rows = [r for r in rows if not (r["rank"] == 1 and r["step"] > 3)]
    write_by_rank(tmp_path / "run", rows)
    code, out, _ = invoke("check", str(tmp_path), "--format", "json")
    # without --live the steps past rank 1's last shard are said (the end a killed rank leaves), not judged
    (finding,) = json.loads(out)["findings"]
    assert code == 0 and finding["code"] == "unfinished_update" and finding["steps"]["first"] == 4
    code, out, err = invoke("check", str(tmp_path), "--format", "json", "--live")
    report = json.loads(out)
    assert code == 0 and report["findings"] == [] and report["runs"][0]["steps"] == 4


def test_live_waits_for_no_rank_that_an_elastic_resize_left(tmp_path: Path) -> None:
    """W = 2 through step 2, then W = 1 (rank 1 gone): --live judges every step rank 0 recorded since, not only
    those rank 1 reached (the recorder's close audit waited 20 s for it, then said no verdict)."""
    before = records(UNEVEN_GA, token_mean)
    after = records([[[3, 4]]] * 3, token_mean, step_offset=3)  # rank 0 alone, W = 1
    write_by_rank(tmp_path / "run", before + after)
    code, out, _ = invoke("check", str(tmp_path), "--format", "json", "--live")
    report = json.loads(out)
    assert report["runs"][0]["steps"] == 6 and report["runs"][0]["world_size"] == [1, 2]


def test_weights_reads_only_the_shards_that_hold_its_step(tmp_path: Path) -> None:
    """A one-step view of a large log: shards whose footer statistics put every step elsewhere are
    not read (a shard with damaged data pages for steps 3–5 stays unread for step 1)."""
    rows = records(UNEVEN * 200, token_mean)  # steps 0..599
    write(tmp_path / "run" / "rank-all-000000.parquet", [r for r in rows if r["step"] < 3])
    late = write(tmp_path / "run" / "rank-all-000001.parquet", [r for r in rows if r["step"] >= 3])
    data = bytearray(late.read_bytes())
    assert len(data) > 4000
    for i in range(200, 1200):  # the data pages, not the footer
        data[i] = 0xFF
    late.write_bytes(bytes(data))
    code, out, err = invoke("weights", str(tmp_path / "run"), "--step", "1", "--format", "csv")
    assert code == 0 and err == "", err
    assert len(out.strip().splitlines()) == 1 + sum(r["step"] == 1 for r in rows)
    code, _, err = invoke("check", str(tmp_path / "run"))
    assert code == 2 and "rank-all-000001.parquet: corrupt data" in err


def test_ctrl_c_is_one_line_and_exit_130(logs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during an audit (KeyboardInterrupt where the audit runs): `tokaudit: error: interrupted`, exit
    130, not click's "Aborted!" and exit 1, which means findings."""
    import tokaudit._auditing

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tokaudit._auditing, "audit_started", interrupted)
    result = CliRunner().invoke(main, ["check", str(logs)])
    assert result.exit_code == 130 and result.stderr == "tokaudit: error: interrupted\n", result.output


@pytest.mark.slow
def test_a_reader_that_goes_away_is_exit_141_and_quiet(logs: Path) -> None:
    """`tokaudit check … | head`: the reader closes the pipe before the report is written; the command says
    nothing and exits 141 (128 + SIGPIPE), as other Unix tools do."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tokaudit", "check", str(logs), "--format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # before the audit ends and the report is written
    errors = child.stderr.read()
    assert child.wait(timeout=60) == 141 and errors == b"", errors


def test_a_command_started_with_stdout_closed_says_so_before_it_runs(logs: Path, tmp_path: Path) -> None:
    """`tokaudit check runs/ >&-`: with no stdout the report was dropped in silence and a correct run exited 0.
    Each command that writes there says so in one line, exit 2; `-o FILE` needs no stdout."""
    good = str(logs / "good")
    commands = (
        ["check", good],
        ["weights", good, "--step", "0"],
        ["curve", good],
        ["explain", "local_mean"],
        ["check", "--help"],
        ["--version"],
    )
    for args in commands:
        done = subprocess.run(
            [sys.executable, "-m", "tokaudit", *args],
            stdout=None,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            preexec_fn=lambda: os.close(1),
        )
        said = done.stderr.splitlines()
        assert done.returncode == 2 and len(said) == 1 and said[0].startswith("tokaudit: error: stdout is closed"), args
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "tokaudit", "check", good, "-o", str(report)],
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        preexec_fn=lambda: os.close(1),
    )
    assert done.returncode == 0 and json.loads(report.read_text())["runs"][0]["verdict"] == "correct", done.stderr


@pytest.mark.parametrize("option", ["--help", "--version"])
def test_help_and_version_that_cannot_be_written_are_one_line_or_quiet(option: str) -> None:
    """What click prints before any command runs: a full disk is one line and exit 2 (it was a traceback and exit 1,
    which means findings); a reader that went away, exit 141 and nothing said (it was exit 1)."""
    command = [sys.executable, "-m", "tokaudit", option]
    with open("/dev/full", "w") as full:
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, "tokaudit: error: output: No space left on device\n")
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_piped_output_has_no_trailing_spaces(logs: Path) -> None:
    """Output that is not a terminal (a pipe, a CI log) is plain text without the padding a table adds."""
    for args in (["check", str(logs)], ["weights", str(logs / "bad"), "--step", "1"], ["curve", str(logs / "bad")]):
        result = CliRunner().invoke(main, args, env={"COLUMNS": "120"})
        assert result.exit_code in (0, 1) and result.stdout.strip(), (args, result.output)
        assert not [line for line in result.stdout.splitlines() if line != line.rstrip()], args


def test_two_folders_holding_one_run_id_are_two_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run is its folder and its run id: two experiments that reused `run_id="exp1"` (a/exp1 and b/exp1) are two
    runs, named by their folders, each with its own verdict, not one run of twice the records; a run id held by
    one folder keeps its name."""
    write_by_rank(tmp_path / "a" / "exp1", records(UNEVEN_GA, token_mean, run_id="exp1"))
    write_by_rank(tmp_path / "b" / "exp1", records(UNEVEN, local_mean, run_id="exp1"))
    write_by_rank(tmp_path / "b" / "other", records(UNEVEN_GA, token_mean, run_id="exp2"))
    code, out, err = invoke("check", str(tmp_path), "--format", "json")
    runs = {run["run"]: run for run in json.loads(out)["runs"]}
    assert code == 1, err
    assert set(runs) == {str(tmp_path / "a" / "exp1"), str(tmp_path / "b" / "exp1"), "exp2"}
    assert runs[str(tmp_path / "a" / "exp1")]["verdict"] == "correct"
    assert runs[str(tmp_path / "b" / "exp1")]["verdict"] == "incorrect"
    assert runs[str(tmp_path / "a" / "exp1")]["rows"] == len(records(UNEVEN_GA, token_mean))
    # the evidence of a finding is read again from that folder's files alone
    (finding,) = [f for f in json.loads(out)["findings"] if f["run"] == str(tmp_path / "b" / "exp1")]
    assert finding["code"] == "local_mean" and finding["evidence"].get("heaviest")
    import tokaudit._opening as opening

    monkeypatch.setattr(opening, "EVIDENCE_ROWS", 0)  # as a large log: the evidence step read again, alone
    assert invoke("check", str(tmp_path), "--format", "json")[1] == out


def test_the_curve_of_a_run_of_several_loss_terms_shows_each_term_and_their_sum(tmp_path: Path) -> None:
    """sample_logs/aux_head_named: a main head and `head1`, each its own token mean. The curve's ΣS/N is the main
    term's (what a trainer logs), head1's ΣS/N is a series of its own, and the optimized objective is their sum
    (the run is correct, so Σe·S of each term is its ΣS/N); each computed here from the records themselves."""
    from tests.logs import read_rows
    from tests.s3 import SAMPLE_LOGS

    rows = read_rows(SAMPLE_LOGS / "aux_head_named")
    code, _, _ = invoke("curve", str(SAMPLE_LOGS / "aux_head_named"), "--csv", str(tmp_path / "curve.csv"))
    curve = list(csv.DictReader((tmp_path / "curve.csv").read_text().splitlines()))
    assert code == 0 and list(curve[0])[-1] == "token_mean:head1"
    for row in curve:

        def mean(term: str) -> float:
            mine = [r for r in rows if r["step"] == int(row["step"]) and r["term"] == term]
            return sum(r["loss_sum"] for r in mine) / sum(r["valid_tokens"] for r in mine)

        assert float(row["token_mean"]) == pytest.approx(mean("0"), rel=1e-12)
        assert float(row["token_mean:head1"]) == pytest.approx(mean("head1"), rel=1e-12)
        assert float(row["optimized"]) == pytest.approx(mean("0") + mean("head1"), rel=1e-9)
    code, out, _ = invoke("curve", str(SAMPLE_LOGS / "aux_head_named"), "--format", "json")
    steps = json.loads(out)["steps"]  # the same values as the CSV, each step one object
    assert code == 0 and [(s["step"], s["token_mean:head1"]) for s in steps] == [
        (int(r["step"]), float(r["token_mean:head1"])) for r in curve
    ]
    assert invoke("curve", str(SAMPLE_LOGS / "aux_head_named"), "--format", "json", "--csv", "x.csv")[0] == 2
    out = invoke("curve", str(SAMPLE_LOGS / "aux_head_named"))[1]
    assert "ΣS/N (true, term head1)" in " ".join(out.split()) and "optimized Σe·S (all terms)" in " ".join(out.split())


def test_the_output_s_extension_names_its_format_and_it_is_said(logs: Path, tmp_path: Path) -> None:
    """-o report.html without --format writes HTML (and .json, .xml, .md their formats); an extension that names
    no format is refused before anything runs; the file written is said on stderr."""
    for name, start in [
        ("report.html", "<!doctype html>"),
        ("report.json", "{"),
        ("report.xml", "<?xml"),
        ("report.md", "<!-- tokaudit-report -->"),
    ]:
        code, out, err = invoke("check", str(logs), "-q", "-o", str(tmp_path / name))
        assert code == 1 and out == "" and err.strip() == f"wrote {tmp_path / name}"
        assert (tmp_path / name).read_text().lstrip().lower().startswith(start.lower()), name
    code, out, err = invoke("check", str(logs), "-o", str(tmp_path / "report.pdf"))
    assert (
        code == 2
        and "cannot tell the format from the extension '.pdf'" in err
        and not (tmp_path / "report.pdf").exists()
    )
    code, _, _ = invoke("check", str(logs), "--format", "json", "-o", str(tmp_path / "report.out"))
    assert code == 1 and json.loads((tmp_path / "report.out").read_text())["runs"]


def test_a_report_gets_the_permissions_of_the_file_it_replaces_or_of_the_umask(logs: Path, tmp_path: Path) -> None:
    """Written beside the output and renamed over it: the new file is not left the owner's alone (a temporary
    file's 0600) but keeps the mode of the one it replaces, or a new file's under the umask."""
    import os

    old = os.umask(0o022)
    try:
        invoke("check", str(logs), "-q", "-o", str(tmp_path / "new.json"))
        assert (tmp_path / "new.json").stat().st_mode & 0o777 == 0o644
        (tmp_path / "shared.json").write_text("{}")
        os.chmod(tmp_path / "shared.json", 0o664)
        invoke("check", str(logs), "-q", "-o", str(tmp_path / "shared.json"))
        assert (tmp_path / "shared.json").stat().st_mode & 0o777 == 0o664
    finally:
        os.umask(old)


@pytest.mark.skipif(sys.platform != "linux", reason="a tmpfs of 64 KiB is mounted for the full disk")
def test_a_report_that_does_not_fit_leaves_the_one_before(logs: Path, tmp_path: Path) -> None:
    """-o onto a full filesystem: one line and exit 2, and the report that was there is whole, with no partial
    file beside it."""
    import os

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("no tmpfs could be mounted here")
    try:
        good = disk / "report.html"
        good.write_text("the good report")
        filler = disk / "filler"
        with open(filler, "wb", buffering=0) as handle:  # fill the disk to its last block
            try:
                while True:
                    handle.write(b"x" * 4096)
            except OSError:
                pass
        code, out, err = invoke("check", str(logs), "-o", str(good))
        assert code == 2 and "cannot write the report" in err
        assert good.read_text() == "the good report" and sorted(p.name for p in disk.iterdir()) == [
            "filler",
            "report.html",
        ]
    finally:
        subprocess.run(["umount", str(disk)])


def _large_log(folder: Path) -> Path:
    """A log of 1.28M records the audit aggregates in two ranges: long enough to be stopped inside a query."""
    bench_synthetic().write_log(folder, ranks=16, steps=40000, micro=2, steps_per_file=10000, ranks_per_file=16)
    return folder


def _aggregating(log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`tokaudit check LOG` in a process of its own, once it says it aggregates (its progress in a pipe)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tokaudit", "check", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stderr is not None
    line = "-"
    while line and not line.startswith("aggregating"):
        line = process.stderr.readline()
    assert line, "the audit ended before it aggregated"
    return process


@pytest.mark.slow
def test_ctrl_c_during_the_aggregation_is_interrupted_exit_130(tmp_path: Path) -> None:
    """SIGINT while DuckDB aggregates (read from the progress line that says so): one line, exit 130, each time
    (DuckDB hands a Ctrl-C inside a query back as its own exception, never a finding nor an internal error)."""
    import signal
    import time

    log = _large_log(tmp_path / "big")
    for pause in (0.0, 0.1, 0.2):
        process = _aggregating(log)
        time.sleep(pause)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
        assert process.returncode == 130 and err.strip().splitlines()[-1] == "tokaudit: error: interrupted", err


@pytest.mark.slow
def test_a_killed_audit_s_scratch_is_swept_by_the_next_and_a_live_one_s_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An audit SIGKILLed while it aggregates leaves its folder under TMPDIR (here the links to shards whose names
    DuckDB cannot take as they are); the next audit removes it, and never the folder of an audit still running."""
    import os
    import signal

    log = _large_log(tmp_path / "odd name's log")  # a quote: the shards are linked under TMPDIR
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    process = _aggregating(log, env)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    left = [p.name for p in scratch.iterdir() if p.name.startswith("tokaudit-shards-")]
    assert left, "the killed audit left nothing to sweep"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = scratch / f"tokaudit-steps-{sleeper.pid}-abc"
        live.mkdir()
        monkeypatch.setenv("TMPDIR", str(scratch))
        sample = Path(__file__).resolve().parents[1] / "sample_logs" / "bug_local_mean"
        done = subprocess.run(
            [sys.executable, "-m", "tokaudit", "check", str(sample), "-q"], capture_output=True, env=env, timeout=120
        )
        assert done.returncode in (0, 1)
        remaining = sorted(p.name for p in scratch.iterdir())
        assert remaining == [live.name], remaining
    finally:
        sleeper.kill()


def test_a_divisor_the_recorder_could_not_see_gives_no_weight_in_the_post_mortems(tmp_path: Path) -> None:
    """sample_logs/unknown_hook_wrong (a real DDP run, its reduction's D not seen, really W× too heavy): `check`
    shows no q; `weights`, the curve's Σe·S and the HTML heat-map show none either, rather than q = 1 under the default
    D = W the records stand for."""
    log = Path(__file__).parent.parent / "sample_logs" / "unknown_hook_wrong"
    code, out, err = invoke("weights", str(log), "--step", "0", "--format", "json")
    rows = json.loads(out)["records"]
    assert code == 0 and "could not see the divisor D" in err
    assert all(r["grad_divisor"] is None and r["effective_weight"] is None and r["q"] is None for r in rows)
    assert all(r["implied_weight"] > 0 for r in rows)  # c = b/S needs no D
    code, _, _ = invoke("curve", str(log), "--csv", str(tmp_path / "curve.csv"))
    with open(tmp_path / "curve.csv") as curve:
        steps = list(csv.DictReader(curve))
    assert code == 0 and steps and all(s["optimized"] == "" and float(s["token_mean"]) > 0 for s in steps)
    code, _, _ = invoke("check", str(log), "--format", "html", "--output", str(tmp_path / "report.html"))
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert code == 0 and "class=heatmap" not in page and "could not be seen, so no q = e·N: no heat-map" in page


def test_a_dash_for_output_is_standard_output(logs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = invoke("check", str(logs / "good"), "-o", "-", "--format", "json")
    assert code == 0 and json.loads(out)["runs"][0]["verdict"] == "correct" and "wrote" not in err
    code, out, _ = invoke("weights", str(logs / "good"), "--step", "1", "--output", "-", "--format", "csv")
    assert code == 0 and out.startswith("group,term,rank,micro")
    code, out, err = invoke("curve", str(logs / "good"), "--csv", "-")
    assert code == 2 and out == "" and "--csv names a file; `--format json` writes every step" in err
    assert not (tmp_path / "-").exists()


def test_a_run_every_update_of_which_was_skipped_says_so(tmp_path: Path) -> None:
    write_by_rank(tmp_path / "skipped", records(UNEVEN, local_mean, skipped=True))
    code, out, _ = invoke("check", str(tmp_path))
    assert code == 0 and "skipped: inconclusive" in out and "every update skipped: none weighed" in out


def test_curve_says_no_objective_for_a_step_whose_gradient_is_not_finite(tmp_path: Path) -> None:
    """A record of step 1 holds S = NaN and b = inf: check calls that step's gradient not finite, and the curve says
    no Σe·S there (it summed the other records' and printed a number)."""
    rows = records(UNEVEN, token_mean)
    rows[2].update(loss_sum=float("nan"), backward_scalar=float("inf"))  # step 1, rank 0
    write(tmp_path / "run" / "all.parquet", rows)
    csv_path = tmp_path / "curve.csv"
    code, _, _ = invoke("curve", str(tmp_path / "run"), "--csv", str(csv_path))
    optimized = [r["optimized"] for r in csv.DictReader(csv_path.read_text().splitlines())]
    assert (
        code == 0
        and optimized[1] in ("", "nan")
        and optimized[0] not in ("", "nan")
        and optimized[2] not in ("", "nan")
    )
