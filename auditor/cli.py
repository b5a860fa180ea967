"""The `tokaudit` command line: load → audit → render → exit code (docs/cli.md)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from tokaudit import __version__
from tokaudit.codes import DEFAULT_RTOL
from tokaudit.errors import LogFormatError, TokauditError, UsageError
from tokaudit._outputs import (
    EXIT_BAD_INPUT,
    EXIT_FINDINGS,
    EXIT_OK,
    emit,
    fail,
    WEIGHTS_FORMAT_OF_SUFFIX,
    format_for,
    note,
    print_rich,
    problem,
    rich_text,
    stderr,
    wrote,
)
from tokaudit._outputs import run as outputs_run
from tokaudit._render.text import printable
from tokaudit._cli_exits import Guarded, exit_for_problems, fails
from tokaudit._settings import FAIL_ON_RANK, code_named
from tokaudit._cli_inputs import begin_loading, local_file, output_option, ray_address, ray_choice, refuse_inputs
from tokaudit._cli_inputs import curve_outputs, step_window, stdout_open
from tokaudit._cli_progress import reading_progress

if TYPE_CHECKING:
    from tokaudit._auditing import AuditedLog
    from tokaudit._report import AuditReport

WEIGHT_NAMES = {
    "grp": "group",
    "eff": "effective_weight",
    "q": "q",
    "eff_min": "effective_weight_min",
    "eff_max": "effective_weight_max",
}
"""`weights` columns under the log schema's names, and q as the table shows it."""


def _drawn_into(figures: dict[str, Any]) -> Callable[[AuditReport, AuditedLog], None]:
    """`audit_started(..., then)` for the HTML report: each run's figures, drawn from the audit's own aggregation."""

    def draw(report: AuditReport, log: AuditedLog) -> None:
        from tokaudit._figures import run_figures

        figures.update(
            run_figures(log, [run.run for run in report.runs], [run.run for run in report.runs if run.terms_pooled])
        )

    return draw


def run() -> None:
    """The `tokaudit` console script (`outputs.run`)."""
    outputs_run(main)


# Plain strings: a URL (s3://bucket/runs/) must reach the reader as written, not as a Path.
PATHS = click.argument("paths", nargs=-1, required=True, type=str)


@click.group(cls=Guarded, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tokaudit")
@click.option("--debug", is_flag=True, help="Show the Python traceback of an internal error.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Audit how distributed training normalized its token losses, from per-rank logs."""
    from tokaudit._settings import check_defaults

    ctx.obj = {"debug": debug, "settings": None, "settings_error": None, "ray_error": None}
    if ctx.invoked_subcommand != "check":
        return  # the settings are check's: a bad one never stops explain, weights or curve
    try:
        defaults, ctx.obj["settings"], ctx.obj["ray_error"] = check_defaults(Path.cwd(), list(FAIL_ON_RANK))
    except UsageError as error:  # said when check runs, after its --help (which names it) could be read
        ctx.obj["settings_error"] = error
        return
    if defaults:
        ctx.default_map = {"check": defaults}  # the command line wins


class _Settled(click.Command):
    """A command whose --help ends with the settings file it read (`tokaudit._settings`)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        source = (ctx.find_root().obj or {}).get("settings")
        error = (ctx.find_root().obj or {}).get("settings_error")
        formatter.write_paragraph()
        if error is not None:
            formatter.write(f"  Settings: {error}\n")
            return
        # written as it is: a path wrapped at its hyphens could not be copied
        formatter.write(
            f"  Settings: [tool.tokaudit] of {source}\n  (the command line wins).\n"
            if source
            else "  Settings: none read ([tool.tokaudit] in the first pyproject.toml\n  from here upward).\n"
        )


@main.command(cls=_Settled)
@PATHS
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json", "markdown", "github", "junit", "html"]),
    default="table",
    show_default=True,
    help="table for people, json for CI (docs/REPORT.md), markdown for a PR comment, github for workflow "
    "annotations (and the step summary when GITHUB_STEP_SUMMARY is set), junit for CI test reports "
    "(one test case per run), html for one self-contained page with a heat-map of the weights and "
    "the loss curves of each run (-o report.html).",
)
@output_option("Write the report here")
@click.option(
    "--fail-on",
    type=click.Choice(list(FAIL_ON_RANK)),
    default="error",
    show_default=True,
    help="Exit 1 when a finding of this severity or worse exists (`error` also when a run is called "
    "incorrect); `inconclusive`: also when a run cannot be shown correct.",
)
@click.option(
    "--ignore", "ignore", multiple=True, metavar="CODE", help="Leave out findings with this code (repeatable)."
)
@click.option(
    "--min-ratio",
    type=float,
    default=None,
    metavar="R",
    help="A weighting finding whose heaviest token weighs less than R× the lightest is information, "
    "not an error (e.g. 1.01).",
)
@click.option(
    "--rtol",
    type=float,
    default=DEFAULT_RTOL,
    show_default=True,
    help="Relative tolerance on weights (the default suits float32; a run whose records say they were "
    "computed in bf16 or fp16 is judged at that precision).",
)
@click.option("--run", "runs", multiple=True, help="Audit only this run (repeatable).")
@click.option(
    "--live",
    is_flag=True,
    help="The run is still training: leave out the newest steps that not every rank has flushed yet.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress on stderr.")
@click.option(
    "--ray",
    "ray",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="ADDRESS",
    callback=lambda _ctx, _param, value: ray_address(value),
    help="Read the footers and aggregate the step ranges on a Ray cluster's workers (Ray on this machine and every "
    "node): at ADDRESS, else RAY_ADDRESS, else `auto`. The workers read the log: object storage or a shared folder.",
)
@click.option("--no-ray", is_flag=True, help="Audit in this process, whatever [tool.tokaudit] ray says.")
def check(
    paths: tuple[str, ...],
    fmt: str,
    output: Path | None,
    fail_on: str,
    ignore: tuple[str, ...],
    min_ratio: float | None,
    rtol: float,
    runs: tuple[str, ...],
    live: bool,
    quiet: bool,
    ray: str | None,
    no_ray: bool,
) -> None:
    """Recover the normalization every run used and diagnose it.

    Exit 0: nothing at or above --fail-on; 1: findings; 2: bad usage or unreadable input; 130: interrupted
    (Ctrl-C); 141: the output's reader went away (| head) before the report was written.
    """
    settled = click.get_current_context().find_root().obj
    for error in (settled.get("settings_error"), None if no_ray else settled.get("ray_error")):
        if error is not None:
            raise error
    refuse_inputs(output, paths)
    stdout_open(output, "-o")
    fmt = format_for(fmt, output)
    address = ray_choice(ray, no_ray)
    with reading_progress(quiet) as progress:
        with begin_loading(paths, workers=1 if address else None) as started:
            from tokaudit._auditing import audit_started

            figures: dict[str, Any] = {}
            report = audit_started(
                paths,
                started,
                _drawn_into(figures) if fmt == "html" else None,
                rtol=rtol,
                runs=runs,
                live=live,
                progress=progress,
                ignore=ignore,
                min_ratio=min_ratio,
                ray=address,
            )
    if ignore:
        report = replace(report, ignored_from=_ignored_from())
    _render(report, fmt, output, figures, fail_on)
    for line in report.problems:
        problem(line)
    if report.problems:
        sys.exit(EXIT_BAD_INPUT)
    sys.exit(EXIT_FINDINGS if fails(report, fail_on) else EXIT_OK)


def _render(report: AuditReport, fmt: str, output: Path | None, figures: dict[str, Any], fail_on: str) -> None:
    """The report in the format asked, to stdout or `output`: those CI reads say the gate the command exits by."""
    if fmt == "json":
        from tokaudit._render.json_report import render_json

        emit(render_json(report), output)
    elif fmt == "markdown":
        from tokaudit._render.markdown import render_markdown

        emit(render_markdown(report, fail_on), output)
    elif fmt == "junit":
        from tokaudit._render.junit import render_junit

        emit(render_junit(report, fail_on), output)
    elif fmt == "html":
        from tokaudit._render.html import render_html

        emit(render_html(report, figures), output)
    elif fmt == "github":
        from tokaudit._render.github import render_annotations, write_step_summary

        emit(render_annotations(report, fail_on), output)
        write_step_summary(report, fail_on)
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


@main.command()
@PATHS
@click.option("--step", type=int, required=True, help="Optimizer step to show.")
@click.option("--run", default=None, help="Run id (needed when the logs hold several).")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json"]), default="table", show_default=True)
@output_option("Write them here")
def weights(paths: tuple[str, ...], step: int, run: str | None, fmt: str, output: Path | None) -> None:
    """Per rank and microbatch at one step: n, S, b, c, e and q = e·N (1 when correct)."""
    refuse_inputs(output, paths)
    stdout_open(output, "-o")
    fmt = format_for(fmt, output, WEIGHTS_FORMAT_OF_SUFFIX)
    with begin_loading(paths) as started:
        from tokaudit._postmortem import partial_note, step_weights, unseen_divisor_note

        try:
            chosen, records, problems = step_weights(paths, step, run, started=started)
        except TokauditError as error:
            fail(error)
    if records["rank"].nunique() < records["world_size"].max():
        note(partial_note([step]))
    if records["grad_divisor"].isna().any():
        note(unseen_divisor_note())
    if fmt == "csv":
        emit(records.rename(columns=WEIGHT_NAMES).to_csv(index=False), output)
    elif fmt == "json":
        import json

        from tokaudit._render.json_report import sanitize

        rows = records.rename(columns=WEIGHT_NAMES).to_dict(orient="records")
        emit(
            json.dumps(sanitize({"run": chosen, "step": step, "records": rows}), indent=2, ensure_ascii=False) + "\n",
            output,
        )
    else:
        from tokaudit._postmortem import probe_extremes
        from tokaudit._render.console import render_weights

        probe = probe_extremes(records)
        text = rich_text(lambda console: render_weights(chosen, step, records, probe, console), output)
        if text is not None:
            emit(text, output)
    exit_for_problems(problems)


@main.command()
@PATHS
@click.option("--run", default=None, help="Run id (needed when the logs hold several).")
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False),
    callback=local_file,
    help="Write every step's values as CSV.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    callback=local_file,
    help="Draw the curves as a PNG (needs matplotlib).",
)
@click.option(
    "--steps",
    "step_range",
    default=None,
    metavar="FIRST:LAST",
    help="Only these steps (either end may be left open: 1000: or :2000); only the shards that can hold them are read.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="table: the chart and a table for people; json: every step's values on stdout.",
)
def curve(
    paths: tuple[str, ...],
    run: str | None,
    csv_path: Path | None,
    plot_path: Path | None,
    step_range: str | None,
    fmt: str,
) -> None:
    """Loss per step: the true token mean ΣS/N, the mean of local means, the reported loss, and the
    objective the optimizer followed (Σe·S)."""
    try:
        curve_outputs(paths, csv_path, plot_path)
        window = step_window(step_range)
        with begin_loading(paths) as started:
            from tokaudit._postmortem import curve_parts
            from tokaudit._render.curve import curve_views

            curve, problems = curve_parts(paths, run, steps=window, started=started)
        if partial := curve.partial_steps():
            from tokaudit._postmortem import partial_note

            note(partial_note(partial))
        if fmt == "json":
            _curve_json(curve, csv_path, plot_path)
            exit_for_problems(problems)
        from tokaudit._render.console import render_curve_table

        console = Console(highlight=False)
        try:
            # the chart fills the terminal, labels included
            views = curve_views(
                curve, curve.labels(), csv_path, width=max(20, min(console.width - 18, 160)), plot=plot_path is not None
            )
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
    exit_for_problems(problems)


def _curve_json(curve: Any, csv_path: Path | None, plot_path: Path | None) -> None:
    """`curve --format json`: {"run", "series": {key: label}, "steps": [one object a step]}, written a part at a
    time (a run of millions of steps is never held whole); --csv and --plot are for the table format."""
    import json

    from tokaudit._render.json_report import sanitize

    try:
        if csv_path is not None or plot_path is not None:
            raise UsageError("--csv and --plot go with --format table; --format json writes every step to stdout")
        click.echo(
            f'{{"run": {json.dumps(curve.run, ensure_ascii=False)}, '
            f'"series": {json.dumps(dict(curve.labels()), ensure_ascii=False)}, "steps": [',
            nl=False,
        )
        first = True
        for part in curve.parts():
            for row in part.to_dict("records"):
                click.echo(("" if first else ",") + "\n  " + json.dumps(sanitize(row), ensure_ascii=False), nl=False)
                first = False
        click.echo("\n]}")
    finally:
        curve.close()


@main.command()
@click.argument("code", required=False)
def explain(code: str | None) -> None:
    """The derivation, the fix and a worked two-rank example for a finding CODE (all codes without one)."""
    from tokaudit._explain import explain as explain_text, explain_code, listing

    stdout_open()
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
        indent = line[: len(line) - len(line.lstrip())]
        out.append(
            textwrap.fill(
                line, width, initial_indent="", subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
            )
            if len(line) > width
            else line
        )
    return "\n".join(out)


@main.command()
@click.argument("folder", required=False, type=click.Path(file_okay=False), callback=local_file)
def sync(folder: Path | None) -> None:
    """Write the shards a recorder kept in its local spool (the store did not answer by close()) to where they
    were going. FOLDER: the spool (default: TOKAUDIT_SPOOL, else ~/.cache/tokaudit/spool)."""
    from tokaudit._schema import spool_folder
    from tokaudit._spool import spooled, sync_one

    if folder is not None and not folder.is_dir():  # a spool named that is not there is no empty spool
        raise UsageError(f"{folder}: no such folder (the spool: TOKAUDIT_SPOOL, else ~/.cache/tokaudit/spool)")
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
    exit_for_problems(failed)


if __name__ == "__main__":
    main()
