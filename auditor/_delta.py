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
# a classic checkpoint (v.checkpoint.parquet), a part of n (v.checkpoint.p.n.parquet), or a V2 one named by a UUID
# (v.checkpoint.<uuid>.parquet or .json, whose add and remove actions may lie in sidecar files)
_CHECKPOINT = re.compile(
    r"^(\d{20})\.checkpoint(?:(?:\.(\d{10})\.(\d{10}))?\.parquet|\.[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}"
    r"\.(?:parquet|json))$"
)
SIDECARS = "_sidecars"

_COLUMN_MAPPING = (
    "a Delta table with column mapping (its files name their columns by id, not as the log format does), which "
    "tokaudit does not read: export it as Parquet (spark.read.format('delta').load(...).write.parquet(...))"
)

_UNREPLAYABLE = (
    "a Delta table whose log cannot be replayed (a commit after its last checkpoint is missing), so which files it "
    "holds now is unknown and none is read: copy the whole table, or export it as Parquet "
    "(spark.read.format('delta').load(...).write.parquet(...))"
)

_MISSING = (
    "a file the Delta table holds at version {version} (its log says so), not there: a partial copy of the table?"
)

_DISPLACED = (
    "a Delta table whose files' paths do not hold the partition values its log gives them (column '{column}', files "
    "outside {column}=… folders), which tokaudit does not read: export it as Parquet "
    "(spark.read.format('delta').load(...).write.parquet(...))"
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
    Deletion vectors, column mapping and partition values outside the paths raise their problem, naming `root`."""
    names = list(names)
    commits = {int(m.group(1)): name for name in names if (m := _COMMIT.match(name))}
    whole = _whole_checkpoints(names)
    live: set[str] = set()
    start = 0
    if whole:  # the latest whole checkpoint holds the table's files at its version
        start = max(whole)
        for name in whole[start]:
            if name.endswith(".json"):  # a V2 checkpoint written as JSON: a commit's lines
                actions: Iterable[dict[str, Any]] = _lines(read(name))
            else:
                actions = _checkpoint_actions(read_table(name))
            _apply(root, _with_sidecars(actions, read_table), live)
        start += 1
    last = max((v for v in commits if v >= start), default=start - 1)
    if any(v not in commits for v in range(start, last + 1)) or last < 0:
        return None
    for version in range(start, last + 1):
        _apply(root, _lines(read(commits[version])), live)
    return last, live


def _whole_checkpoints(names: Iterable[str]) -> dict[int, list[str]]:
    """Per version, the files of one whole checkpoint: one file (classic or V2), or every part of one in parts."""
    whole: dict[int, list[str]] = {}
    parts: dict[tuple[int, int], list[str]] = {}
    for name in sorted(names):
        if (m := _CHECKPOINT.match(name)) is None:
            continue
        version = int(m.group(1))
        if m.group(3) is None:
            whole.setdefault(version, [name])
            continue
        held = parts.setdefault((version, int(m.group(3))), [])
        held.append(name)
        if len(held) == int(m.group(3)):
            whole.setdefault(version, held)
    return whole


def _lines(data: bytes) -> Iterable[dict[str, Any]]:
    return (json.loads(line) for line in data.decode().splitlines() if line.strip())


def _with_sidecars(actions: Iterable[dict[str, Any]], read_table: Callable[[str], Any]) -> Iterable[dict[str, Any]]:
    """A V2 checkpoint's actions, each sidecar replaced by the actions of its file (in `_delta_log/_sidecars/`)."""
    for action in actions:
        if action.get("sidecar") is not None:
            name = unquote(action["sidecar"]["path"]).rsplit("/", 1)[-1]
            yield from _checkpoint_actions(read_table(f"{SIDECARS}/{name}"))
        else:
            yield action


def _checkpoint_actions(table: Any) -> Iterable[dict[str, Any]]:
    """A checkpoint's metadata, add, remove and sidecar actions, as a commit's lines give them."""
    for column in ("metaData", "add", "remove", "sidecar"):
        if column in table.column_names:
            for value in table.column(column).to_pylist():
                if value is not None:
                    yield {column: value}


def _apply(root: str, actions: Iterable[dict[str, Any]], live: set[str]) -> None:
    """Each add's file joins the table, each remove's leaves it (paths as the log writes them: URL-escaped)."""
    for action in actions:
        if not isinstance(action, dict):
            raise LogFormatError(root, "its Delta log holds a line that is no JSON object (each line is one action)")
        if action.get("metaData") is not None:
            configuration = dict(action["metaData"].get("configuration") or {})
            if configuration.get("delta.columnMapping.mode", "none") != "none":
                raise LogFormatError(root, _COLUMN_MAPPING)
        if "add" in action and action["add"] is not None:
            add = _file_action(root, "add", action["add"])
            if add.get("deletionVector"):
                raise LogFormatError(root, _DELETION_VECTORS)
            path = _relative(root, add["path"])
            if column := _displaced(path, add.get("partitionValues") or {}):
                raise LogFormatError(root, _DISPLACED.format(column=column))
            live.add(path)
        elif "remove" in action and action["remove"] is not None:
            live.discard(_relative(root, _file_action(root, "remove", action["remove"])["path"]))


def _file_action(root: str, kind: str, action: Any) -> dict[str, Any]:
    """An add or remove action of the log, checked to name its file: an object with a "path" string."""
    if not isinstance(action, dict) or not isinstance(action.get("path"), str):
        raise LogFormatError(
            root,
            f'its Delta log holds {"an" if kind == "add" else "a"} {kind} action that names no file (no "path" string)',
        )
    return action


def _displaced(path: str, values: dict[str, str | None]) -> str | None:
    """A partition column of the log (`partitions.PARTITION_COLUMNS`) the log gives a file a value of, where its path
    has no `column=…` folder (randomized prefixes): tokaudit takes partition values from folders alone."""
    folders = {unquote(folder.split("=", 1)[0]) for folder in path.split("/")[:-1] if "=" in folder}
    missing = [column for column in values if column not in folders]
    if not missing:
        return None
    from tokaudit._partitions import PARTITION_COLUMNS  # (pyarrow, for the rare table that needs it)

    return next((column for column in missing if column in PARTITION_COLUMNS), None)


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
        self.tables: dict[str, tuple[int, AbstractSet[str]]] = {}
        """Per table's root: (its version, the files it holds), or REFUSED."""
        self.skipped: dict[str, int] = {}
        self.seen: dict[str, set[str]] = {}
        """Per table's root, the files it holds that were found."""
        self.within: dict[str, str] = {}
        """Per table's root, the folder inside it the walk began at ("": the whole table)."""

    def enter(self, root: str, within: str = "") -> None:
        """A table's root: its log replayed (a log that cannot be read, or replayed, is one problem, and none of its
        files read: which it holds is unknown). `within`: the folder inside it the walk began at."""
        self.skipped[root], self.seen[root], self.within[root] = 0, set(), within
        try:
            names, read, read_table = self.open_log(root)
            found = live_files(root, names, read, read_table)
            if found is None:
                raise LogFormatError(root, _UNREPLAYABLE)
            self.tables[root] = found
        except LogFormatError as error:
            self.problems.append(LogFormatError(self.shown(root), error.problem))
            self.tables[root] = REFUSED
        except Exception as error:  # a damaged commit or checkpoint: bad input, never a traceback
            self.problems.append(LogFormatError(self.shown(root), f"cannot read its Delta log ({first_line(error)})"))
            self.tables[root] = REFUSED

    def enter_above(self, folder: str) -> None:
        """On disk, the table a folder given lies inside, if any: the nearest folder above it that holds a log."""
        parent = os.path.dirname(folder)
        given = folder
        while parent != folder:
            if os.path.isdir(os.path.join(parent, DELTA_LOG)):
                self.enter(parent, os.path.relpath(given, parent).replace(os.sep, "/"))
                return
            folder, parent = parent, os.path.dirname(parent)

    def kept(self, folder: str, names: list[str], separator: str = os.sep) -> list[str]:
        """Those of `names` (files of `folder`) that their table holds; all of them outside any table."""
        root = max((r for r in self.tables if folder == r or folder.startswith(r + separator)), key=len, default=None)
        if root is None:
            return names
        inside = folder[len(root) + 1 :].replace(separator, "/")
        live = self.tables[root][1]
        keep = [path for name in names if (path := f"{inside}/{name}" if inside else name) in live]
        self.seen[root].update(keep)
        self.skipped[root] += len(names) - len(keep)
        return [path.rsplit("/", 1)[-1] for path in keep]

    def missing(self) -> list[LogFormatError]:
        """Each file a table holds, under the folder its walk began at, that is not there (a partial copy of the
        table): one problem each, as an unreadable file would be."""
        problems = []
        for root, (version, live) in self.tables.items():
            within = self.within[root] + "/" if self.within[root] not in ("", ".") else ""
            for path in sorted(live - self.seen[root]):
                if path.startswith(within) and "://" not in path and not path.startswith("/"):  # (not a clone's)
                    problems.append(LogFormatError(self.shown(f"{root}/{path}"), _MISSING.format(version=version)))
        return problems

    def notes(self) -> list[str]:
        """What was skipped of each table."""
        return [
            table_note(self.shown(root), table[0], self.skipped[root])
            for root, table in self.tables.items()
            if table is not REFUSED and self.skipped[root]
        ]


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
