"""Find the log's local files: every *.parquet under the paths given, each file once, and what cannot be read."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from tokaudit.errors import LogFormatError
from tokaudit._delta import DELTA_LOG, Tables, local_log
from tokaudit._storage import ICEBERG, WRITERS_FOLDERS, dot_folder_note, hidden, hidden_note, iceberg_marker
from tokaudit._storage import parquet_name, shown_path


UNREADABLE_FOLDER = "cannot read this folder"
"""What a folder below the paths given that cannot be listed is said to be: the files of its run's it may hold are
unread (`summary.unread_files`)."""


Identity = tuple[int, int]
"""A file's (device, inode): one file reached by two names is read once."""


class _Found:
    """Each file found, by the name it is read by: once, whatever links lead to it; a hard link, a name of its own in
    another folder, is read there too, as a copy would be."""

    def __init__(self) -> None:
        self.names: dict[Identity, Path] = {}
        self.copies: list[Path] = []
        """Second names of files, in folders of their own, that reach them through no link (hard links)."""
        self.roots: list[tuple[str, str]] = []
        """Each folder walked, as given (absolute) and with its links resolved: a name below it is direct where
        nothing below the folder given is a link, whether the folder given is one or not."""

    def add(self, key: Identity, name: Path) -> None:
        """A file reached by `name`. Reached again in another folder, it is read by the name that reaches it through
        no link (a link in another run's folder would take the shard from its own run; one that is a link says
        nothing: the file is read where it lies), by both where neither is a link (a hard link: a copy's own),
        else by the first."""
        kept = self.names.setdefault(key, name)
        if kept is name or kept.parent == name.parent:
            return
        direct = self.direct(name)
        if direct and self.direct(kept):  # (a folder given twice, or by a link, holds the same names: one file)
            if os.path.realpath(kept.parent) != os.path.realpath(name.parent):
                self.copies.append(name)
        elif direct:
            self.names[key] = name

    def direct(self, path: Path) -> bool:
        """A name that reaches its file through no link below the folder it was found in (`roots`)."""
        real = os.path.realpath(path)
        for given, resolved in self.roots:
            below = os.path.relpath(path, given)
            if not below.startswith(os.pardir) and real == os.path.normpath(os.path.join(resolved, below)):
                return True
        return real == os.path.abspath(path)


def discover(
    paths: Sequence[str | os.PathLike[str]], notes: list[str] | None = None
) -> tuple[list[Path], list[LogFormatError]]:
    """Every *.parquet under the paths, each path taken literally (of a Delta table, those it holds: `delta.Tables`).
    Below them, dot-files and the folders writers keep beside their data are skipped (`storage.hidden`); anything
    else that cannot be read is one problem line, never a silence: an unreadable folder, a dangling or looping link,
    a FIFO, a folder named *.parquet with no part file. Such a folder (a Spark-style dataset) is read as its part
    files. `notes`: where each link that leads out of the folder given is said, with what it is read from (it is
    read), the writers' folders skipped, and the files a Delta table no longer holds."""
    # One file reached twice (two paths, a link to it) is read once (`_Found`): keyed by its identity on disk,
    # from the stat that checks it is a file, rather than by resolving every path.
    found = _Found()
    problems: list[LogFormatError] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists() and not path.is_symlink():
            problems.append(LogFormatError(shown_path(str(raw)), "no such file or directory"))
            continue
        if _not_utf8(str(path), problems):
            continue
        identity, problem = _regular_file(path)
        if identity is not None:
            found.names.setdefault(identity, path.absolute())
        elif not path.is_dir():
            problems.append(LogFormatError(str(raw), problem))
        else:
            reached = _walk(path, found, problems, notes)
            said = (str(path), str(path.absolute()))  # (a problem may name it either way)
            if not reached and not any(p.path.startswith(said) for p in problems):
                problems.append(LogFormatError(str(raw), "no Parquet files (*.parquet) in this folder" + _named(path)))
    return [*found.names.values(), *found.copies], problems


def _named(folder: Path) -> str:
    """Where a folder holds no *.parquet: the files under it named as other writers name Parquet, said (.pq, .parq,
    and Hive's files of no extension, 000000_0, that begin as Parquet does)."""
    files = [path for path in folder.rglob("*") if path.is_file() and not hidden(path.name, folder=False)]
    others = sum(1 for path in files if path.suffix in (".pq", ".parq") or _extensionless_parquet(path))
    if not others:
        return ""
    return f" ({others} file(s) are named .pq, .parq or with no extension: tokaudit reads *.parquet, rename them)"


def _unnamed_parquet(folder: str, files: list[str]) -> int:
    """Of a folder's files, those with no extension that begin as Parquet does (Hive's 000000_0)."""
    return sum(1 for n in files if not hidden(n, folder=False) and _extensionless_parquet(Path(folder, n)))


def _extensionless_parquet(path: Path) -> bool:
    """A file of no extension that begins as Parquet does (Hive names its files 000000_0). Not a writer's summary of
    its dataset (pyarrow's _metadata and _common_metadata: footers, no row), which pyarrow skips too."""
    if "." in path.name or path.name.startswith("_"):
        return False
    try:
        with open(path, "rb") as file:
            return file.read(4) == b"PAR1"
    except OSError:
        return False


def _walk(root: Path, found: _Found, problems: list[LogFormatError], notes: list[str] | None = None) -> int:
    """Every *.parquet under `root` added to `found` (`_Found.add`), or to `problems` where it is no readable file:
    how many it reached, those found before and those it could not use included."""
    seen: dict[bool, set[Identity]] = {True: set(), False: set()}  # by whether the path is UTF-8
    reached = 0

    def unreadable(error: OSError) -> None:
        folder = Path(error.filename or root).absolute()  # (as the files are named)
        problems.append(LogFormatError(str(folder), f"{UNREADABLE_FOLDER} ({error.strerror})"))

    inside = os.path.realpath(root) + os.sep
    found.roots.append((str(Path(root).absolute()), inside[:-1]))
    # the writers' folders (storage.WRITERS_FOLDERS) skipped; Parquet files of no extension, and named .pq or .parq
    skipped = unnamed = other_names = 0
    tables = Tables(problems, local_log)  # Delta tables: the files their logs say they hold
    tables.enter_above(str(Path(root).absolute()))
    datasets: dict[str, int] = {}  # folders named *.parquet (Spark-style datasets): the part files under each
    for folder, folders, files in _folders(str(root), unreadable):
        here = str(Path(folder).absolute())  # strings until a file is kept: pathlib's parsing costs more than a stat
        try:
            identity = os.stat(here)
        except OSError:
            continue
        utf8 = shown_path(here) == here
        if any((identity.st_dev, identity.st_ino) in seen[kind] for kind in {utf8, True}):  # a loop, or read
            folders[:] = []
            continue
        seen[utf8].add((identity.st_dev, identity.st_ino))
        if not utf8:  # nothing in it is read (reached by a link of a UTF-8 path, it is)
            _not_utf8_folder(here, folders, files, problems)
            continue
        if notes is not None and os.path.islink(here):
            _note_outside(here, inside, notes)
        if _iceberg(here, folders):
            problems.append(LogFormatError(here, ICEBERG))  # its files are not read: which it holds now is unknown
            folders[:] = []
            continue
        if DELTA_LOG in folders:
            tables.enter(here)
        skipped += sum(f in WRITERS_FOLDERS for f in folders)
        if notes is not None:
            notes.extend(dot_folder_note(os.path.join(here, f)) for f in sorted(folders) if _dotted(here, f))
        folders[:] = sorted(f for f in folders if not hidden(f, folder=True))
        names = tables.kept(here, sorted(n for n in files if not hidden(n, folder=False) and parquet_name(n)))
        _count_parts(datasets, here, names)
        _add_files(here, names, identity.st_dev, found, problems, inside, notes)
        reached += len(names)
        unnamed += _unnamed_parquet(here, files)
        other_names += sum(n.lower().endswith((".pq", ".parq")) and not hidden(n, folder=False) for n in files)
    problems.extend(
        LogFormatError(dataset, "a folder named *.parquet with no Parquet part files in it")
        for dataset, parts in datasets.items()
        if not parts
    )
    problems.extend(tables.missing())
    if notes is not None:
        notes.extend([hidden_note(str(root), skipped)] if skipped else [])
        notes.extend(tables.notes())
        notes.extend(_named_otherwise(root, unnamed, other_names) if reached else [])
    return reached


def _dotted(folder: str, name: str, looked: int = 10_000) -> bool:
    """A folder `name` in `folder` whose name begins with '.' (skipped) and that holds Parquet files, of the first
    `looked` names below it (a .git or a snapshot's copy is not walked whole to say so)."""
    if not name.startswith("."):
        return False
    for _, _, files in os.walk(os.path.join(folder, name)):
        if any(parquet_name(f) and not f.startswith(".") for f in files):
            return True
        looked -= len(files) + 1
        if looked < 0:
            return False
    return False


def _named_otherwise(root: Path, unnamed: int, other: int) -> list[str]:
    """What is said of the Parquet files under `root` not read for their names (where some *.parquet is: with none at
    all, the folder's one line says it): of no extension, or named .pq or .parq."""
    said = [f"{root}: {unnamed} file(s) with no extension begin as Parquet files do (Hive names them 000000_0)"]
    said = (said if unnamed else []) + ([f"{root}: {other} file(s) named .pq or .parq"] if other else [])
    return [f"{line}, not read: name them *.parquet to audit them" for line in said]


def _count_parts(datasets: dict[str, int], here: str, names: list[str]) -> None:
    """The part files of each folder named *.parquet (a Spark-style dataset) met so far, `here`'s added."""
    if here.endswith(".parquet"):
        datasets.setdefault(here, 0)
    for dataset in datasets:
        if names and (here == dataset or here.startswith(dataset + os.sep)):
            datasets[dataset] += len(names)


def _iceberg(folder: str, folders: list[str]) -> bool:
    """Whether a folder is an Iceberg table's root: a `metadata/` of table metadata beside its data."""
    return "metadata" in folders and any(
        iceberg_marker(("metadata", n)) for n in _names(os.path.join(folder, "metadata"))
    )


def _names(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _add_files(
    here: str,
    names: list[str],
    device: int,
    found: _Found,
    problems: list[LogFormatError],
    inside: str,
    notes: list[str] | None,
) -> None:
    """`_walk`'s files `names` of the folder `here` (on `device`), each added to `found` (a file already there is
    not added again), or to `problems` where it is no readable file."""
    # A regular file's identity is its folder's device and the inode its folder's listing gives, with no
    # stat of its own (a tenth of a second on 25,000 shards); a link or anything else is looked at.
    listed = _regular_inodes(here, set(names)) if names else {}
    base = Path(here)
    child = getattr(base, "_make_child_relpath", base.joinpath)  # (pathlib's, without parsing the name again)
    for name in names:
        path = os.path.join(here, name)
        if _not_utf8(path, problems):
            continue
        inode = listed.get(name)
        if inode is not None and os.access(path, os.R_OK):
            key: Identity | None = (device, inode)
        else:
            key, problem = _regular_file(path)
            if key is not None and notes is not None and os.path.islink(path):
                _note_outside(path, inside, notes)
        if key is not None:
            found.add(key, child(name))
        else:
            problems.append(LogFormatError(path, problem))


def _not_utf8(path: str, problems: list[LogFormatError]) -> bool:
    """Whether a path is not UTF-8 (Python holds its other bytes as surrogate escapes), said in `problems` with those
    bytes shown as \\xNN: DuckDB opens files, and every report names them, in UTF-8 alone."""
    if shown_path(path) == path:
        return False
    problems.append(
        LogFormatError(shown_path(path), "the name is not UTF-8 (its other bytes shown as \\xNN): rename it")
    )
    return True


def _not_utf8_folder(folder: str, folders: list[str], files: list[str], problems: list[LogFormatError]) -> None:
    """A folder whose path is not UTF-8: where it holds Parquet files or a Delta table, one line naming the topmost
    folder of its path whose name is not UTF-8 (once, whatever lies below it); its folders are walked still."""
    if DELTA_LOG in folders or any(parquet_name(name) and not hidden(name, folder=False) for name in files):
        parts = Path(folder).parts
        top = next(p for i in range(1, len(parts) + 1) if shown_path(p := os.path.join(*parts[:i])) != p)
        if not any(problem.path == shown_path(top) for problem in problems):
            _not_utf8(top, problems)
    folders[:] = sorted(f for f in folders if not hidden(f, folder=True) and f != DELTA_LOG)


def _note_outside(path: str, inside: str, notes: list[str]) -> None:
    """A link whose target lies outside the folder given: said, since what is audited is then read from there."""
    target = os.path.realpath(path)
    if not (target + os.sep).startswith(inside):
        notes.append(f"{path} is a link out of the folder given: read from {target}")


def _folders(root: str, onerror: Callable[[OSError], None]) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk's (folder, its folders, its files), top down, links to folders followed, with a stack instead of
    recursion: a tree a thousand folders deep is walked as any other. The caller may prune the folders list. Links to
    folders come after every folder reached without one: a folder both reach is read under its own name."""
    stack: list[str] = [root]
    links: list[str] = []
    while stack or links:
        top = stack.pop() if stack else links.pop(0)
        try:
            with os.scandir(top) as listing:
                entries = list(listing)
        except OSError as error:
            onerror(error)
            continue
        folders: list[str] = []
        files: list[str] = []
        for entry in entries:
            try:
                is_folder = entry.is_dir()  # a link to a folder is walked (its target once, `seen`)
            except OSError:
                is_folder = False
            (folders if is_folder else files).append(entry.name)
        yield top, folders, files
        below = [(path, os.path.islink(path)) for path in (os.path.join(top, name) for name in folders)]
        stack.extend(path for path, linked in reversed(below) if not linked)
        links.extend(path for path, linked in below if linked)


def _regular_inodes(folder: str, names: set[str]) -> dict[str, int]:
    """The inode of each of `names` that the folder's listing says is a regular file (not a link); nothing
    where the folder cannot be listed again."""
    try:
        with os.scandir(folder) as entries:
            return {
                entry.name: entry.inode()
                for entry in entries
                if entry.name in names and entry.is_file(follow_symlinks=False)
            }
    except OSError:
        return {}


def _regular_file(path: str | Path) -> tuple[Identity | None, str]:
    """(device, inode) of a readable regular file; else (None, why it is not one)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:  # listed a moment ago: a link to nothing, or a file removed since
        gone = not os.path.islink(path)
        return (
            None,
            "gone: removed or renamed since the audit listed it" if gone else "a link to nothing (dangling symlink)",
        )
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None, "a link that loops back on itself"
        return None, f"cannot be read ({error.strerror})"
    if stat.S_ISDIR(info.st_mode):
        return None, "a folder, not a file" if os.path.basename(path).endswith(".parquet") else "a folder"
    if not stat.S_ISREG(info.st_mode):
        return None, "not a regular file (a FIFO, socket or device)"
    if not os.access(path, os.R_OK):
        return None, "cannot be read (permission denied)"
    return (info.st_dev, info.st_ino), ""
