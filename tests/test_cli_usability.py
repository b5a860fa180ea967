"""The CLI, CI gate and Python API as an ML engineer uses them: readable at any width, gates that
say what they gate, a JSON contract with a shipped schema, a notebook API, a pytest helper."""

from __future__ import annotations

import html
import importlib.metadata
import io
import json
import socket
import os
import re
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

import tokaudit
from tests.logs import UNEVEN, UNEVEN_GA, local_mean, records, token_mean, write_by_rank
from tokaudit._auditing import audit
from tokaudit.cli import main
from tokaudit._render.chart import SHARED, LineChart, line_chart
from tokaudit._render.console import render_report
from tokaudit.testing import assert_token_mean

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_LOGS = ROOT / "sample_logs"


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="session")
def sample_report() -> tokaudit.AuditReport:
    return audit([SAMPLE_LOGS])


@pytest.mark.parametrize("width", [60, 80, 120])
def test_every_run_name_and_verdict_is_readable_at_any_width(sample_report: tokaudit.AuditReport, width: int) -> None:
    buffer = io.StringIO()
    render_report(sample_report, Console(file=buffer, width=width, no_color=True, force_terminal=False))
    text = buffer.getvalue()
    for run in sample_report.runs:
        # the whole name and its verdict on one line: a name folded across lines cannot be searched for
        assert re.search(rf"^ ?{re.escape(run.run)}:? +{run.verdict}\b", text, re.MULTILINE), (width, run.run)
    assert "…" not in text, "nothing is cut"
    assert " run " not in text or "max ratio" in text, "a table that does not fit is not cropped"
    assert all(len(line) <= width for line in text.splitlines())


@pytest.mark.slow
def test_in_a_pipe_the_run_names_stay(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tokaudit", "check", str(SAMPLE_LOGS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert done.returncode == 1
    for run in ("bug_local_mean", "correct_sum_hook", "inconclusive_balanced_local_mean"):
        assert run in done.stdout


def test_the_table_shows_what_decides_the_verdict(tmp_path: Path) -> None:
    code, out, _ = invoke(
        "check",
        str(SAMPLE_LOGS / "bug_missing_world_size"),
        str(SAMPLE_LOGS / "correct_sum_hook"),
        env={"COLUMNS": "120"},
    )
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith(("bug_", "correct_"))}
    # Both read b·g = S/N; D and q tell them apart.
    assert re.search(r"incorrect\s+3\s+2\s+2\s+2\s+b·g = S/N\s+0\.5\s", rows["bug_missing_world_size"])
    assert re.search(r"correct\s+3\s+2\s+2\s+1\s+b·g = S/N\s+1\s", rows["correct_sum_hook"])
    assert "q = e·N: each valid token's weight relative to 1/N" in out and "max ratio:" in out


def test_explanations_make_no_sgd_only_claims() -> None:
    _, out, _ = invoke("explain")
    for code in tokaudit._report.Code:
        _, text, _ = invoke("explain", code.value)
        assert "halves the step" not in text and "half as long" not in text, code
    _, text, _ = invoke("explain", "world_size_mismatch")
    assert "Adam" in text


def test_the_chart_fills_the_console_and_shows_coinciding_series() -> None:
    narrow = line_chart([0, 1, 2], {"a": [1.0, 2.0, 3.0], "b": [1.0, 2.5, 3.0]}, width=30)
    wide = line_chart([0, 1, 2], {"a": [1.0, 2.0, 3.0], "b": [1.0, 2.5, 3.0]}, width=90)
    assert max(map(len, wide.splitlines())) > max(map(len, narrow.splitlines())) + 50
    assert SHARED in narrow and "several series at one point" in narrow and "○" in narrow


def _plain_cells(
    x: list[float], series: dict[str, list[float | None]], width: int, height: int
) -> dict[tuple[int, int], set[int]]:
    """The chart's cells point by point, as the definition reads: each finite point's column and line."""
    import math

    values = [v for ys in series.values() for v in ys if v is not None and math.isfinite(v)]
    low, high = min(values), max(values)
    if high == low:
        low, high = low - 0.5, high + 0.5
    owners: dict[tuple[int, int], set[int]] = {}
    for index, ys in enumerate(series.values()):
        for xv, yv in zip(x, ys):
            if yv is None or not math.isfinite(yv):
                continue
            column = 0 if max(x) == min(x) else round((xv - min(x)) / (max(x) - min(x)) * (width - 1))
            line = height - 1 - round((yv - low) / (high - low) * (height - 1))
            owners.setdefault((line, column), set()).add(index)
    return owners


@pytest.mark.parametrize("seed", range(6))
def test_the_chart_places_every_point_where_its_definition_says(seed: int) -> None:
    """The chart is drawn a series at a time with arrays: the same cells as point by point (None, NaN and
    infinities skipped, values on a cell's rounding edge, one x, one flat series)."""
    import numpy as np

    from tokaudit._render.chart import MARKS

    rng = np.random.default_rng(seed)
    count = [1, 7, 500, 2000, 3, 40][seed]
    x = [float(v) for v in (np.arange(count) * 3 if seed != 4 else np.zeros(count))]
    series: dict[str, list[float | None]] = {}
    for name in ("a", "b", "c")[: 1 + seed % 3]:
        ys: list[float | None] = [float(v) for v in np.round(rng.normal(2, 1, count), 1 + seed % 2)]
        for i in range(1, count, 5):
            ys[i] = [None, float("nan"), float("inf"), 2.0][i % 4]
        series[name] = ys
    if seed == 5:
        series["flat"] = [1.0] * count
    width, height = 40 + 7 * seed, 14
    chart = line_chart(x, series, width=width, height=height).splitlines()
    owners = _plain_cells(x, series, width, height)
    label_width = chart[0].index("┤") - 1
    for line in range(height):
        cells = chart[line][label_width + 2 : label_width + 2 + width]
        expected = "".join(
            " "
            if (line, c) not in owners
            else MARKS[min(owners[(line, c)]) % len(MARKS)]
            if len(owners[(line, c)]) == 1
            else SHARED
            for c in range(width)
        )
        assert cells.ljust(width) == expected, (seed, line)
    # drawn from batches of the points (a curve read a part at a time): the same chart
    chart_batches = LineChart(list(series), width, height)
    columns = {
        name: np.array([np.nan if v is None else v for v in ys], dtype=np.float64) for name, ys in series.items()
    }
    cuts = [0, count // 3, count // 3, count]  # one batch empty
    for place in (False, True):
        for a, b in zip(cuts, cuts[1:]):
            batch = np.asarray(x[a:b], dtype=np.float64), [ys[a:b] for ys in columns.values()]
            if place:
                chart_batches.place(*batch)
            else:
                chart_batches.extent(*batch)
    assert chart_batches.render().splitlines() == chart


def test_choosing_a_run_lists_them_all() -> None:
    code, _, err = invoke("curve", str(SAMPLE_LOGS))
    assert code == 2 and "bug_local_mean" in err and "unknown_hook_wrong" in err and "more" not in err


def test_fail_on_inconclusive_ignore_and_min_ratio(tmp_path: Path) -> None:
    balanced = write_by_rank(tmp_path / "balanced", records([[[4], [4]], [[3], [3]]], local_mean))
    assert invoke("check", str(balanced))[0] == 0
    assert invoke("check", str(balanced), "--fail-on", "inconclusive")[0] == 1
    good = write_by_rank(tmp_path / "good", records(UNEVEN, token_mean))
    assert invoke("check", str(good), "--fail-on", "inconclusive")[0] == 0

    bad = write_by_rank(tmp_path / "bad", records(UNEVEN, local_mean))
    assert invoke("check", str(bad))[0] == 1
    # --ignore leaves a code out of the listing and of what fails the command, never out of the verdict
    code, out, _ = invoke("check", str(bad), "--ignore", "local_mean", "--format", "json")
    (run,) = json.loads(out)["runs"]
    assert code == 0 and json.loads(out)["findings"] == [] and run["verdict"] == "incorrect"
    assert (run["gate_verdict"], run["ignored"]) == ("correct", ["local_mean"])
    assert json.loads(out)["ignored"] == {"codes": ["local_mean"], "from": "--ignore"}
    code, out, _ = invoke("check", str(bad), "--ignore", "local_mean")
    assert code == 0 and "incorrect" in out and "No findings listed." in out
    assert "ignored (--ignore): local_mean" in " ".join(out.split())
    assert "the verdict still counts them (bad stays incorrect)" in " ".join(out.split())
    code, _, err = invoke("check", str(bad), "--ignore", "no_such_code")
    assert code == 2 and "--ignore" in err
    # either spelling of a code, and the nearest one named for a typo
    assert invoke("check", str(bad), "--ignore", "Local-Mean")[0] == 0
    code, _, err = invoke("check", str(bad), "--ignore", "locl_mean")
    assert code == 2 and err.strip().splitlines() == [
        "tokaudit: error: --ignore: unknown code 'locl_mean' (did you mean local_mean?); `tokaudit explain` lists "
        "the codes"
    ]
    assert invoke("explain", "local-mean")[1].startswith("local_mean (error)")
    code, _, err = invoke("explain", "locl_mean")
    assert code == 2 and "did you mean local_mean?" in err

    # A local mean whose counts differ by 1 in 400: tokens weigh at most 1.0025× each other.
    nearly = write_by_rank(tmp_path / "nearly", records([[[400], [401]], [[399], [400]]], local_mean))
    assert invoke("check", str(nearly))[0] == 1
    code, out, _ = invoke("check", str(nearly), "--min-ratio", "1.01", "--format", "json")
    report = json.loads(out)
    assert code == 0 and [f["severity"] for f in report["findings"]] == ["info"]
    # the gate passes it; the verdict, a claim about the gradient, still says what the finding found
    assert [(r["verdict"], r["gate_verdict"]) for r in report["runs"]] == [("incorrect", "correct")]
    code, out, _ = invoke("check", str(nearly), "--min-ratio", "1.01")
    assert code == 0 and "nearly: incorrect" in out and "the verdict still counts them (nearly stays incorrect)" in out
    assert assert_token_mean(nearly, min_ratio=1.01).runs[0].verdict == "incorrect"
    code, out, _ = invoke("check", str(nearly), "--min-ratio", "1.01", "--format", "junit")
    assert code == 0 and "incorrect, which this gate passes (--fail-on error, --min-ratio)" in out
    assert invoke("check", str(nearly), "--min-ratio", "1.001")[0] == 1
    assert invoke("check", str(nearly), "--min-ratio", "0.5")[0] == 2
    code, _, err = invoke("check", str(nearly), "--min-ratio", "inf")  # would make every weighting finding a note
    assert code == 2 and "--min-ratio must be a finite number of at least 1, got inf" in err


def test_github_annotations_and_step_summary(tmp_path: Path) -> None:
    write_by_rank(tmp_path / "logs" / "bad", records(UNEVEN, local_mean))
    summary = tmp_path / "summary.md"
    code, out, _ = invoke(
        "check", str(tmp_path / "logs"), "--format", "github", env={"GITHUB_STEP_SUMMARY": str(summary)}
    )
    assert code == 1
    assert any(line.startswith("::error title=tokaudit local_mean · bad::steps 0–2 (3)") for line in out.splitlines())
    assert "::error title=tokaudit bad::verdict: incorrect (fails --fail-on error)" in out
    text = summary.read_text()
    assert text.startswith("<!-- tokaudit-report -->\n") and "<details>" in text


@pytest.mark.parametrize(
    ("run", "options", "exit_code"),
    [
        ("bug_local_mean", ["--ignore", "local_mean", "--ignore", "reported_loss_mismatch"], 0),
        ("correct_token_mean_reported_local_means", ["--fail-on", "warning"], 1),
        ("inconclusive_balanced_local_mean", ["--fail-on", "inconclusive"], 1),
        ("inconclusive_balanced_local_mean", [], 0),
        ("bug_local_mean", [], 1),
    ],
)
def test_what_ci_reads_agrees_with_the_exit_code(run: str, options: list[str], exit_code: int) -> None:
    """JUnit's failures, the GitHub annotations' errors and the Markdown summary's gate say what the exit code
    says, whatever --ignore and --fail-on did to it: a CI system never passes a failed step or fails a passed one."""
    import xml.etree.ElementTree as ElementTree

    path = str(SAMPLE_LOGS / run)
    code, junit, _ = invoke("check", path, "--format", "junit", *options)
    assert code == exit_code
    suite = ElementTree.fromstring(junit)
    assert (int(suite.get("failures") or 0) > 0) == bool(exit_code), junit
    code, github, _ = invoke("check", path, "--format", "github", *options)
    errors = [line for line in github.splitlines() if line.startswith(f"::error title=tokaudit {run}::")]
    assert code == exit_code and bool(errors) == bool(exit_code), github
    code, markdown, _ = invoke("check", path, "--format", "markdown", *options)
    assert code == exit_code and ("fails on 1 run" in markdown.splitlines()[1]) == bool(exit_code), markdown


def test_a_run_id_with_backticks_and_a_pipe_stays_itself_in_markdown(tmp_path: Path) -> None:
    """A run id holding backticks and a pipe is shown in a code span long enough to hold them (CommonMark), the pipe
    escaped for the table: what a reader copies from the rendered table works in --run."""
    write_by_rank(tmp_path / "logs" / "x", records(UNEVEN, local_mean, run_id="a|b`c`"))
    code, out, _ = invoke("check", str(tmp_path / "logs"), "--format", "markdown")
    assert code == 1 and "| `` a\\|b`c` `` |" in out, out


def test_a_group_name_of_markdown_is_printed_literally_in_the_markdown_report(tmp_path: Path) -> None:
    """A group name that is Markdown (an image, a link, an @mention, emphasis, a tag) reaches the findings' text as
    the log holds it: rendered (CommonMark), it makes no image, link or tag, and reads as written."""
    from markdown_it import MarkdownIt

    group = "![g](https://evil.example/g.png) @org/team [click](https://evil.example) *x* <b>y</b>"
    write_by_rank(tmp_path / "logs" / "x", records(UNEVEN, local_mean, group=group))
    code, out, _ = invoke("check", str(tmp_path / "logs"), "--format", "markdown")
    rendered = MarkdownIt("commonmark").render(out)
    paragraphs = [p for p in re.findall(r"<p>(.*?)</p>", rendered, re.S) if "evil" in p]
    assert code == 1 and paragraphs, out
    assert "<img" not in rendered and "<a " not in rendered and "<em>x</em>" not in rendered and "<b>y" not in rendered
    assert all(html.escape(group, quote=False) in p for p in paragraphs), paragraphs


def test_markdown_is_a_summary_line_and_one_details_per_finding() -> None:
    code, out, _ = invoke("check", str(SAMPLE_LOGS), "--format", "markdown")
    lines = out.splitlines()
    from tests.expected import EXPECTED_CODES

    runs = len(EXPECTED_CODES)  # every sample run, written down by hand in tests/expected.py
    assert lines[0] == "<!-- tokaudit-report -->" and lines[1].startswith(f"❌ **tokaudit**: {runs} runs: ")
    findings = json.loads(invoke("check", str(SAMPLE_LOGS), "--format", "json")[1])["findings"]
    assert out.count("<details>") == len(findings) == out.count("</details>")
    assert all("|" not in line or line.startswith("|") for line in lines), "no paragraph sits in a table cell"


def test_json_follows_the_shipped_schema(tmp_path: Path) -> None:
    import jsonschema

    schema = json.loads(resources.files("tokaudit").joinpath("report.schema.json").read_text())
    rows = records(UNEVEN_GA, local_mean)
    write_by_rank(tmp_path / "aux", rows + [dict(r, term="aux") for r in records(UNEVEN_GA, token_mean)])
    for paths in ([str(SAMPLE_LOGS)], [str(tmp_path)]):
        code, out, _ = invoke("check", *paths, "--format", "json")
        document = json.loads(out)
        jsonschema.validate(document, schema)
        assert document["report_version"] == 1
    documented = (ROOT / "docs" / "REPORT.md").read_text()
    for finding in document["findings"]:
        for key in finding["evidence"]:
            assert f"`{key}`" in documented, f"evidence key {key} is not documented"


def test_the_shipped_schema_s_enums_are_the_code_s_own() -> None:
    """report.schema.json copies five enums; each is the table it copies, in its order."""
    from typing import get_args

    from tokaudit.codes import Code, Severity
    from tokaudit._normalization import Denominator
    from tokaudit._report import Reporting, Verdict

    definitions = json.loads(resources.files("tokaudit").joinpath("report.schema.json").read_text())["$defs"]
    assert definitions["finding"]["properties"]["code"]["enum"] == [code.value for code in Code]
    assert definitions["finding"]["properties"]["severity"]["enum"] == [severity.value for severity in Severity]
    assert definitions["run"]["properties"]["verdict"]["enum"] == list(get_args(Verdict))
    assert definitions["run"]["properties"]["reporting"]["enum"] == list(get_args(Reporting))
    assert definitions["normalization"]["properties"]["denominator"]["enum"] == [d.value for d in Denominator]


def test_weights_json_uses_the_log_names_and_q_at_full_precision() -> None:
    code, out, _ = invoke("weights", str(SAMPLE_LOGS), "--run", "bug_local_mean", "--step", "1", "--format", "json")
    document = json.loads(out)
    record = document["records"][0]
    assert {"group", "effective_weight", "q", "valid_tokens", "loss_sum"} <= set(record)
    assert not {"grp", "eff", "distortion"} & set(record)  # the internal names, and the report evidence's name for q
    assert record["loss_sum"] == audit([SAMPLE_LOGS / "bug_local_mean"], keep_steps=True).steps.query(
        "step == 1"
    ).loss.iloc[0] - sum(r["loss_sum"] for r in document["records"][1:])


def test_packaging_one_version_a_license_and_python_m() -> None:
    assert importlib.metadata.version("tokaudit") == tokaudit.__version__
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert importlib.metadata.metadata("tokaudit")["License-Expression"] == "Apache-2.0"  # SPDX
    done = subprocess.run([sys.executable, "-m", "tokaudit", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and tokaudit.__version__ in done.stdout
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['torch'] = None; import tokaudit.hooks"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode != 0 and "pip install '.[hooks]'" in done.stderr


def test_the_python_api(tmp_path: Path) -> None:
    bad = write_by_rank(tmp_path / "bad", records(UNEVEN, local_mean))
    good = write_by_rank(tmp_path / "good", records(UNEVEN, token_mean))
    report = tokaudit.audit(tmp_path, keep_steps=True)
    assert report.verdicts == {"bad": "incorrect", "good": "correct"}
    frame = report.to_pandas()
    assert list(frame.code) == ["local_mean"] and frame.run.iloc[0] == "bad"
    assert set(report.steps.run) == {"bad", "good"} and "tokens" in report.steps
    assert report._repr_markdown_().startswith("<!-- tokaudit-report -->")
    assert_token_mean(good)
    with pytest.raises(AssertionError, match="(?s)local_mean.*fix:"):
        assert_token_mean(bad)
    assert_token_mean(bad, ignore=["local_mean"])


def test_progress_goes_to_stderr_and_quiet_silences_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tokaudit._opening.PROGRESS_ROWS", 1)
    logs = write_by_rank(tmp_path / "run", records(UNEVEN, token_mean))
    code, out, err = invoke("check", str(logs), "--format", "json")
    assert code == 0 and "reading 2 file(s)" in err and json.loads(out)
    code, out, err = invoke("check", str(logs), "--format", "json", "-q")
    assert code == 0 and err == ""


@pytest.mark.integration
def test_make_demo_on_a_fresh_venv_needs_no_torch(tmp_path: Path) -> None:
    venv = tmp_path / "demo-venv"
    done = subprocess.run(["make", "demo", f"DEMO_VENV={venv}"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bug_local_mean" in done.stdout
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.util as u; print(u.find_spec('torch') is None, u.find_spec('transformers') is None)",
        ],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.split() == ["True", "True"]


def test_check_ends_with_one_line_of_runs_by_verdict_and_says_nothing_when_nothing_was_audited(tmp_path: Path) -> None:
    """The last line counts the runs by verdict (counts written down by hand in tests/expected.py); a path with
    nothing to audit leaves stdout empty (its one error line on stderr), and a folder of unrelated Parquet
    says it is not a tokaudit log."""
    from tests.expected import EXPECTED_VERDICT

    code, out, _ = invoke("check", str(SAMPLE_LOGS))
    verdicts = list(EXPECTED_VERDICT.values())
    last = " ".join(out.split("\n\n")[-1].split())  # the last paragraph, as one line (it wraps at 80 columns)
    assert last.startswith(
        f"{len(verdicts)} runs: {verdicts.count('correct')} correct, {verdicts.count('incorrect')} incorrect, "
        f"{verdicts.count('inconclusive')} inconclusive; "
    ), last
    code, out, err = invoke("check", str(tmp_path / "nothing"))
    assert (code, out) == (
        2,
        "",
    ) and err.strip() == f"tokaudit: error: {tmp_path / 'nothing'}: no such file or directory"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"user": [1, 2], "score": [0.5, 0.7]}), tmp_path / "other.parquet")
    code, out, err = invoke("check", str(tmp_path / "other.parquet"))
    assert (code, out) == (2, "")
    assert "not a tokaudit log (no column 'step', 'micro', 'rank', 'world_size'" in err


def test_no_ray_audits_in_this_process_whatever_the_settings_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ray = ADDRESS in [tool.tokaudit]: --no-ray wins, as every option on the command line does (none did)."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "pyproject.toml").write_text(f'[tool.tokaudit]\nray = "127.0.0.1:{port}"\n')
    monkeypatch.chdir(tmp_path)
    log = str(SAMPLE_LOGS / "bug_local_mean")
    code, _, err = invoke("check", log, "-q")
    assert code == 2 and "cannot reach the Ray cluster" in err
    code, out, err = invoke("check", log, "-q", "--format", "json", "--no-ray")
    assert (code, err) == (1, "") and json.loads(out)["runs"][0]["verdict"] == "incorrect"
    code, out, err = invoke("check", log, "--ray", f"127.0.0.1:{port}", "--no-ray")  # both said: which one?
    assert (code, out, err) == (2, "", "tokaudit: error: --ray and --no-ray: give one of them\n")
    # a malformed ray setting is read by no one under --no-ray (it stopped the command); the other settings hold
    (tmp_path / "pyproject.toml").write_text('[tool.tokaudit]\nray = 5\nfail-on = "never"\n')
    code, out, err = invoke("check", log, "-q", "--format", "json", "--no-ray")
    assert (code, err) == (0, "") and json.loads(out)["runs"][0]["verdict"] == "incorrect"
    code, out, err = invoke("check", log, "-q")
    assert (code, out) == (2, "") and "ray = 5: expected a cluster's address" in err


def test_settings_in_pyproject_apply_from_below_and_the_command_line_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[tool.tokaudit] of the first pyproject.toml from the current folder upward sets check's options (as ruff's
    and pytest's are found); an option given on the command line wins; --help names the file read; a setting
    that does not exist is one line naming the file, exit 2."""
    project = tmp_path / "project"
    (project / "src" / "deep").mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        '[tool.tokaudit]\nfail-on = "never"\nignore = ["reported_loss_mismatch"]\nrtol = 1e-3\n'
    )
    monkeypatch.chdir(project / "src" / "deep")
    log = str(SAMPLE_LOGS / "bug_local_mean")
    code, out, _ = invoke("check", log, "--format", "json")
    report = json.loads(out)
    assert code == 0 and [f["code"] for f in report["findings"]] == ["local_mean"] and report["runs"][0]["rtol"] == 1e-3
    assert invoke("check", log, "--fail-on", "error")[0] == 1
    assert f"[tool.tokaudit] of {project / 'pyproject.toml'}" in " ".join(invoke("check", "--help")[1].split())
    (project / "pyproject.toml").write_text('[tool.tokaudit]\nfail_on = "never"\n')
    code, out, err = invoke("check", log)
    assert (code, out) == (2, "") and err.strip() == (
        f"tokaudit: error: {project / 'pyproject.toml'}: [tool.tokaudit] "
        "has no setting 'fail_on' (settings: fail-on, ignore, rtol, min-ratio, ray)"
    )
    (project / "pyproject.toml").write_text("[tool.tokaudit]\nray = 5\n")
    code, out, err = invoke("check", log)
    assert (code, out) == (2, "") and err.strip() == (
        f"tokaudit: error: {project / 'pyproject.toml'}: [tool.tokaudit] "
        'ray = 5: expected a cluster\'s address, such as "auto"'
    )
    (project / "pyproject.toml").write_text('[tool.tokaudit]\nray = "runs/"\n')
    code, out, err = invoke("check", log)
    assert (code, out) == (2, "") and "ray: 'runs/' is no Ray cluster's address" in err
    (project / "pyproject.toml").write_text("[tool.tokaudit]\nrtol = 0.7\n")  # the file named, not --rtol
    code, out, err = invoke("check", log)
    assert (code, out) == (2, "") and err.strip() == (
        f"tokaudit: error: {project / 'pyproject.toml'}: [tool.tokaudit] rtol = 0.7: expected a finite number above 0 and "
        "below 0.5"
    )
    (project / "pyproject.toml").write_text("[tool.tokaudit]\nmin-ratio = 1" + "0" * 400 + "\n")  # no float
    code, out, err = invoke("check", log)
    assert (code, out) == (2, "") and "min-ratio = 1000" in err and "internal error" not in err
    (project / "pyproject.toml").write_text("[tool.tokaudit]\nmin-ratio = 9" + "0" * 307 + "\n")  # a float still
    assert invoke("check", log)[0] == 0  # (the local mean's ratio below it: information)
    (project / "pyproject.toml").write_text("[tool.black]\nx = 1" + "0" * 5000 + "\n")  # not ours, past int()'s digits
    assert invoke("check", log)[0] == 1
    (project / "pyproject.toml").write_text("[tool.tokaudit]\nmin-ratio = 0.5\n")
    code, out, err = invoke("check", log)
    assert (code, out) == (2, "") and f"{project / 'pyproject.toml'}: [tool.tokaudit] min-ratio = 0.5" in err


def test_a_folder_after_ray_is_not_taken_for_the_cluster_s_address() -> None:
    """--ray's value is optional, so `check --ray runs/` gives it the folder: that is said, with the way out, not
    "missing argument" nor an attempt to reach a cluster called runs/ (exit 2 either way)."""
    log = str(SAMPLE_LOGS / "bug_local_mean")
    for args in (["--ray", log], ["--ray", log, log], ["--ray", "s3://bucket/runs/"]):
        code, out, err = invoke("check", *args)
        assert (code, out) == (2, "") and f"'{args[1]}' is no Ray cluster's address" in err
        assert "give the paths before --ray" in err and "Missing argument" not in err
    for address in ("127.0.0.1:1", "localhost:1"):  # an address is tried: nothing answers there
        code, _, err = invoke("check", log, "--ray", address)
        assert code == 2 and f"cannot reach the Ray cluster at {address}" in err, err


def test_junit_has_one_test_case_per_run_failed_when_incorrect(tmp_path: Path) -> None:
    """`--format junit`: a test case per run (verdicts written down by hand in tests/expected.py): failed when
    incorrect, skipped when inconclusive, its findings in the XML; a run id with XML's own characters is data."""
    import xml.etree.ElementTree as ElementTree

    from tests.expected import EXPECTED_VERDICT
    from tests.logs import local_mean, records, write_by_rank, UNEVEN

    code, out, _ = invoke("check", str(SAMPLE_LOGS), "--format", "junit")
    suite = ElementTree.fromstring(out)
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert code == 1 and set(cases) == set(EXPECTED_VERDICT)
    for run, verdict in EXPECTED_VERDICT.items():
        kinds = [child.tag for child in cases[run] if child.tag in ("failure", "skipped")]
        assert kinds == {"incorrect": ["failure"], "inconclusive": ["skipped"], "correct": []}[verdict], run
    assert suite.get("failures") == str(list(EXPECTED_VERDICT.values()).count("incorrect"))
    assert "local_mean" in (cases["bug_local_mean"].find("failure").get("message") or "")  # type: ignore[union-attr]
    odd = "a<b>&\"c'"
    write_by_rank(tmp_path / "odd", records(UNEVEN, local_mean, run_id=odd))
    (case,) = ElementTree.fromstring(invoke("check", str(tmp_path / "odd"), "--format", "junit")[1]).iter("testcase")
    assert case.get("name") == odd


def test_a_folder_of_many_runs_reads_in_brief_and_one_run_in_full() -> None:
    """`make demo`'s output (every sample log) on a screen or two: each finding its header and the gist of its
    message, no fix; the same run given with --run: its findings in full."""
    code, out, _ = invoke("check", str(SAMPLE_LOGS), env={"COLUMNS": "100"})
    assert code == 1 and "fix:" not in out and len(out.splitlines()) <= 160
    assert "local_mean  bug_local_mean  steps 0–2 (3)" in out and "--run RUN" in out
    code, out, _ = invoke("check", str(SAMPLE_LOGS), "--run", "bug_local_mean", env={"COLUMNS": "100"})
    assert code == 1 and "fix: backpropagate W·S_r/N" in " ".join(out.split())


def test_a_misspelled_code_in_settings_names_the_file_and_a_broken_foreign_pyproject_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A code in [tool.tokaudit]'s ignore that does not exist is blamed on that file, not on --ignore; another
    project's pyproject.toml that is not TOML (no [tool.tokaudit] in it) does not stop the audit."""
    parent = tmp_path / "monorepo"
    (parent / "ours").mkdir(parents=True)
    (parent / "pyproject.toml").write_text("[project\nname = ")
    (parent / "ours" / "pyproject.toml").write_text('[tool.tokaudit]\nignore = ["locl_mean"]\n')
    monkeypatch.chdir(parent / "ours")
    code, _, err = invoke("check", str(SAMPLE_LOGS / "bug_local_mean"))
    assert code == 2 and err.strip() == (
        f"tokaudit: error: {parent / 'ours' / 'pyproject.toml'}: [tool.tokaudit] "
        "ignore: unknown code 'locl_mean' (did you mean local_mean?); "
        "`tokaudit explain` lists the codes"
    )
    # the settings are check's: explain and weights run, and check's --help shows the problem it will stop at
    assert invoke("explain", "local_mean")[0] == 0
    assert invoke("weights", str(SAMPLE_LOGS / "bug_local_mean"), "--step", "1")[0] == 0
    code, out, _ = invoke("check", "--help")
    assert code == 0 and "Settings: " in out and "unknown code 'locl_mean'" in " ".join(out.split())
    # a header missing its bracket is ours too: refused, not passed over for a file further up
    (parent / "ours" / "pyproject.toml").write_text('[tool.tokaudit\nfail-on = "never"\n')
    code, _, err = invoke("check", str(SAMPLE_LOGS / "bug_local_mean"))
    assert code == 2 and "cannot be read as TOML" in err
    (parent / "ours" / "pyproject.toml").unlink()
    code, out, _ = invoke("check", str(SAMPLE_LOGS / "bug_local_mean"), "--format", "json")
    assert code == 1 and json.loads(out)["runs"][0]["verdict"] == "incorrect"


def test_a_row_whose_q_shows_nothing_says_which_finding_decides() -> None:
    """padding_labelled: every valid token weighs 1/N (q 1, max ratio 1), yet padding carries weight: the row says
    which finding makes it incorrect, and the JSON lists the deciding codes of every run."""
    code, out, _ = invoke("check", str(SAMPLE_LOGS / "padding_labelled"))
    assert code == 1 and "padding_labelled: incorrect (by masked_tokens_weighted)" in out
    code, out, _ = invoke(
        "check", str(SAMPLE_LOGS / "padding_labelled"), str(SAMPLE_LOGS / "correct_token_mean_ga"), "--format", "json"
    )
    runs = {run["run"]: run for run in json.loads(out)["runs"]}
    assert runs["padding_labelled"]["decided_by"] == ["masked_tokens_weighted"]
    assert runs["correct_token_mean_ga"]["decided_by"] == []


def test_a_weighting_finding_carries_the_token_mean_as_code_for_its_set_up() -> None:
    """The fix of a local mean is code to paste: in the JSON (`fix_code`), under the finding in the table, and in
    `tokaudit explain`, with no line wrapped; every recipe is Python that compiles."""
    from tokaudit._recipes import RECIPES

    for name, recipe in RECIPES.items():
        compile(recipe, name, "exec")  # the `...` of TrainingArguments(...) is an Ellipsis: valid Python
    code, out, _ = invoke("check", str(SAMPLE_LOGS / "bug_local_mean"), "--format", "json")
    (local,) = [f for f in json.loads(out)["findings"] if f["code"] == "local_mean"]
    assert "global_valid_tokens" in local["fix_code"] and 'reduction="sum"' in local["fix_code"]
    assert "model.no_sync()" in local["fix_code"]  # a raw DDP loop: no integration named in the shards
    code, out, _ = invoke("check", str(SAMPLE_LOGS / "bug_local_mean"))
    assert "in code:" in out and "        token_mean_loss(loss_sum, N).backward()" in out
    code, out, _ = invoke("explain", "local_mean")
    longest = max(RECIPES["accelerate"].splitlines(), key=len)
    assert code == 0 and longest in out and "The token mean in Lightning" in out


def test_sync_of_a_spool_that_is_not_there_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A spool folder named that does not exist (a typo) is no empty spool: said, exit 2, never "nothing to sync"."""
    code, _, err = invoke("sync", str(tmp_path / "no-such-spool"))
    assert code == 2 and f"{tmp_path / 'no-such-spool'}: no such folder" in err
    (tmp_path / "empty").mkdir()
    code, _, err = invoke("sync", str(tmp_path / "empty"))
    assert code == 0 and "nothing to sync" in err


def test_one_run_or_code_given_alone_to_audit_is_that_one(tmp_path: Path) -> None:
    """`audit(path, runs="bad")` is the run named bad, not a run for each of its characters; so is an ignored code."""
    write_by_rank(tmp_path / "good", records(UNEVEN, token_mean))
    write_by_rank(tmp_path / "bad", records(UNEVEN, local_mean))
    report = audit(tmp_path, runs="bad", ignore="local_mean")
    assert [run.run for run in report.runs] == ["bad"] and report.runs[0].ignored == ["local_mean"]


def test_a_file_url_names_the_local_folder_for_the_recorder_and_the_command(tmp_path: Path) -> None:
    """file:///abs and file://localhost/abs (RFC 8089), percent-escapes decoded: the folder they name, where the
    recorder writes and the command reads (it said "no such file or directory", and the recorder made a folder named
    `file:`)."""
    import urllib.parse

    import torch

    from tokaudit.hooks import Recorder

    folder = tmp_path / "runs of a"
    url = "file://" + urllib.parse.quote(str(folder))
    with Recorder(url, run_id="exp") as rec:
        loss = torch.tensor([2.0, 3.0], requires_grad=True).sum()
        rec.record(loss_sum=loss, valid_tokens=2, backward_scalar=loss / 2)
        (loss / 2).backward()
    assert (folder / "exp").is_dir() and not (Path.cwd() / "file:").exists()
    for given in (
        url,
        "file://localhost" + urllib.parse.quote(str(folder)),
        "file:" + str(folder),
        f"file://127.0.0.1{url[7:]}",
    ):
        code, out, err = invoke("check", given, "--format", "json")
        assert code == 0 and [r["run"] for r in json.loads(out)["runs"]] == ["exp"], err
    for host in ("", "localhost"):
        report = tmp_path / f"report of a{host}.json"
        assert invoke("check", url, "-o", f"file://{host}" + urllib.parse.quote(str(report)))[0] == 0
        assert report.is_file()
    (tmp_path / "spool").mkdir()
    code, _, err = invoke("sync", f"file://localhost{tmp_path}/spool")
    assert code == 0 and "nothing to sync" in err, err
    code, _, err = invoke("check", f"file://{folder}#1")  # a bare '#' cuts no path short: the name is not found
    assert code == 2 and "#1" in err, err


def test_a_file_url_of_another_machine_is_refused_by_name_not_read_as_a_missing_local_file(tmp_path: Path) -> None:
    """file://host/path names a file of another machine: the command says so, for a log and for -o (it said "no such
    file or directory", and wrote the report to a folder named `file:`), and writes nothing."""
    logs = tmp_path / "logs"
    write_by_rank(logs / "exp", records(UNEVEN, token_mean))
    code, out, err = invoke("check", f"file://otherhost{logs}")
    assert code == 2 and "another machine ('otherhost')" in err and f"file://otherhost{logs}" in err, err
    code, _, err = invoke("check", str(logs), "-o", f"file://h2{tmp_path}/report.json")
    assert code == 2 and err.startswith("tokaudit: error: file://h2") and "another machine ('h2')" in err, err
    assert len(err.strip().splitlines()) == 1, err  # one line, as a path that names no file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"] and not (Path.cwd() / "file:").exists()


def test_a_command_s_option_written_before_the_command_says_where_it_goes() -> None:
    """`tokaudit --format json check …`: click said only "No such option '--format'"; the line names the commands that
    have it and where it is written. An option no command has is said as before."""
    from click.testing import CliRunner

    from tokaudit.cli import main

    result = CliRunner().invoke(main, ["--format", "json", "check", "runs/"])
    assert result.exit_code == 2 and result.stderr.splitlines()[-1] == (
        "Error: No such option '--format' before the command: it is an option of tokaudit check, tokaudit weights, "
        "tokaudit curve, written after it (tokaudit check … --format …)."
    )
    result = CliRunner().invoke(main, ["--bogus", "check", "runs/"])
    assert result.exit_code == 2 and result.stderr.splitlines()[-1] == "Error: No such option '--bogus'."
