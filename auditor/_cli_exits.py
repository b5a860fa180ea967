"""How a command ends: every failure one line and exit 2, findings at --fail-on exit 1 (docs/cli.md)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click

from tokaudit.codes import Severity
from tokaudit.errors import LogFormatError, TokauditError
from tokaudit._outputs import EXIT_BAD_INPUT, EXIT_CLOSED_PIPE, EXIT_OK, fail, interrupted, problem
from tokaudit._render.text import printable

if TYPE_CHECKING:
    from tokaudit._report import AuditReport

FAIL_ON = {
    "error": Severity.ERROR.rank,
    "inconclusive": Severity.ERROR.rank,
    "warning": Severity.WARNING.rank,
    "info": Severity.INFO.rank,
    "never": 99,
}


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
    """Whether `tokaudit check --fail-on` exits 1 for this report."""
    worst = max((f.severity.rank for f in report.findings), default=-1)
    # what fails the command: the listed findings' own verdict (an ignored code never fails it)
    gates = [run.gate_verdict or run.verdict for run in report.runs]
    if fail_on == "inconclusive":
        fails = worst >= Severity.ERROR.rank or any(verdict != "correct" for verdict in gates)
    elif fail_on == "error":
        # the default: a run reported incorrect never exits 0, whatever the severity of the findings that say so
        fails = worst >= FAIL_ON[fail_on] or any(verdict == "incorrect" for verdict in gates)
    else:
        fails = worst >= FAIL_ON[fail_on]
    return fails


def exit_for_problems(problems: list[LogFormatError]) -> None:
    """Each problem one line on stderr, then exit 2 where there is one, else 0."""
    for error in problems:
        problem(str(error))
    sys.exit(EXIT_BAD_INPUT if problems else EXIT_OK)
