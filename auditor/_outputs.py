"""Where the command line writes: the report on stdout or whole in a file, one line on stderr for an error, and
exit 130 for a Ctrl-C at any moment."""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from tokaudit.errors import TokauditError, UsageError
from tokaudit._render.text import printable

EXIT_OK, EXIT_FINDINGS, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED, EXIT_CLOSED_PIPE = 130, 141
"""128 + SIGINT and 128 + SIGPIPE, as a shell reports a Unix tool stopped by Ctrl-C or by a reader that went away."""


STDOUT_CLOSED = "stdout is closed: what this command writes there would be lost; open it"
"""What a command started with stdout closed (`>&-`) says before it runs (`cli_inputs.stdout_open`, `run`)."""


def stderr() -> Console:
    return Console(stderr=True, highlight=False)


def problem(line: str) -> None:
    # one unwrapped line, whatever the terminal width; text from files and logs printed literally
    click.echo(f"tokaudit: error: {printable(line)}", err=True)


def note(line: str) -> None:
    """A note on stderr, as `problem` writes an error: one line, text from the logs printed literally."""
    click.echo(f"tokaudit: note: {printable(line)}", err=True)


def fail(error: TokauditError) -> None:
    problem(str(error))  # one line: the file (or option) and what is wrong with it
    sys.exit(EXIT_BAD_INPUT)


def emit(text: str, output: Path | None) -> None:
    """The report on stdout, or whole in `output`: written beside it and renamed over it, so that a full disk or
    a kill leaves the file that was there before (a device or a pipe, such as /dev/null, is written as it is)."""
    if output is None:
        click.echo(text, nl=False)
        return
    temporary: Path | None = None
    try:
        if output.exists() and not output.is_file():
            output.write_text(text, encoding="utf-8")
        else:
            handle, name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent)
            temporary = Path(name)
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(text)
            os.chmod(temporary, _mode_of(output))  # mkstemp's file is the owner's alone
            os.replace(temporary, output)
            temporary = None
    except OSError as error:
        raise UsageError(f"{output}: cannot write the report ({error.strerror or error})") from None
    finally:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
    if output.is_file():  # a device (/dev/null) or a pipe is no file written
        wrote(str(output))


def _mode_of(output: Path) -> int:
    """The permissions the report gets: those of the file it replaces, else a new file's under the umask."""
    try:
        return output.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def wrote(where: str, detail: str = "") -> None:
    """`wrote WHERE` on stderr, one line never wrapped (a path cut by a terminal's width cannot be copied)."""
    click.echo(f"wrote {printable(where)}{detail}", err=True)


FORMAT_OF_SUFFIX = {
    ".html": "html",
    ".htm": "html",
    ".json": "json",
    ".xml": "junit",
    ".md": "markdown",
    ".txt": "table",
    ".log": "table",
}
"""`check -o FILE` without --format: the format FILE's extension names."""


WEIGHTS_FORMAT_OF_SUFFIX = {".csv": "csv", ".json": "json", ".txt": "table", ".log": "table"}
"""`tokaudit weights -o`'s extensions."""


def format_for(fmt: str, output: Path | None, suffixes: dict[str, str] = FORMAT_OF_SUFFIX) -> str:
    """--format as given, else the one -o's extension names (`suffixes`); an extension that names none is refused."""
    if output is None or click.get_current_context().get_parameter_source("fmt") not in (
        click.core.ParameterSource.DEFAULT,
        None,
    ):
        return fmt
    found = suffixes.get(output.suffix.lower())
    if found is None:
        named = sorted(suffixes)
        raise UsageError(
            f"-o {output}: cannot tell the format from the extension {output.suffix or '(none)'!r}; "
            f"give --format (or name the file {', '.join(named[:-1])} or {named[-1]})"
        )
    return found


def run(main: Callable[..., Any]) -> None:
    """The console script: `main`, where a Ctrl-C at any moment, the exit's own clean-up included, is one line and
    exit 130."""
    # the last of the exit's clean-up (registered first, called last): from there the interpreter resets the signal
    # handlers it installed, and a Ctrl-C would kill the process silently (any of its threads may take it). Ignored
    # instead (a disposition of the whole process, which the interpreter leaves alone), the exit code stands.
    atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
    if sys.stdout is None and {"-h", "--help", "--version"} & set(sys.argv[1:]):  # what click writes before a command
        problem(STDOUT_CLOSED)
        sys.exit(EXIT_BAD_INPUT)
    try:
        main(prog_name="tokaudit")
    except KeyboardInterrupt:
        interrupted()
    except OSError as error:  # what click writes before a command runs (--help, --version), or stderr itself
        with contextlib.suppress(OSError):
            problem(f"{getattr(error, 'filename', None) or 'output'}: {error.strerror or error}")
        # what is left in the buffer would fail again at exit, in a traceback of the interpreter's own
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(EXIT_BAD_INPUT)
    finally:
        signal.signal(signal.SIGINT, interrupted_now)


def interrupted_now(signum: int, frame: Any) -> None:
    problem("interrupted")
    os._exit(EXIT_INTERRUPTED)  # the report, if any, is out already: nothing else is left to stop


def closed_pipe() -> None:
    """The reader went away (| head): nothing left to say, and nothing left to flush at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(EXIT_CLOSED_PIPE)


def interrupted() -> None:
    problem("interrupted")  # one line, not click's "Aborted!" and exit 1, which means findings
    sys.exit(EXIT_INTERRUPTED)


def rich_text(render: Callable[[Console], None], output: Path | None) -> str | None:
    """Render to the terminal (colors when it is one), or to plain text for --output or a pipe."""
    if output is None:
        console = Console(highlight=False)
        if console.is_terminal:
            render(console)
            return None
        width = console.width
    else:
        width = 140
    buffer = io.StringIO()
    render(Console(file=buffer, width=width, no_color=True, highlight=False, force_terminal=False))
    # rich pads every line to the width: a pipe, a CI log or a file gets the text without the padding
    return "\n".join(line.rstrip() for line in buffer.getvalue().split("\n"))


def print_rich(render: Callable[[Console], None]) -> None:
    """Render to the terminal, or, to a pipe, as plain text without trailing spaces."""
    text = rich_text(render, None)
    if text is not None:
        click.echo(text, nl=False)
