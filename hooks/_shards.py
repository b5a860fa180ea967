"""One rank's shard files: exclusive names, written whole (fsync, then published), never replaced.

A shard is written to a dot-prefixed temporary, fsynced, then published under the next free
`{prefix}-{seq:06d}.parquet` with a hard link, which fails instead of replacing a shard another
writer (a second Recorder, a misconfigured launch) already published: the writer then takes the
next number. The folder is fsynced after, so a power loss never leaves an empty published shard.
Steps whose records could not be kept are written down in the next shard's footer metadata.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class ShardWriter:
    """Publishes one rank's shards into one folder."""

    def __init__(self, folder: Path, prefix: str) -> None:
        self.folder = folder
        self.prefix = prefix
        self._temporary = re.compile(r"\." + re.escape(prefix) + r"-\d{6}\.parquet\.(\d+)\.tmp$")
        folder.mkdir(parents=True, exist_ok=True)
        self._remove_stale_temporaries()
        self.sequence = self._next_sequence()
        self.first_sequence = self.sequence
        """The number this writer's first shard takes: after every shard of its rank already in the folder."""

    def write(self, table: pa.Table, metadata: dict[bytes, bytes] | None = None) -> Path:
        """Write and publish one shard; raises OSError when it cannot (nothing half-written stays)."""
        if metadata:
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
        temporary = self.folder / f".{self.prefix}-{self.sequence:06d}.parquet.{os.getpid()}.tmp"
        self.folder.mkdir(parents=True, exist_ok=True)  # a folder removed while training is made again
        try:
            pq.write_table(table, temporary)
            with open(temporary, "rb") as handle:
                os.fsync(handle.fileno())
            final = self._publish(temporary)
        finally:
            temporary.unlink(missing_ok=True)
        self._sync_folder()
        return final

    def _publish(self, temporary: Path) -> Path:
        while True:
            final = self.folder / f"{self.prefix}-{self.sequence:06d}.parquet"
            try:
                os.link(temporary, final)  # exclusive: never replaces a published shard
            except FileExistsError:
                self.sequence = max(self.sequence + 1, self._next_sequence())
                continue
            except OSError as error:
                if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                    raise
                # No hard links here: claim the name, then move the whole file onto it.
                try:
                    os.close(os.open(final, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    self.sequence = max(self.sequence + 1, self._next_sequence())
                    continue
                os.replace(temporary, final)
            self.sequence += 1
            return final

    def _sync_folder(self) -> None:
        try:
            descriptor = os.open(self.folder, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(descriptor)
        except OSError:
            pass  # some filesystems cannot fsync a folder; the shard itself is synced
        finally:
            os.close(descriptor)

    def _next_sequence(self) -> int:
        # A resumed run never overwrites the shards of the run before it.
        return next_sequence(self.prefix, (p.name for p in self.folder.iterdir()))

    def _remove_stale_temporaries(self) -> None:
        """A killed writer of this rank leaves a temporary; remove it unless its process still runs."""
        for path in self.folder.iterdir():
            match = self._temporary.match(path.name)
            if match and not _running(int(match.group(1))):
                path.unlink(missing_ok=True)


def next_sequence(prefix: str, names: Iterable[str]) -> int:
    """The number after the highest `{prefix}-{seq:06d}.parquet` among `names` (0 when none)."""
    pattern = re.compile(re.escape(prefix) + r"-(\d{6})\.parquet$")
    return max((int(m.group(1)) for name in names if (m := pattern.match(name))), default=-1) + 1


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StoreShardWriter:
    """Publishes one rank's shards into a folder on object storage (`s3://bucket/runs/exp1`).

    An object store has no rename to publish with, but one upload is atomic: the shard is
    serialized whole in memory, then uploaded under its final name, so a reader lists either the
    complete file or nothing (never a prefix of it). A name already taken (a resumed run, a second
    writer) is skipped, as locally. The store's credentials and endpoint come from the environment
    (see `tokaudit._storage`).
    """

    def __init__(self, url: str, prefix: str) -> None:
        from tokaudit._storage import open_url, storage_timeout

        self.store, self.folder = open_url(url, storage_timeout())
        self.prefix = prefix
        self.sequence = self._next_sequence()
        self.first_sequence = self.sequence
        """The number this writer's first shard takes: after every shard of its rank already in the folder."""
        self.pending: str | None = None
        """The name of the upload that failed last: its response may have been lost after it was stored."""

    def write(self, table: pa.Table, metadata: dict[bytes, bytes] | None = None) -> str:
        """Upload one shard; raises OSError when it cannot (nothing partial is ever listed)."""
        from pyarrow import fs

        if metadata:
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = sink.getvalue()
        filesystem = self.store.filesystem
        while True:
            final = f"{self.folder}/{self.prefix}-{self.sequence:06d}.parquet"
            if filesystem.get_file_info(final).type != fs.FileType.NotFound:
                self.sequence = max(self.sequence + 1, self._next_sequence())
                continue
            self.pending = final
            with filesystem.open_output_stream(final) as stream:
                stream.write(data)
            self.pending = None
            self.sequence += 1
            return str(self.store.url(final))

    def landed(self) -> bool:
        """Whether the upload that failed last is in the store after all (a store that hung past the timeouts in
        its answer, not in storing): then its records are published, under their name, and must not be again."""
        from pyarrow import fs

        name, self.pending = self.pending, None
        if name is None or self.store.filesystem.get_file_info(name).type == fs.FileType.NotFound:
            return False
        self.sequence += 1
        return True

    def _next_sequence(self) -> int:
        from pyarrow import fs

        entries = self.store.filesystem.get_file_info(fs.FileSelector(self.folder, allow_not_found=True))
        return next_sequence(self.prefix, (e.base_name for e in entries))
