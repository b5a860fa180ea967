"""One error hierarchy: the core raises these, the CLI turns them into exit code 2 and one line."""

from __future__ import annotations


class TokauditError(Exception):
    """Base of every error tokaudit reports to a user."""


class LogFormatError(TokauditError):
    """A log file is missing, unreadable or does not follow the schema. The message names the file."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class UsageError(TokauditError):
    """The command line asks for something the logs cannot give (an unknown run or step)."""
