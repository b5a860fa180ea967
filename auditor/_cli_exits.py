"""How a command ends: every failure one line and exit 2, findings at --fail-on exit 1 (docs/cli.md)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click

from tokaudit.errors import LogFormatError, TokauditError
from tokaudit._outputs import EXIT_BAD_INPUT, EXIT_CLOSED_PIPE, EXIT_OK, fail, interrupted, problem
from tokaudit._render.text import printable

if TYPE_CHECKING:
    from tokaudit._report import AuditReport


class Guarded(click.Group):
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
            problem(
                f"internal error: {type(error).__name__}: {printable(str(error))[:300]} "
                "(rerun with --debug for the traceback, and please report it)"
            )
            sys.exit(EXIT_BAD_INPUT)


def fails(report: AuditReport, fail_on: str) -> bool:
    """Whether `tokaudit check --fail-on` exits 1 for this report: a run fails (`AuditReport.failing`)."""
    return bool(report.failing(fail_on))


def exit_for_problems(problems: list[LogFormatError]) -> None:
    """Each problem one line on stderr, then exit 2 where there is one, else 0."""
    for error in problems:
        problem(str(error))
    sys.exit(EXIT_BAD_INPUT if problems else EXIT_OK)
