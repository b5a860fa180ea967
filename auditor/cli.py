"""The `tokaudit` command line: load → audit → render → exit code (docs/cli.md)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from tokaudit import __version__
from tokaudit.codes import DEFAULT_RTOL, Severity, code_named
from tokaudit.errors import LogFormatError, TokauditError, UsageError
from tokaudit._outputs import (EXIT_BAD_INPUT, EXIT_CLOSED_PIPE, EXIT_FINDINGS, EXIT_OK,
                               emit, fail, format_for, interrupted, print_rich, problem, rich_text, stderr, wrote)
from tokaudit._outputs import run as outputs_run
from tokaudit._render.text import printable

if TYPE_CHECKING:
    from tokaudit._auditing import AuditedLog
    from tokaudit._loading import Loading
    from tokaudit._report import AuditReport

WEIGHT_NAMES = {"grp": "group", "eff": "effective_weight", "q": "q", "eff_min": "effective_weight_min",
                "eff_max": "effective_weight_max"}
"""`weights` columns under the log schema's names, and q as the table shows it."""
FAIL_ON = {"error": Severity.ERROR.rank, "inconclusive": Severity.ERROR.rank, "warning": Severity.WARNING.rank,
           "info": Severity.INFO.rank, "never": 99}


def _start_loading(paths: tuple[str, ...], workers: int | None = None) -> Loading:
    """The validation of the logs' footers started as the audit loads them (`auditing.open_logs`: footers
    only, a process a core unless `workers` says), before the command imports the auditor (pandas, DuckDB: half a
    second)."""
    from tokaudit._loading import cores, start_loading

    started = start_loading(paths, thorough=False, workers=cores() if workers is None else workers)
    for note in started.notes[:NOTES_SHOWN]:  # what is read from elsewhere is said, never followed in silence
        click.echo(f"tokaudit: note: {printable(note)}", err=True)  # one unwrapped line, as problem's
    if len(started.notes) > NOTES_SHOWN:
        click.echo(f"tokaudit: note: … and {len(started.notes) - NOTES_SHOWN} more links out of the folders given",
                   err=True)
    return started


NOTES_SHOWN = 5
"""Links out of the folders given that are named one by one; the rest are counted."""


def _drawn_into(figures: dict[str, Any]) -> Callable[[AuditReport, AuditedLog], None]:
    """`audit_started(..., then)` for the HTML report: each run's figures, drawn from the audit's own aggregation."""

    def draw(report: AuditReport, log: AuditedLog) -> None:
        from tokaudit._figures import run_figures

        figures.update(run_figures(log, [run.run for run in report.runs],
                                   [run.run for run in report.runs if run.terms_pooled]))

    return draw


def _refuse_inputs(output: Path | None, paths: tuple[str, ...]) -> None:
    """An output that is one of the inputs would overwrite a log shard: refused before anything runs."""
    if output is None:
        return
    from tokaudit._loading import discover

    from tokaudit._storage import is_url

    local = [Path(p) for p in paths if not is_url(p)]  # an output is a local file: no URL can be it
    target = output.resolve()
    taken = any(target == p.resolve() for p in local)
    if not taken and target.name.endswith(".parquet") and target.is_file():
        # Only a *.parquet file can be found inside an input folder (/dev/null never walks the tree).
        files, _ = discover(local)
        taken = any(os.path.samefile(target, f) for f in files)
    if taken:
        raise UsageError(f"{output}: is one of the logs being audited; choose another --output")


def run() -> None:
    """The `tokaudit` console script (`outputs.run`)."""
    outputs_run(main)


class _Guarded(click.Group):
    """Every failure ends in exit 2 with one line: exit 1 means findings and nothing else."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, SystemExit):
            raise
        except TokauditError as error:
            fail(error)
        except KeyboardInterrupt:
            interrupted()
        except BrokenPipeError:
            # the reader went away (| head): nothing left to say, and nothing left to flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_CLOSED_PIPE)
        except OSError as error:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            problem(f"{getattr(error, 'filename', None) or 'output'}: {error.strerror or error}")
            sys.exit(EXIT_BAD_INPUT)
        except Exception as error:
            # DuckDB turns a Ctrl-C inside a query into its InterruptException, or a RuntimeError of this text
            # where a result is being fetched; pyarrow, reading, into ArrowCancelled
            if type(error).__name__ in ("InterruptException", "ArrowCancelled") or str(error) == "Query interrupted":
                interrupted()
            if ctx.obj and ctx.obj.get("debug"):
                raise
            problem(f"internal error: {type(error).__name__}: {printable(str(error))[:300]} "
                     "(rerun with --debug for the traceback, and please report it)")
            sys.exit(EXIT_BAD_INPUT)


# Plain strings: a URL (s3://bucket/runs/) must reach the reader as written, not as a Path.
PATHS = click.argument("paths", nargs=-1, required=True, type=str)


@click.group(cls=_Guarded, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tokaudit")
@click.option("--debug", is_flag=True, help="Show the Python traceback of an internal error.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Audit how distributed training normalized its token losses, from per-rank logs."""
    from tokaudit._settings import check_defaults

    ctx.obj = {"debug": debug}
    defaults, ctx.obj["settings"] = check_defaults(Path.cwd(), list(FAIL_ON))
    if defaults:
        ctx.default_map = {"check": defaults}  # the command line wins


class _Settled(click.Command):
    """A command whose --help ends with the settings file it read (`tokaudit._settings`)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        source = (ctx.find_root().obj or {}).get("settings")
        formatter.write_paragraph()
        # written as it is: a path wrapped at its hyphens could not be copied
        formatter.write(f"  Settings: [tool.tokaudit] of {source}\n  (the command line wins).\n" if source else
                        "  Settings: none read ([tool.tokaudit] in the first pyproject.toml\n  from here upward).\n")


@main.command(cls=_Settled)
@PATHS
@click.option("--format", "fmt", type=click.Choice(["table", "json", "markdown", "github", "junit", "html"]),
              default="table", show_default=True,
              help="table for people, json for CI (docs/REPORT.md), markdown for a PR comment, github for workflow "
                   "annotations (and the step summary when GITHUB_STEP_SUMMARY is set), junit for CI test reports "
                   "(one test case per run), html for one self-contained page with a heat-map of the weights and "
                   "the loss curves of each run (-o report.html).")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Write the report here.")
@click.option("--fail-on", type=click.Choice(list(FAIL_ON)), default="error", show_default=True,
              help="Exit 1 when a finding of this severity or worse exists (`error` also when a run is called "
                   "incorrect); `inconclusive`: also when a run cannot be shown correct.")
@click.option("--ignore", "ignore", multiple=True, metavar="CODE",
              help="Leave out findings with this code (repeatable).")
@click.option("--min-ratio", type=float, default=None, metavar="R",
              help="A weighting finding whose heaviest token weighs less than R× the lightest is information, "
                   "not an error (e.g. 1.01).")
@click.option("--rtol", type=float, default=DEFAULT_RTOL, show_default=True,
              help="Relative tolerance on weights (the default suits float32; a run whose records say they were "
                   "computed in bf16 or fp16 is judged at that precision).")
@click.option("--run", "runs", multiple=True, help="Audit only this run (repeatable).")
@click.option("--live", is_flag=True, help="The run is still training: leave out the newest steps that not "
                                           "every rank has flushed yet.")
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
@click.option("--ray", "ray", is_flag=False, flag_value="", default=None, metavar="ADDRESS",
              help="Read the footers and aggregate the step ranges on a Ray cluster's workers (pip install "
                   "'tokaudit[ray]'): at ADDRESS, else RAY_ADDRESS, else `auto` (one running here). The workers read "
                   "the log themselves: object storage or a folder they all see.")
def check(paths: tuple[str, ...], fmt: str, output: Path | None, fail_on: str, ignore: tuple[str, ...],
          min_ratio: float | None, rtol: float, runs: tuple[str, ...], live: bool, quiet: bool,
          ray: str | None) -> None:
    """Recover the normalization every run used and diagnose it.

    Exit 0: nothing at or above --fail-on; 1: findings; 2: bad usage or unreadable input; 130: interrupted
    (Ctrl-C); 141: the output's reader went away (| head).
    """
    _refuse_inputs(output, paths)
    fmt = format_for(fmt, output)
    address = None if ray is None else ray or os.environ.get("RAY_ADDRESS") or "auto"
    with _progress(quiet) as progress:
        with _start_loading(paths, workers=1 if address else None) as started:
            from tokaudit._auditing import audit_started

            figures: dict[str, Any] = {}
            report = audit_started(paths, started, _drawn_into(figures) if fmt == "html" else None, rtol=rtol,
                                   runs=runs, live=live, progress=progress, ignore=ignore, min_ratio=min_ratio,
                                   ray=address)
    if ignore:
        report = replace(report, ignored_from=_ignored_from())
    _render(report, fmt, output, figures)
    for line in report.problems:
        problem(line)
    if report.problems:
        sys.exit(EXIT_BAD_INPUT)
    worst = max((f.severity.rank for f in report.findings), default=-1)
    # what fails the command: the listed findings' own verdict (an ignored code never fails it)
    gates = [run.gate_verdict or run.verdict for run in report.runs]
    if fail_on == "inconclusive":
        failed = worst >= Severity.ERROR.rank or any(verdict != "correct" for verdict in gates)
    elif fail_on == "error":
        # the default: a run reported incorrect never exits 0, whatever the severity of the findings that say so
        failed = worst >= FAIL_ON[fail_on] or any(verdict == "incorrect" for verdict in gates)
    else:
        failed = worst >= FAIL_ON[fail_on]
    sys.exit(EXIT_FINDINGS if failed else EXIT_OK)


def _render(report: AuditReport, fmt: str, output: Path | None, figures: dict[str, Any]) -> None:
    """The report in the format asked, to stdout or `output`."""
    if fmt == "json":
        from tokaudit._render.json_report import render_json

        emit(render_json(report), output)
    elif fmt == "markdown":
        from tokaudit._render.markdown import render_markdown

        emit(render_markdown(report), output)
    elif fmt == "junit":
        from tokaudit._render.junit import render_junit

        emit(render_junit(report), output)
    elif fmt == "html":
        from tokaudit._render.html import render_html

        emit(render_html(report, figures), output)
    elif fmt == "github":
        from tokaudit._render.github import render_annotations, write_step_summary

        emit(render_annotations(report), output)
        write_step_summary(report)
    else:
        from tokaudit._render.console import render_report

        text = rich_text(lambda console: render_report(report, console), output)
        if text is not None:
            emit(text, output)


def _ignored_from() -> str:
    """Where `tokaudit check` took its --ignore codes from: the command line, or the settings file."""
    context = click.get_current_context()
    if context.get_parameter_source("ignore") == click.core.ParameterSource.DEFAULT_MAP:
        return f"[tool.tokaudit] in {(context.find_root().obj or {}).get('settings')}"
    return "--ignore"


@contextmanager
def _progress(quiet: bool) -> Iterator[Callable[[str], None] | None]:
    """What the audit is reading: on a terminal a transient status line, and one progress bar over the ranges it
    aggregates ("… (i/n)"); in a pipe or a CI log a few plain lines: the first range, each quarter, the last."""
    if quiet:
        yield None
        return
    console = stderr()
    if not console.is_terminal:
        def line(message: str) -> None:
            done = _RANGE.search(message)
            if done is None or _quarter_passed(int(done[1]), int(done[2])):
                console.print(printable(message), style="dim", markup=False)
        yield line
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}", style="dim"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("reading logs", total=None)

        def show(message: str) -> None:
            done = _RANGE.search(message)
            if done is None:
                bar.update(task, description=printable(message))
            else:
                bar.update(task, description="aggregating steps", completed=int(done[1]) - 1, total=int(done[2]))
        yield show


_RANGE = re.compile(r"\((\d+)/(\d+)\)$")
"""The engine's "aggregating steps a–b (i/n)": range i of n."""


def _quarter_passed(index: int, total: int) -> bool:
    """Whether range `index` of `total` is one a log shows: the first, the last, and the first past each quarter."""
    return index in (1, total) or (index * 4) // total != ((index - 1) * 4) // total


@main.command()
@PATHS
@click.option("--step", type=int, required=True, help="Optimizer step to show.")
@click.option("--run", default=None, help="Run id (needed when the logs hold several).")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Write them here.")
def weights(paths: tuple[str, ...], step: int, run: str | None, fmt: str, output: Path | None) -> None:
    """Per rank and microbatch at one step: n, S, b, c, e and q = e·N (1 when correct)."""
    _refuse_inputs(output, paths)
    with _start_loading(paths) as started:
        from tokaudit._postmortem import step_weights

        try:
            chosen, records, problems = step_weights(paths, step, run, started=started)
        except TokauditError as error:
            fail(error)
    if fmt == "csv":
        emit(records.rename(columns=WEIGHT_NAMES).to_csv(index=False), output)
    elif fmt == "json":
        import json

        from tokaudit._render.json_report import sanitize

        rows = records.rename(columns=WEIGHT_NAMES).to_dict(orient="records")
        emit(json.dumps(sanitize({"run": chosen, "step": step, "records": rows}), indent=2, ensure_ascii=False)
              + "\n", output)
    else:
        from tokaudit._postmortem import probe_extremes
        from tokaudit._render.console import render_weights

        probe = probe_extremes(records)
        text = rich_text(lambda console: render_weights(chosen, step, records, probe, console), output)
        if text is not None:
            emit(text, output)
    _exit_for_problems(problems)


@main.command()
@PATHS
@click.option("--run", default=None, help="Run id (needed when the logs hold several).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write every step's values as CSV.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw the curves as a PNG (needs matplotlib).")
@click.option("--steps", "step_range", default=None, metavar="FIRST:LAST",
              help="Only these steps (either end may be left open: 1000: or :2000); only the shards that can "
                   "hold them are read.")
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="table: the chart and a table for people; json: every step's values on stdout.")
def curve(paths: tuple[str, ...], run: str | None, csv_path: Path | None, plot_path: Path | None,
          step_range: str | None, fmt: str) -> None:
    """Loss per step: the true token mean ΣS/N, the mean of local means, the reported loss, and the
    objective the optimizer followed (Σe·S)."""
    try:
        for target in (csv_path, plot_path):
            _refuse_inputs(target, paths)
        if plot_path is not None:
            from tokaudit._render.plot import check_format

            check_format(plot_path)
        window = _step_range(step_range)
        with _start_loading(paths) as started:
            from tokaudit._postmortem import curve_parts
            from tokaudit._render.curve import curve_views

            curve, problems = curve_parts(paths, run, steps=window, started=started)
        if fmt == "json":
            _curve_json(curve, csv_path, plot_path)
            _exit_for_problems(problems)
        from tokaudit._render.console import render_curve_table

        console = Console(highlight=False)
        try:
            # the chart fills the terminal, labels included
            views = curve_views(curve, curve.labels(), csv_path, width=max(20, min(console.width - 18, 160)),
                                plot=plot_path is not None)
        finally:
            curve.close()
        if plot_path is not None:
            from tokaudit._render.plot import write_png

            write_png(curve.run, views.points, curve.labels(), plot_path)
    except TokauditError as error:
        fail(error)
    def render(console: Console) -> None:
        console.print(views.chart.render(), markup=False, highlight=False)
        render_curve_table(curve.run, views.shown, views.steps, curve.labels(), console)

    print_rich(render)
    for path in (csv_path, plot_path):
        if path is not None:
            wrote(str(path))
    _exit_for_problems(problems)


def _curve_json(curve: Any, csv_path: Path | None, plot_path: Path | None) -> None:
    """`curve --format json`: {"run", "series": {key: label}, "steps": [one object a step]}, written a part at a
    time (a run of millions of steps is never held whole); --csv and --plot are for the table format."""
    import json

    from tokaudit._render.json_report import sanitize

    try:
        if csv_path is not None or plot_path is not None:
            raise UsageError("--csv and --plot go with --format table; --format json writes every step to stdout")
        click.echo(f'{{"run": {json.dumps(curve.run, ensure_ascii=False)}, '
                   f'"series": {json.dumps(dict(curve.labels()), ensure_ascii=False)}, "steps": [', nl=False)
        first = True
        for part in curve.parts():
            for row in part.to_dict("records"):
                click.echo(("" if first else ",") + "\n  " + json.dumps(sanitize(row), ensure_ascii=False), nl=False)
                first = False
        click.echo("\n]}")
    finally:
        curve.close()


STEP_LIMIT = (1 << 63) - 1


def _step_range(text: str | None) -> tuple[int, int] | None:
    """--steps FIRST:LAST, either end open, as (first, last)."""
    if text is None:
        return None
    first, colon, last = text.partition(":")
    try:
        if not colon:
            raise ValueError
        low = int(first) if first.strip() else 0
        high = int(last) if last.strip() else STEP_LIMIT
    except ValueError:
        raise UsageError(f"--steps {text}: expected FIRST:LAST, such as 1000:2000, 1000: or :2000") from None
    if not 0 <= low <= high <= STEP_LIMIT:
        raise UsageError(f"--steps {text}: the first step must be at least 0 and at most the last")
    return low, high


@main.command()
@click.argument("code", required=False)
def explain(code: str | None) -> None:
    """The derivation, the fix and a worked two-rank example for a finding CODE (all codes without one)."""
    from tokaudit._explain import explain as explain_text, explain_code, listing

    if code is None:
        for line in listing():
            click.echo(line)
        return
    try:
        chosen = code_named(code)
    except ValueError as error:
        problem(f"{error}; `tokaudit explain` lists them")
        sys.exit(EXIT_BAD_INPUT)
    click.echo(_wrapped(explain_text(chosen)) + "\n" + explain_code(chosen), nl=False)


def _wrapped(text: str) -> str:
    """Each line of prose wrapped to the terminal (at most 100 columns, 80 in a pipe), its indent kept on every
    line; words are never cut."""
    import shutil
    import textwrap

    width = min(100, shutil.get_terminal_size((80, 24)).columns)
    out = []
    for line in text.splitlines():
        indent = line[:len(line) - len(line.lstrip())]
        out.append(textwrap.fill(line, width, initial_indent="", subsequent_indent=indent, break_long_words=False,
                                 break_on_hyphens=False) if len(line) > width else line)
    return "\n".join(out)


@main.command()
@click.argument("folder", required=False, type=click.Path(file_okay=False, path_type=Path))
def sync(folder: Path | None) -> None:
    """Write the shards a recorder kept in its local spool (the store did not answer by close()) to where they
    were going. FOLDER: the spool (default: TOKAUDIT_SPOOL, else ~/.cache/tokaudit/spool)."""
    from tokaudit._schema import spool_folder
    from tokaudit._spool import spooled, sync_one

    failed: list[LogFormatError] = []
    done = 0
    for path in spooled(folder or spool_folder()):
        try:
            synced = sync_one(path)
        except LogFormatError as error:
            failed.append(error)
            continue
        done += 1
        wrote(synced.destination, f" ({synced.records} records)")
    if not done and not failed:
        stderr().print(f"nothing to sync in {printable(str(folder or spool_folder()))}", markup=False)
    _exit_for_problems(failed)


def _exit_for_problems(problems: list[LogFormatError]) -> None:
    for error in problems:
        problem(str(error))
    sys.exit(EXIT_BAD_INPUT if problems else EXIT_OK)


if __name__ == "__main__":
    main()
