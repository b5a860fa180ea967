"""One error hierarchy: the core raises these, the CLI turns them into exit code 2 and one line; and how an error
from below reads inside such a line."""

from __future__ import annotations


class TokauditError(Exception):
    """Base of every error tokaudit reports to a user."""


class LogFormatError(TokauditError):
    """A log file is missing, unreadable or does not follow the schema. The message names the file."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


EMPTY_PATH = "an empty path (an unset variable?), which would read as the current folder"
"""What a path given as "" is said to be: refused, not taken as the current folder."""


class UsageError(TokauditError):
    """The command line asks for something the logs cannot give (an unknown run or step)."""


def first_line(error: BaseException, width: int = 160) -> str:
    """What an error from below (pyarrow, DuckDB, the OS) says, as it reads inside one line of ours: its first line,
    cut at `width`, or its type where it says nothing."""
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:width]
