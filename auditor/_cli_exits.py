"""How a command ends: every failure one line and exit 2, findings at --fail-on exit 1 (docs/cli.md)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from tokaudit.errors import LogFormatError, TokauditError
from tokaudit._outputs import EXIT_BAD_INPUT, EXIT_OK, closed_pipe, fail, interrupted, problem
from tokaudit._render.text import printable

if TYPE_CHECKING:
    from tokaudit._report import AuditReport


class Guarded(click.Group):
    """Every failure ends in exit 2 with one line: exit 1 means findings and nothing else."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:  # (where --help and --version print: click would end a closed pipe in exit 1)
            return super().parse_args(ctx, args)
        except BrokenPipeError:
            closed_pipe()
            raise  # (closed_pipe exits)
        except click.NoSuchOption as error:  # a command's option written before the command: say where it goes
            owners = [n for n, c in self.commands.items() if any(error.option_name in p.opts for p in c.params)]
            if not owners:
                raise
            said = (
                f"No such option '{error.option_name}' before the command: it is an option of "
                f"{', '.join(f'tokaudit {n}' for n in owners)}, written after it (tokaudit {owners[0]} … "
                f"{error.option_name} …)."
            )
            raise click.NoSuchOption(error.option_name, message=said, ctx=error.ctx) from None

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
            closed_pipe()
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
