"""What a command reads: its logs' validation started before the auditor is imported, and its options checked."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tokaudit.errors import EMPTY_PATH, UsageError
from tokaudit._outputs import STDOUT_CLOSED, note

if TYPE_CHECKING:
    from tokaudit._loading import Loading


def begin_loading(paths: tuple[str, ...], workers: int | None = None) -> Loading:
    """The validation of the logs' footers started as the audit loads them (`opening.open_logs`: footers
    only, a process a core unless `workers` says), before the command imports the auditor (pandas, DuckDB: half a
    second)."""
    from tokaudit._loading import cores, start_loading

    started = start_loading(paths, thorough=False, workers=cores() if workers is None else workers)
    for said in started.notes[:NOTES_SHOWN]:  # what is read from elsewhere is said, never followed in silence
        note(said)
    if len(started.notes) > NOTES_SHOWN:
        note(f"… and {len(started.notes) - NOTES_SHOWN} more notes")
    return started


NOTES_SHOWN = 5
"""Notes (links out of the folders given, what was skipped) shown one by one; the rest are counted."""


F = TypeVar("F", bound=Callable[..., Any])


def output_option(what: str) -> Callable[[F], F]:
    """-o/--output FILE: where a command writes what it shows; `-` is standard output, as Unix tools read a dash,
    not a file named `-`."""
    import click

    return click.option(
        "--output",
        "-o",
        type=click.Path(dir_okay=False, allow_dash=True),
        callback=lambda _, __, output: None if output == "-" else local_file(_, __, output),
        help=f"{what} (-: stdout).",
    )


def local_file(_: object, option: Any, given: str | None) -> Path | None:
    """A click callback: a path option as a Path, a file URL of this machine as the path it names
    (`storage.local_path`; the option's type must leave it a string: a Path has made file:///x file:/x)."""
    from tokaudit._storage import local_path, other_machine

    if given == "":
        named = option.opts[0] if option.param_type_name == "option" else option.human_readable_name
        raise UsageError(f"{named}: {EMPTY_PATH}")
    elsewhere = other_machine(given)
    if elsewhere is not None:  # one line, exit 2, as a path that names no file is said
        raise UsageError(f"{given}: {elsewhere}")
    return None if given is None else Path(local_path(given))


def refuse_inputs(output: Path | None, paths: tuple[str, ...], option: str = "--output") -> None:
    """An output that is one of the inputs would overwrite a log shard: refused before anything runs, naming the
    `option` that gave it."""
    if output is None:
        return
    from tokaudit._discovery import discover

    from tokaudit._storage import is_url, local_path

    local = [Path(local_path(p)) for p in paths if not is_url(p)]  # an output is a local file: no URL can be it
    target = output.resolve()
    taken = any(target == p.resolve() for p in local)
    if not taken and target.name.endswith(".parquet") and target.is_file():
        # Only a *.parquet file can be found inside an input folder (/dev/null never walks the tree).
        files, _ = discover(local)
        taken = any(os.path.samefile(target, f) for f in files)
    if taken:
        raise UsageError(f"{output}: is one of the logs being audited; choose another {option}")


def stdout_open(output: Path | None = None, option: str = "") -> None:
    """What goes to stdout where the command started with it closed (`>&-`: no `sys.stdout`, and click drops what
    is written there in silence, the exit code saying all went well) is refused before anything runs. `option`: the
    one that writes it to a file instead, where the command has one."""
    if output is None and sys.stdout is None:
        instead = f" or give {option} FILE" if option else ""
        raise UsageError(f"{STDOUT_CLOSED}{instead}")


def curve_outputs(paths: tuple[str, ...], csv_path: Path | None, plot_path: Path | None) -> None:
    """What `curve` writes, refused before anything is read where it cannot be written: stdout (the chart and table,
    or every step as JSON), and the --csv and --plot files."""
    stdout_open()
    for target, option in ((csv_path, "--csv"), (plot_path, "--plot")):
        if target == Path("-"):  # never a file named "-", as `-o -` is none
            raise UsageError(f"{option} names a file; `--format json` writes every step to standard output")
        refuse_inputs(target, paths, option)
    if csv_path is not None and plot_path is not None and csv_path.resolve() == plot_path.resolve():
        raise UsageError(f"--csv and --plot name one file ({csv_path}): the plot would write over the CSV")
    if plot_path is not None:
        from tokaudit._render.plot import check_format

        check_format(plot_path)


STEP_LIMIT = (1 << 63) - 1


def step_window(text: str | None) -> tuple[int, int] | None:
    """--steps FIRST:LAST, either end open, as (first, last)."""
    if text is None:
        return None
    first, colon, last = text.partition(":")
    try:
        if not colon:
            raise ValueError
        low = int(first) if first.strip() else -STEP_LIMIT - 1
        high = int(last) if last.strip() else STEP_LIMIT
    except ValueError:
        raise UsageError(f"--steps {text}: expected FIRST:LAST, such as 1000:2000, 1000: or :2000") from None
    if not -STEP_LIMIT - 1 <= low <= high <= STEP_LIMIT:  # (a log's steps are int64s, negative ones too)
        raise UsageError(f"--steps {text}: the first step must be at most the last, both whole numbers of 64 bits")
    return low, high


def ray_address(value: str | None) -> str | None:
    """--ray's value, where it is a Ray address: `--ray runs/` would take the folder for one (the option's value is
    optional, so the word after it is its value)."""
    import click

    from tokaudit._settings import ray_address_problem

    problem = None if not value else ray_address_problem(value)
    if problem is not None:
        raise click.BadParameter(f"{problem}: give the paths before --ray (check runs/ --ray), or --ray=ADDRESS")
    return value


def ray_choice(ray: str | None, no_ray: bool) -> str | None:
    """The Ray cluster `check` runs on: --ray's address (bare: RAY_ADDRESS, else `auto`), or none under --no-ray,
    which wins over a `ray` setting; both given on the command line is a usage error."""
    import click
    from click.core import ParameterSource

    given = click.get_current_context().get_parameter_source("ray") is ParameterSource.COMMANDLINE
    if no_ray and ray is not None and given:
        raise UsageError("--ray and --no-ray: give one of them")
    return None if ray is None or no_ray else ray or os.environ.get("RAY_ADDRESS") or "auto"
