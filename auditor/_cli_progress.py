"""What the audit is reading, said on stderr while a command runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tokaudit._outputs import stderr
from tokaudit._render.text import printable

if TYPE_CHECKING:  # (the engine's modules import DuckDB and pandas: a command starts its footer workers first)
    from tokaudit._engine import Aggregating
    from tokaudit._opening import Progress


@contextmanager
def reading_progress(quiet: bool) -> Iterator[Progress | None]:
    """What the audit is reading: on a terminal a transient status line that becomes one progress bar over the
    aggregation, moving as DuckDB aggregates each range; in a pipe or a CI log a few plain lines: what it reads,
    and where there are several ranges the first, the first past each quarter and the last."""
    if quiet:
        yield None
        return
    console = stderr()
    if not console.is_terminal:

        def line(said: str | Aggregating) -> None:
            if isinstance(said, str):
                console.print(printable(said), style="dim", markup=False)
            elif said.started and said.ranges > 1 and _quarter_passed(said.index + 1, said.ranges):
                console.print(str(said), style="dim", markup=False)

        yield line
        return
    from rich.progress import BarColumn, Progress as Bar, TaskProgressColumn, TextColumn, TimeElapsedColumn

    with Bar(
        TextColumn("{task.description}", style="dim"),
        BarColumn(),
        TaskProgressColumn(text_format_no_percentage=""),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("reading logs", total=None)

        def show(said: str | Aggregating) -> None:
            if isinstance(said, str):
                bar.update(task, description=printable(said))
            else:
                bar.update(task, description=said.what, completed=said.done, total=1.0)

        yield show


def _quarter_passed(index: int, total: int) -> bool:
    """Whether range `index` of `total` is one a log shows: the first, the last, and the first past each quarter."""
    return index in (1, total) or (index * 4) // total != ((index - 1) * 4) // total
