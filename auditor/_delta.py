"""A Delta Lake table's files: the ones its transaction log (`_delta_log/`) says the table holds now. A rewrite or an
OPTIMIZE leaves the files it replaced on disk until VACUUM; read with the rest, they are stale copies of records."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any
from urllib.parse import unquote

from tokaudit.errors import LogFormatError, first_line


DELTA_LOG = "_delta_log"

_COMMIT = re.compile(r"^(\d{20})\.json$")
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10}))?\.parquet$")

_COLUMN_MAPPING = (
    "a Delta table with column mapping (its files name their columns by id, not as the log format does), which "
    "tokaudit does not read: export it as Parquet (spark.read.format('delta').load(...).write.parquet(...))"
)

_DELETION_VECTORS = (
    "a Delta table with deletion vectors (rows deleted inside its files), which tokaudit does not read: rewrite it "
    "without them (delta.enableDeletionVectors = false, then OPTIMIZE) or export it as Parquet"
)


def live_files(
    root: str, names: Iterable[str], read: Callable[[str], bytes], read_table: Callable[[str], Any]
) -> tuple[int, set[str]] | None:
    """The table at `root` as its log says it is now: (its version, its files' paths relative to `root`), or None
    where the log cannot be replayed (a commit missing after the last checkpoint). `names`: the files in its
    `_delta_log/`; `read` and `read_table` read one of them (a commit's bytes, a checkpoint's Arrow table).
    Deletion vectors and column mapping raise their problem, naming `root`."""
    names = list(names)
    commits = {int(m.group(1)): name for name in names if (m := _COMMIT.match(name))}
    parts: dict[int, list[tuple[str, int]]] = {}
    for name in names:
        if m := _CHECKPOINT.match(name):
            parts.setdefault(int(m.group(1)), []).append((name, int(m.group(3) or 1)))
    complete = [v for v, found in parts.items() if len(found) == found[0][1]]
    live: set[str] = set()
    start = 0
    if complete:  # the latest whole checkpoint holds the table's files at its version
        start = max(complete)
        for name, _ in sorted(parts[start]):
            _apply(root, _checkpoint_actions(read_table(name)), live)
        start += 1
    last = max((v for v in commits if v >= start), default=start - 1)
    if any(v not in commits for v in range(start, last + 1)) or last < 0:
        return None
    for version in range(start, last + 1):
        actions = (json.loads(line) for line in read(commits[version]).decode().splitlines() if line.strip())
        _apply(root, actions, live)
    return last, live


def _checkpoint_actions(table: Any) -> Iterable[dict[str, Any]]:
    """A checkpoint's metadata, add and remove actions, as a commit's lines give them."""
    for column in ("metaData", "add", "remove"):
        if column in table.column_names:
            for value in table.column(column).to_pylist():
                if value is not None:
                    yield {column: value}


def _apply(root: str, actions: Iterable[dict[str, Any]], live: set[str]) -> None:
    """Each add's file joins the table, each remove's leaves it (paths as the log writes them: URL-escaped)."""
    for action in actions:
        if action.get("metaData") is not None:
            configuration = dict(action["metaData"].get("configuration") or {})
            if configuration.get("delta.columnMapping.mode", "none") != "none":
                raise LogFormatError(root, _COLUMN_MAPPING)
        if "add" in action and action["add"] is not None:
            if action["add"].get("deletionVector"):
                raise LogFormatError(root, _DELETION_VECTORS)
            live.add(_relative(root, action["add"]["path"]))
        elif "remove" in action and action["remove"] is not None:
            live.discard(_relative(root, action["remove"]["path"]))


def _relative(root: str, path: str) -> str:
    """A file of the log, relative to the table's root: as written, or inside an absolute URI of the root."""
    path = unquote(path)
    if "://" not in path and not path.startswith(("/", "file:")):
        return path
    inside = path.split("://", 1)[-1].removeprefix("file:")
    bare = root.split("://", 1)[-1].rstrip("/") + "/"
    at = inside.find(bare)
    return inside[at + len(bare) :] if at >= 0 else path


REFUSED: tuple[int, frozenset[str]] = (-1, frozenset())
"""A table none of whose files is read: its log is refused (deletion vectors, column mapping, damaged), one problem."""


class Tables:
    """The Delta tables a walk meets (a folder that holds `_delta_log/`), and which of its Parquet files each holds.
    `open_log(root)`: the names in the root's log, and a reader of one of them as bytes and as an Arrow table."""

    def __init__(
        self,
        problems: list[LogFormatError],
        open_log: Callable[[str], tuple[list[str], Callable[[str], bytes], Any]],
        shown: Callable[[str], str] = str,
    ) -> None:
        self.problems, self.open_log, self.shown = problems, open_log, shown
        self.tables: dict[str, tuple[int, AbstractSet[str]] | None] = {}
        """Per table's root: (its version, the files it holds), REFUSED, or None where its log cannot be replayed."""
        self.skipped: dict[str, int] = {}

    def enter(self, root: str) -> None:
        """A table's root: its log replayed (a log that cannot be read is one problem, and none of its files read)."""
        self.skipped[root] = 0
        try:
            names, read, read_table = self.open_log(root)
            self.tables[root] = live_files(root, names, read, read_table)
        except LogFormatError as error:
            self.problems.append(LogFormatError(self.shown(root), error.problem))
            self.tables[root] = REFUSED
        except Exception as error:  # a damaged commit or checkpoint: bad input, never a traceback
            self.problems.append(LogFormatError(self.shown(root), f"cannot read its Delta log ({first_line(error)})"))
            self.tables[root] = REFUSED

    def enter_above(self, folder: str) -> None:
        """On disk, the table a folder given lies inside, if any: the nearest folder above it that holds a log."""
        parent = os.path.dirname(folder)
        while parent != folder:
            if os.path.isdir(os.path.join(parent, DELTA_LOG)):
                self.enter(parent)
                return
            folder, parent = parent, os.path.dirname(parent)

    def kept(self, folder: str, names: list[str], separator: str = os.sep) -> list[str]:
        """Those of `names` (files of `folder`) that their table holds; all of them outside any table."""
        root = max((r for r in self.tables if folder == r or folder.startswith(r + separator)), key=len, default=None)
        table = None if root is None else self.tables[root]
        if root is None or table is None:
            return names
        inside = folder[len(root) + 1 :].replace(separator, "/")
        live = table[1]
        keep = [name for name in names if (f"{inside}/{name}" if inside else name) in live]
        self.skipped[root] += len(names) - len(keep)
        return keep

    def notes(self) -> list[str]:
        """What was skipped of each table, and each table whose log could not be replayed."""
        said = []
        for root, table in self.tables.items():
            if table is None:
                said.append(unreplayable_note(self.shown(root)))
            elif table is not REFUSED and self.skipped[root]:
                said.append(table_note(self.shown(root), table[0], self.skipped[root]))
        return said


def local_log(root: str) -> tuple[list[str], Callable[[str], bytes], Callable[[str], Any]]:
    """`Tables.open_log` on local disk."""
    import pyarrow.parquet as pq

    log = os.path.join(root, DELTA_LOG)

    def read(name: str) -> bytes:
        with open(os.path.join(log, name), "rb") as file:
            return file.read()

    return sorted(os.listdir(log)), read, lambda name: pq.read_table(os.path.join(log, name))


def table_note(root: str, version: int, skipped: int) -> str:
    """What is said of the Parquet files under a Delta table's root that it does not hold."""
    return (
        f"{root}: a Delta table at version {version}: {skipped} Parquet file(s) it no longer holds (replaced by a later "
        "commit, or never committed) skipped"
    )


def unreplayable_note(root: str) -> str:
    return f"{root}: a Delta table whose log cannot be replayed (a commit is missing): every Parquet file under it read"
