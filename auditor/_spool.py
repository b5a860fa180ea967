"""`tokaudit sync`: the shards a recorder kept in its local spool at close() (the store did not answer), written
to where they were going, as `wandb sync` does for offline runs. Each file goes whole, under its own name (a
name already there is that file, synced before), and leaves the spool once written."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tokaudit.errors import LogFormatError, first_line
from tokaudit._schema import DESTINATION_KEY
from tokaudit._storage import is_url, open_url, shown_path, storage_timeout


@dataclass(frozen=True)
class Synced:
    """One spooled shard written to its destination."""

    source: Path
    destination: str
    records: int


def spooled(folder: Path) -> list[Path]:
    """The spooled shards under `folder` (its sub-folders too), oldest name first."""
    return sorted(p for p in folder.rglob("*.parquet") if p.is_file()) if folder.is_dir() else []


def sync_one(path: Path) -> Synced:
    """Write one spooled shard where its footer says it was going; raises LogFormatError naming it."""
    try:  # (from its bytes: pyarrow opens no path that is not UTF-8)
        data = path.read_bytes()
        metadata = pq.read_schema(pa.BufferReader(data)).metadata or {}
        records = pq.read_metadata(pa.BufferReader(data)).num_rows
    except Exception as error:
        raise LogFormatError(str(path), f"cannot be read ({first_line(error)})") from None
    destination = os.fsdecode(metadata.get(DESTINATION_KEY, b""))  # a folder's name in any bytes, as the OS takes it
    if not destination:
        raise LogFormatError(str(path), "is no spooled shard (its footer names no destination)")
    try:
        written = _write(path, data, destination)
    except LogFormatError:
        raise
    except Exception as error:  # a destination no store or folder takes (a NUL byte, a scheme of no store)
        raise LogFormatError(
            str(path), f"cannot be written to {shown_path(destination)} ({first_line(error)})"
        ) from None
    try:
        path.unlink()
    except OSError as error:  # written: the next sync finds it there, the same bytes, and removes it then
        raise LogFormatError(
            str(path), f"written to {written}, not removed from the spool ({error.strerror})"
        ) from None
    return Synced(path, written, records)


def _write(path: Path, data: bytes, destination: str) -> str:
    """The spooled file's bytes written whole under its own name in `destination`, where it went. A file of that name
    already there is this one synced before where it holds the same bytes; any other (the spooled file itself, as
    when a log's folder is given as the spool, or another file, or a folder) leaves it in the spool."""
    if is_url(destination):
        base = destination.partition("?")[0]
        try:
            store, folder = open_url(destination, storage_timeout())
        except LogFormatError as error:
            raise LogFormatError(str(path), f"cannot be written to {base} ({error.problem})") from None
        target = f"{folder}/{path.name}"
        try:
            from pyarrow import fs

            if store.filesystem.get_file_info(target).type == fs.FileType.NotFound:
                with store.filesystem.open_output_stream(target) as stream:
                    stream.write(data)
            else:
                with store.filesystem.open_input_stream(target) as stream:
                    _same(path, stream.read(), data, base)
        except OSError as error:
            raise LogFormatError(str(path), f"cannot be written to {base} ({first_line(error)})") from None
        query = destination.partition("?")[2]
        return f"{base.rstrip('/')}/{path.name}" + (f"?{query}" if query else "")
    folder_path = Path(destination)
    target_path = folder_path / path.name
    try:
        folder_path.mkdir(parents=True, exist_ok=True)
        if target_path.exists() or target_path.is_symlink():
            if target_path.is_file() and target_path.samefile(path):
                raise LogFormatError(str(path), "is the file at its destination already (a log's shard): left as it is")
            _same(path, target_path.read_bytes() if target_path.is_file() else None, data, str(folder_path))
        else:
            temporary = folder_path / f".{path.name}.tmp"
            temporary.write_bytes(data)
            os.replace(temporary, target_path)
    except OSError as error:
        raise LogFormatError(str(path), f"cannot be written to {folder_path} ({error.strerror or error})") from None
    return str(target_path)


def _same(path: Path, there: bytes | None, data: bytes, where: str) -> None:
    """A file of the spooled file's name at its destination: this one, synced before, or a LogFormatError."""
    if there != data:
        raise LogFormatError(
            str(path), f"{where} holds another file of its name: left in the spool (move one of them, then sync again)"
        )
