"""What the audit is reading, said on stderr while a command runs."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tokaudit._outputs import stderr
from tokaudit._render.text import printable


@contextmanager
def reading_progress(quiet: bool) -> Iterator[Callable[[str], None] | None]:
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

    with Progress(
        TextColumn("{task.description}", style="dim"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
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
