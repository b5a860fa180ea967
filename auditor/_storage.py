"""Logs on object storage: `s3://bucket/runs/`, `gs://…`, any URL pyarrow or fsspec can open.

Shards are read where they are (footers first, then the columns an audit needs), never copied to
local disk. The filesystem comes from the URL and the standard environment of its SDK: for S3,
`AWS_ENDPOINT_URL` (an S3-compatible server), the credential chain (`AWS_ACCESS_KEY_ID`/
`AWS_SECRET_ACCESS_KEY`, profiles, instance roles) and `AWS_REGION`. Failures become one line that
says what went wrong (no such bucket, access denied, endpoint unreachable), never a traceback.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass, field
from collections.abc import Sequence
from pathlib import PurePath, PurePosixPath
from typing import Any

from tokaudit.errors import LogFormatError, first_line
from tokaudit._delta import DELTA_LOG, Tables

# pyarrow (a fifth of a second to import) is imported where a store is opened: the command line tells a URL
# from a path (`is_url`) before it starts the footer workers (`tokaudit._loading`).

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(raw: object) -> bool:
    """Whether `raw` names a location by URL (s3://, gs://, …) rather than a local path."""
    return isinstance(raw, str) and _URL.match(raw) is not None and local_path(raw) is raw


THIS_MACHINE = ("", "localhost", "127.0.0.1", "[::1]")
"""The hosts of a file URL that name this machine."""


def local_path(raw: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """A file URL of this machine (file:///abs, file://localhost/abs, file:/abs: RFC 8089) as the local path it
    names, its percent-escapes decoded; anything else as given."""
    if isinstance(raw, str) and raw[:5].lower() == "file:":
        parts = urllib.parse.urlsplit(raw)
        # (a '#' or '?' of the path itself is written %23, %3F: one left bare would cut the path short)
        if parts.netloc.lower() in THIS_MACHINE and parts.path.startswith("/") and "#" not in raw and "?" not in raw:
            return urllib.parse.unquote(parts.path)
    return raw


def other_machine(raw: object) -> str | None:
    """Why a file URL naming another machine's file (file://host/path) names no file here, or None: no local path
    is it, and the file reader would look for //host/path on this machine."""
    if not isinstance(raw, str) or raw[:7].lower() != "file://":
        return None
    host = urllib.parse.urlsplit(raw).netloc
    if host.lower() in THIS_MACHINE:
        return None
    return (
        f"a file URL of another machine ('{host}'): tokaudit reads and writes this machine's files; "
        "give a path here (where that machine's folder is mounted)"
    )


@dataclass(frozen=True, slots=True)
class Store:
    """An open filesystem and the URL scheme it was opened for (to write locations back as URLs)."""

    filesystem: Any
    scheme: str
    sizes: dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    """Each object's size as the listing gave it, by path: an object of known size is read without asking
    the store for its size first (`sized_fragment`), a request less per object."""
    modified: dict[str, int] = field(default_factory=dict, compare=False, hash=False)
    """Each object's last modification (ns) as the listing gave it, by path (`modified_ns`)."""

    def url(self, path: str | PurePath) -> str:
        return f"{self.scheme}://{path}"


DEFAULT_TIMEOUT_S = 10.0
"""Seconds one request to an S3 store may take to connect or to answer (TOKAUDIT_STORAGE_TIMEOUT)."""


def modified_ns(path: str | PurePath, store: Store | None) -> int:
    """When a file was last modified (ns; 0 where that cannot be told): the order of files that do not say which
    launch wrote them (`engine.sql.file_order_table`)."""
    if store is not None:
        return store.modified.get(str(path), 0)
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def storage_timeout() -> float:
    """TOKAUDIT_STORAGE_TIMEOUT in seconds, else DEFAULT_TIMEOUT_S (also where it is not a positive number)."""
    try:
        value = float(os.environ.get("TOKAUDIT_STORAGE_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if value > 0 else DEFAULT_TIMEOUT_S


def open_url(url: str, timeout: float | None = None) -> tuple[Store, str]:
    """(store, path inside it) for a URL; raises LogFormatError with one line when it cannot. With `timeout`,
    each request to an S3 store connects and answers within it, tried twice at most: a store that froze or went
    away costs seconds, not the SDK's minutes of retries."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    match = _URL.match(url)
    scheme = match.group(1).lower() if match else ""
    elsewhere = other_machine(url)
    if elsewhere is not None:
        raise LogFormatError(url, elsewhere)
    if scheme in ARROW_SCHEMES and "#" in url:  # pyarrow would cut the key there, and read another folder
        raise LogFormatError(
            url, "a URL's '#' begins a fragment, which object storage has none of: write a key's '#' %23"
        )
    try:
        filesystem, path = pafs.FileSystem.from_uri(_encoded(url) if scheme in ARROW_SCHEMES else url)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as arrow_error:
        if scheme in ARROW_SCHEMES:  # (fsspec's advice would be to install its own filesystem for them)
            raise LogFormatError(
                url,
                f"not a URL pyarrow reads ({first_line(arrow_error, 240)}): a key's '?', '#' and '%' are written "
                "%3F, %23 and %25",
            ) from None
        filesystem, path = _fsspec(url, arrow_error)
    except OSError as error:
        raise LogFormatError(url, describe(error)) from None
    if timeout is not None and isinstance(filesystem, pafs.S3FileSystem) and "?" not in url:
        # the same store (its region as from_uri resolved it, the endpoint from the SDK's environment), bounded
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        filesystem = pafs.S3FileSystem(
            region=filesystem.region,
            endpoint_override=endpoint or None,
            connect_timeout=timeout,
            request_timeout=timeout,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2),
        )
    elif timeout is not None and isinstance(filesystem, pafs.GcsFileSystem):
        filesystem = _bounded_gcs(url, timeout)
    return Store(filesystem, scheme), path.rstrip("/")


ARROW_SCHEMES = ("s3", "gs", "gcs")


def _encoded(url: str) -> str:
    """The URL with a key's spaces, brackets and other characters pyarrow's URI parser refuses there (non-ASCII ones,
    as UTF-8) percent-encoded; '%', '?' and '#', which a URL reads as its own, are left as written."""
    import urllib.parse

    return urllib.parse.quote(url, safe="%/:=&?~#+!$,;'@()*")


def _bounded_gcs(url: str, timeout: float) -> Any:
    """The store of a gs:// URL as from_uri opens it (anonymous@, scheme= and endpoint_override= in the URL, or
    STORAGE_EMULATOR_HOST), with its client's retries bounded to about two requests' time instead of minutes."""
    import datetime
    import urllib.parse

    import pyarrow.fs as pafs

    parts = urllib.parse.urlsplit(url)
    query = {key: values[-1] for key, values in urllib.parse.parse_qs(parts.query).items()}
    endpoint = query.get("endpoint_override")
    scheme = query.get("scheme")
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if endpoint is None and emulator:
        scheme, _, endpoint = emulator.rpartition("://") if "://" in emulator else ("http", "", emulator)
    return pafs.GcsFileSystem(
        anonymous=parts.username == "anonymous" or query.get("anonymous") == "true",
        scheme=scheme,
        endpoint_override=endpoint,
        retry_time_limit=datetime.timedelta(seconds=max(1.0, 2 * timeout)),
    )


def sized_fragment(store: Store, path: str) -> Any:
    """The object at `path` as a Parquet dataset fragment that knows its size from the listing (`sizes`), so
    that reading it needs no request for its size first; None where the size is unknown or this pyarrow's
    fragments take none (before 15)."""
    import pyarrow.dataset as pads

    size = store.sizes.get(path)
    if size is None:
        return None
    try:
        return pads.ParquetFileFormat().make_fragment(path, store.filesystem, file_size=size)
    except TypeError:
        return None


def object_dataset(store: Store | None, path: str) -> Any:
    """One object (a local file: `store` None) as an Arrow dataset, which DuckDB scans with the columns and steps it
    asks for."""
    import pyarrow.dataset as pads

    if store is None:
        return pads.dataset(path, format="parquet")
    fragment = sized_fragment(store, path)
    if fragment is None:
        return pads.dataset(path, filesystem=store.filesystem, format="parquet")
    return pads.FileSystemDataset([fragment], fragment.physical_schema, fragment.format, store.filesystem)


def _fsspec(url: str, arrow_error: Exception) -> tuple[Any, str]:
    """A scheme pyarrow does not know, through fsspec when it is installed with that protocol."""
    import pyarrow.fs as pafs

    try:
        import fsspec
    except ImportError:
        raise LogFormatError(
            url, f"pyarrow cannot open this URL ({first_line(arrow_error, 240)}) and fsspec is not installed"
        ) from None
    try:
        filesystem, path = fsspec.core.url_to_fs(url)
    except Exception as error:
        raise LogFormatError(url, f"cannot open this URL ({first_line(error, 240)})") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)), str(path)


UNREACHABLE = "cannot reach the storage endpoint"
"""How `describe` begins for a store that does not answer: it ends the audit (`loading`), not one file."""


def describe(error: BaseException) -> str:
    """One line for a storage error: what it means first, the SDK's own words after."""
    text = first_line(error, 240)
    lowered = text.lower()
    if (
        "access_denied" in lowered
        or "accessdenied" in lowered
        or "invalidaccesskeyid" in lowered
        or "signaturedoesnotmatch" in lowered
        or "forbidden" in lowered
        or " 403" in lowered
    ):
        meaning = "access denied (check the credentials and the bucket's policy)"
    elif (
        "network_connection" in lowered
        or "could not connect" in lowered
        or "could not resolve" in lowered
        or "timed out" in lowered
        or "timeout" in lowered
    ):
        meaning = f"{UNREACHABLE} (check AWS_ENDPOINT_URL or the network)"
    elif "nosuchbucket" in lowered or "bucket" in lowered and "not found" in lowered:
        meaning = "no such bucket"
    else:
        meaning = "cannot be read"
    return f"{meaning}: {text}"


WRITERS_FOLDERS = frozenset({"_temporary", "_spark_metadata", "_impala_insert_staging"})
"""The folders writers keep beside their data, which the walk skips below the paths given and says it skipped, as the
writers' own readers skip them: Spark's `_temporary/` of uncommitted tasks and a streaming sink's `_spark_metadata/`,
Impala's staging. Only these: a run whose id begins with '_' is a folder of the recorder's, and is read."""


ICEBERG = (
    "an Iceberg table (its metadata/ says which of the files under it the table holds now), which tokaudit does not "
    "read: export it as Parquet (spark.table(...).write.parquet(...))"
)


def iceberg_marker(parts: Sequence[str]) -> bool:
    """A path (its last parts) that marks an Iceberg table's root: `metadata/*.metadata.json`, its table metadata."""
    return len(parts) >= 2 and parts[-2] == "metadata" and parts[-1].endswith(".metadata.json")


def parquet_name(name: str) -> bool:
    """A name Parquet files go by: *.parquet, in any letters (a .PARQUET file is read as its writer meant)."""
    return name.lower().endswith(".parquet")


def hidden(name: str, folder: bool) -> bool:
    """A name the walk skips below the paths given: a killed writer's temporaries (dot-files), WRITERS_FOLDERS, and a
    Delta table's log (which says what files the table holds, `delta.Tables`)."""
    return name.startswith(".") or folder and (name in WRITERS_FOLDERS or name == DELTA_LOG)


def dot_folder_note(folder: str) -> str:
    """What is said of a folder below the paths given whose name begins with '.' and that holds Parquet files: skipped
    (writers stage there: Spark's .spark-staging-*, Hive's .hive-staging*), never in silence (a run id may begin so)."""
    return (
        f"{folder}: a folder whose name begins with '.' is skipped (writers stage files there), and it holds Parquet "
        "files: give it as a path to audit them"
    )


def hidden_note(root: str, skipped: int) -> str:
    """What is said of the WRITERS_FOLDERS under `root` skipped."""
    return (
        f"{root}: {skipped} folder(s) a writer keeps beside its data skipped (Spark's _temporary of uncommitted "
        "tasks, a streaming sink's _spark_metadata, whose list of committed files is not read: every part file beside "
        "it is), as pyarrow skips them"
    )


def _skipped(
    relative: PurePosixPath,
    path: PurePosixPath,
    logs: dict[str, list[str]],
    skipped: set[tuple[str, ...]],
    dotted: set[tuple[str, ...]],
) -> bool:
    """Whether an object (`path`, `relative` to the URL's) lies below a name the walk skips (`hidden`), and where it
    does, what is kept of it: a Delta table's log (`logs`), a writer's folder (`skipped`, the outermost once, as on
    disk) and a folder whose name begins with '.' that holds Parquet files (`dotted`)."""
    last = len(relative.parts) - 1
    at = next((i for i, part in enumerate(relative.parts) if hidden(part, folder=i < last)), None)
    if at is None:
        return False
    if relative.parts[at] == DELTA_LOG and at == last - 1:  # a Delta table's log
        logs.setdefault(str(path.parent.parent), []).append(path.name)
    elif relative.parts[at] in WRITERS_FOLDERS:
        skipped.add(relative.parts[: at + 1])
    elif at < last and relative.parts[at].startswith(".") and parquet_name(path.name):
        dotted.add(relative.parts[: at + 1])
    return True


def discover_url(url: str, notes: list[str] | None = None) -> tuple[Store | None, list[str], list[LogFormatError]]:
    """Every *.parquet under a URL, sorted, as paths in the store (of a Delta table, those it holds); below it, the
    names the walk on disk skips (`hidden`), the writers' folders said in `notes`."""
    import pyarrow.fs as pafs

    try:
        store, root = open_url(url, storage_timeout())
    except LogFormatError as error:
        return None, [], [error]
    filesystem = store.filesystem
    try:
        info = filesystem.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            bucket = root.split("/", 1)[0]
            if "/" in root and filesystem.get_file_info(bucket).type == pafs.FileType.NotFound:
                return store, [], [LogFormatError(url, f"no such bucket '{bucket}'")]
            return store, [], [LogFormatError(url, "no such file or directory")]
        if info.type == pafs.FileType.File:
            if info.size is not None:
                store.sizes[root] = info.size
            return store, [root], []
        entries = filesystem.get_file_info(pafs.FileSelector(root, recursive=True))
    except OSError as error:
        return store, [], [LogFormatError(url, describe(error))]
    found: list[str] = []
    skipped: set[tuple[str, ...]] = set()
    dotted: set[tuple[str, ...]] = set()
    logs: dict[str, list[str]] = {}  # each Delta table's root: the names in its log
    icebergs: set[tuple[str, ...]] = set()  # each Iceberg table's root, relative to the URL's
    for entry in entries:
        relative = PurePosixPath(entry.path).relative_to(PurePosixPath(root)) if entry.path != root else None
        if relative is None:
            continue
        if iceberg_marker(relative.parts):
            icebergs.add(relative.parts[:-2])
        if _skipped(relative, PurePosixPath(entry.path), logs, skipped, dotted):
            continue
        if entry.type == pafs.FileType.File and parquet_name(entry.path):
            found.append(entry.path)
            if entry.size is not None:
                store.sizes[entry.path] = entry.size
            if entry.mtime_ns is not None:
                store.modified[entry.path] = entry.mtime_ns
    trouble = [LogFormatError(store.url(PurePosixPath(root, *table)), ICEBERG) for table in sorted(icebergs)]
    found = [
        path for path in found if not any(PurePosixPath(path).is_relative_to(PurePosixPath(root, *t)) for t in icebergs)
    ]
    logs.update(_log_above(store, root))
    found = _held_by_tables(store, logs, found, trouble, notes, root)
    if skipped and notes is not None:
        notes.append(hidden_note(url, len(skipped)))
    if notes is not None:
        notes.extend(dot_folder_note(store.url(PurePosixPath(root, *folder))) for folder in sorted(dotted))
    if not found and not trouble:
        return store, [], [LogFormatError(url, "no Parquet files (*.parquet) under this URL")]
    return store, sorted(found), trouble


def _log_above(store: Store, root: str) -> dict[str, list[str]]:
    """The Delta table a prefix given lies inside, if any (the nearest prefix above it, within its bucket, that holds
    a log), with the names in its log: a request a level."""
    import pyarrow.fs as pafs

    for above in list(PurePosixPath(root).parents)[:-1]:  # up to the bucket (not its parent, ".")
        try:
            listed = store.filesystem.get_file_info(pafs.FileSelector(f"{above}/{DELTA_LOG}", allow_not_found=True))
        except OSError:  # a prefix this reader may not list: no table known there
            return {}
        if listed:
            return {str(above): [PurePosixPath(entry.path).name for entry in listed]}
    return {}


def _held_by_tables(
    store: Store,
    logs: dict[str, list[str]],
    found: list[str],
    trouble: list[LogFormatError],
    notes: list[str] | None,
    root: str,
) -> list[str]:
    """Of the objects found under `root`, those the Delta tables among them hold (`delta.Tables`; `logs`: each
    table's root and the names in its log), and every object outside a table. A file a table holds under `root`
    that is not there is one problem in `trouble`."""
    if not logs:
        return found
    import pyarrow.parquet as pq

    def open_log(table: str) -> tuple[list[str], Any, Any]:
        def opened(name: str) -> Any:
            return store.filesystem.open_input_file(f"{table}/{DELTA_LOG}/{name}")

        return logs[table], lambda name: opened(name).read(), lambda name: pq.read_table(opened(name))

    tables = Tables(trouble, open_log, lambda table: store.url(PurePosixPath(table)))
    for table in logs:
        inside = PurePosixPath(root).is_relative_to(table)
        tables.enter(table, str(PurePosixPath(root).relative_to(table)) if inside else "")
    kept = [path for path in found if tables.kept(str(PurePosixPath(path).parent), [PurePosixPath(path).name], "/")]
    trouble.extend(tables.missing())
    if notes is not None:
        notes.extend(tables.notes())
    return kept


def shown_path(path: str) -> str:
    """A path as text: the bytes of a name that is not UTF-8 (surrogate escapes, as Python holds them) as \\xNN."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")
