"""Find the log's files and start validating them: discovery and the footer workers, without pyarrow.

Which local files: `tokaudit._discovery`. The command line calls `start_loading` before it imports anything heavy (pyarrow, pandas, DuckDB: most
of its half second of start-up), so that the worker processes validate footers meanwhile; `Loading.result`
then validates files too, from the far end of each worker's share, until they meet (`_share`). The
validation itself is `tokaudit._reader`'s.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath, PurePosixPath
from typing import IO, TYPE_CHECKING, Any

from tokaudit.errors import EMPTY_PATH, LogFormatError
from tokaudit._discovery import discover
from tokaudit._storage import is_url, local_path

if TYPE_CHECKING:
    from tokaudit._reader import Shard
    from tokaudit._storage import Store


@dataclass(frozen=True, slots=True)
class LogSet:
    """What `load` found: readable shards and one line per unreadable input."""

    shards: list[Shard]
    """Validated shards, in path order."""
    problems: list[LogFormatError]
    """Files or paths that could not be used."""


PARALLEL_FILES = 1024
"""Local files from which `load` validates footers in worker processes (when given more than one
worker): a worker is an interpreter importing pyarrow, worth starting only where its share of footers costs
more than that. This process never waits for one (`_share`), so a worker only costs wall time where no
core is free."""
BATCH_FILES = 512
"""Fewest files given to one worker."""
MAX_WORKERS = 8
"""Most processes validating footers at once, this one included: each worker is an interpreter of about
100 MiB, and footers are partly disk-bound, so a machine of 64 cores gains little from 64 of them."""
FRAME_FILES = 64
"""Files a worker answers at a time: how far this process may find a worker ahead of
what it last heard, and so at most how many files both validate where they meet."""


def load(paths: Sequence[str | os.PathLike[str]], thorough: bool = True, workers: int = 1) -> LogSet:
    """Discover and validate; a damaged shard never hides the others. Local paths and URLs
    (s3://bucket/runs/, see `tokaudit._storage`) may be mixed.

    `workers`: processes that may validate local footers at once. Reading a footer is Python work
    (pyarrow's objects), so threads do not help, and on a log of many thousands of files it is the
    one serial part of the audit; processes are used from PARALLEL_FILES files up, and the result
    (shards and problems, in path order) is the serial one whichever way it was computed."""
    with start_loading(paths, thorough, workers) as loading:
        return loading.result()


@dataclass
class _Share:
    """A worker's share of the files, files[start:end]: it validates them in order from `start` and answers
    in frames (`serve`); this process validates them from `end` down (`taken`) once it calls `result`."""

    worker: subprocess.Popen[bytes] | None
    """The worker; None once it has answered its last frame, died, or said something unreadable."""
    start: int
    end: int
    answered: list[Any] = field(default_factory=list)
    """The worker's answers (`reader.packed_shards`), for files[start], files[start + 1], …"""
    taken: list[Any] = field(default_factory=list)
    """This process's, for files[end − 1], files[end − 2], …"""
    unread: bytearray = field(default_factory=bytearray)
    """What the worker wrote that does not yet make a whole frame."""

    @property
    def left(self) -> int:
        """Files neither has validated: files[start + len(answered) : end − len(taken)]."""
        return max(0, self.end - len(self.taken) - self.start - len(self.answered))


@dataclass
class Loading:
    """A `load` under way (`start_loading`): the worker processes validate their shares while the caller
    goes on (the command line imports the auditor meanwhile, half a second); `result` validates files from
    the far end of each share until it meets its worker (`_share`). Closing it stops any worker still
    running."""

    files: list[Path]
    """The local files found, in path order."""
    remote: list[tuple[PurePath, Store | None]]
    """The files found on object storage, each with its store."""
    problems: list[LogFormatError]
    """What discovery could not use."""
    thorough: bool
    shares: list[_Share] = field(default_factory=list)
    """Each worker started and its share of `files`, in order; none: this process validates them all."""
    notes: list[str] = field(default_factory=list)
    """Links out of the folders given, each with what it is read from (`discover`)."""
    since: int = field(default_factory=time.time_ns)
    """When the files were found (ns): one modified after it changed while the audit read it (`opening.changed`)."""

    @property
    def workers(self) -> list[subprocess.Popen[bytes]]:
        """The worker processes started."""
        return [share.worker for share in self.shares if share.worker is not None]

    def result(self) -> LogSet:
        from tokaudit._reader import inspect_batch

        inspected = (
            _share(self.files, self.shares, self.thorough) if self.shares else inspect_batch(self.files, self.thorough)
        )
        inspected += _inspect_remote(self.remote, self.thorough)
        return inspected_log(inspected, self.problems)

    def close(self) -> None:
        _stop(self.shares)

    def __enter__(self) -> Loading:
        return self

    def __exit__(self, *exception: object) -> None:
        self.close()


def inspected_log(inspected: Sequence[Any], problems: Sequence[LogFormatError]) -> LogSet:
    """The log of these validated files (each a Shard, or its name and problem), after discovery's `problems`."""
    from tokaudit._reader import Shard

    found = [*problems, *(LogFormatError(*item) for item in inspected if not isinstance(item, Shard))]
    return LogSet(shards=separate_runs([item for item in inspected if isinstance(item, Shard)]), problems=found)


def start_loading(paths: Sequence[str | os.PathLike[str]], thorough: bool = True, workers: int = 1) -> Loading:
    """`load`'s discovery, and its worker processes started on their shares: `result()` gives what `load`
    gives."""
    notes: list[str] = []
    # "" is no folder (an unset $VAR), though Path("") is the current one: auditing that would judge other logs
    empty = [LogFormatError('""', EMPTY_PATH) for p in paths if os.fspath(p) == ""]
    paths = [local_path(p) for p in paths if os.fspath(p) != ""]
    files, problems = discover([p for p in paths if not is_url(p)], notes)
    problems = empty + problems
    remote: list[tuple[PurePath, Store | None]] = []
    urls = [str(p) for p in paths if is_url(p)]
    if urls:
        from tokaudit._storage import discover_url  # (pyarrow's filesystems)

        for url in urls:
            store, found, trouble = discover_url(url, notes)
            problems.extend(trouble)
            remote.extend((PurePosixPath(path), store) for path in found)
    shares = _start_workers(files, thorough, workers) if workers > 1 and len(files) >= PARALLEL_FILES else []
    return Loading(files=files, remote=remote, problems=problems, thorough=thorough, shares=shares, notes=notes)


def separate_runs(shards: list[Shard]) -> list[Shard]:
    """A run is its folder and its run id: where one run id is held by the shards of several folders that repeat a
    (step, rank) (two experiments that reused a name), each folder's shards are a run of their own, named by the
    folder's path (and the id, where the folder is named otherwise), as TensorBoard takes each folder for a run. To
    audit them as one run, put their shards in one folder. Folders that share no (step, rank) are parts of one run
    (a log partitioned by day, `date=…/`, a run past midnight in two)."""
    from dataclasses import replace

    from tokaudit._partitions import run_folder  # (pyarrow: after the workers started)

    def run_of(shard: Shard) -> str | None:
        if shard.run_group is not None:
            return shard.run_group[0]
        return shard.default_run if "run_id" not in shard.columns else None  # None: several in one file

    def folder_of(shard: Shard) -> str:
        if shard.store is not None:
            return shard.store.url(run_folder(shard.path))
        folder = str(run_folder(shard.path))
        shown = os.path.relpath(folder)
        return folder if shown.startswith("..") else shown

    folders: dict[str, dict[str, list[Shard]]] = {}
    for shard in shards:
        if (run := run_of(shard)) is not None:
            folders.setdefault(run, {}).setdefault(folder_of(shard), []).append(shard)
    clashing = {run for run, held in folders.items() if len(held) > 1 and _repeat(held) and _keys_shared(held)}
    if not clashing:
        return shards
    out = []
    for shard in shards:
        run = run_of(shard)
        if run not in clashing:
            out.append(shard)
            continue
        folder = folder_of(shard)
        name = folder if folder.rstrip("/").rsplit("/", 1)[-1] == run else f"{folder}:{run}"
        out.append(
            replace(
                shard,
                default_run=name,
                run_override=True,
                names=None if shard.names is None else (name, *shard.names[1:]),
                run_group=None if shard.run_group is None else (name, shard.run_group[1]),
            )
        )
    return out


def _repeat(folders: dict[str, list[Shard]]) -> bool:
    """Whether two of the folders may hold one (group, step, rank), by their files' step and rank ranges (a file of
    no known range, or of 64 ranks or more, may)."""
    spans: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for folder, held in folders.items():
        for shard in held:
            steps, ranks = shard.step_range, shard.rank_range
            if steps is None or ranks is None or ranks[1] - ranks[0] >= 64:
                return True
            group = shard.run_group[1] if shard.run_group is not None else ""
            for rank in range(ranks[0], ranks[1] + 1):  # a file of several ranks: its steps, for each of them
                spans.setdefault((group, rank), []).append((steps[0], steps[1], folder))
    for rank_spans in spans.values():
        reach: dict[str, int] = {}  # per folder, the last step its spans so far reach
        for first, last, folder in sorted(rank_spans):
            if any(end >= first for other, end in reach.items() if other != folder):
                return True
            reach[folder] = max(reach.get(folder, last), last)
    return False


def _keys_shared(folders: dict[str, list[Shard]]) -> bool:
    """Whether two of the folders hold one (step, rank), by their records: where their files' ranges overlap (a step
    that ran past midnight, its ranks' records in two days' folders), the records say. A file on object storage, or
    one that cannot be read here: they may."""
    import numpy as np
    import pyarrow.parquet as pq

    held = []
    for shards in folders.values():
        keys = []
        for shard in shards:
            given = dict(shard.partition)  # a column its folders give: every record's value
            if shard.store is not None:
                return True
            try:
                read = pq.read_table(shard.path, columns=[c for c in ("step", "rank") if c not in given])
            except Exception:
                return True
            step, rank = ([given[c]] * read.num_rows if c in given else read[c] for c in ("step", "rank"))
            # one number a key; ranks from 2²⁴ on may repeat another's, which reads as shared (the folders apart)
            keys.append(np.asarray(step, np.int64) * (1 << 24) + np.asarray(rank, np.int64))
        held.append(np.unique(np.concatenate(keys)))
    every = np.concatenate(held)
    return len(np.unique(every)) < len(every)


REMOTE_READERS = 16
"""Footers of objects read at once: each is a request's round trip, not a disk's."""


def _inspect_remote(remote: list[tuple[PurePath, Store | None]], thorough: bool) -> list[Shard | tuple[str, str]]:
    """The objects' footers, REMOTE_READERS at a time, in order. A store that does not answer ends the audit at
    its first such answer (one line, exit 2), instead of every object paying the timeouts in turn."""
    from concurrent.futures import ThreadPoolExecutor

    from tokaudit._reader import inspect_batch
    from tokaudit._storage import UNREACHABLE

    pool = ThreadPoolExecutor(REMOTE_READERS, thread_name_prefix="tokaudit-footers")
    try:
        futures = [pool.submit(inspect_batch, [path], thorough, [store]) for path, store in remote]
        out: list[Shard | tuple[str, str]] = []
        for future in futures:
            (item,) = future.result()
            if isinstance(item, tuple) and item[1].startswith(UNREACHABLE):
                raise LogFormatError(*item)
            out.append(item)
        return out
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_WORKER = (
    "import pickle, sys; paths, thorough, sys.path[:] = pickle.load(sys.stdin.buffer); "
    "from tokaudit._loading import serve; serve(paths, thorough, sys.stdout.buffer)"
)
"""A worker: its files (as text) and this interpreter's import path in on stdin, its answers out on stdout
in frames (`serve`)."""


def serve(paths: Sequence[str], thorough: bool, out: IO[bytes]) -> None:
    """A worker's loop: FRAME_FILES files validated at a time, each frame written as its length (8 bytes,
    little-endian) and `reader.packed_shards`'s answers pickled. A thread writes, so that validating goes on while
    the pipe is full (64 KiB, about 150 answers): the caller reads nothing while it imports the auditor."""
    from tokaudit._reader import inspect_batch, packed_shards

    frames: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def write() -> None:
        while (frame := frames.get()) is not None:
            out.write(frame)
            out.flush()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    for start in range(0, len(paths), FRAME_FILES):
        answers = pickle.dumps(
            packed_shards(inspect_batch([PurePath(p) for p in paths[start : start + FRAME_FILES]], thorough)),
            pickle.HIGHEST_PROTOCOL,
        )
        frames.put(len(answers).to_bytes(8, "little") + answers)
    frames.put(None)
    writer.join()


def _start_workers(files: Sequence[Path], thorough: bool, workers: int) -> list[_Share]:
    """One worker process started on each share of `files` (none when too few files make a share each, or
    no worker could be started); this process counts among `workers` and takes no share of its own.

    Workers are fresh interpreters (`python -c`), not multiprocessing's: those fork the caller, which
    may hold threads (a training process, DuckDB's pool), or re-import the caller's main script. Their
    answers are read as they come without waiting (`select`): on POSIX only."""
    count = min(workers, MAX_WORKERS, len(files) // BATCH_FILES) - 1
    if count < 1 or os.name != "posix":
        return []
    size = -(-len(files) // count)
    shares: list[_Share] = []
    try:
        for start in range(0, len(files), size):
            worker = subprocess.Popen(
                [sys.executable, "-c", _WORKER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            shares.append(_Share(worker, start, min(start + size, len(files))))
            assert worker.stdin is not None
            # A list of paths: a few MB at most, which the worker reads whole before it writes anything.
            pickle.dump(
                ([str(path) for path in files[start : start + size]], thorough, list(sys.path)),
                worker.stdin,
                pickle.HIGHEST_PROTOCOL,
            )
            worker.stdin.close()
    except Exception:
        # No worker here (no interpreter at sys.executable, a sandbox without processes, a broken pipe).
        _stop(shares)
        return []
    return shares


def _share(files: Sequence[Path], shares: list[_Share], thorough: bool) -> list[Shard | tuple[str, str]]:
    """Every file's Shard or problem, in path order: each worker's answers read as they come, while this
    process validates the files of the share with the most left, from its far end, one at a time, until
    none is left. A worker that dies or says something unreadable leaves the rest of its share here; the
    result is the serial one either way."""
    from tokaudit._reader import inspect_batch, unpacked_shards

    try:
        while True:
            _read_answers(shares)
            share = max(shares, key=lambda s: s.left)
            if share.left == 0:
                break
            share.taken.extend(inspect_batch([files[share.end - len(share.taken) - 1]], thorough))
    finally:
        _stop(shares)
    inspected: list[Shard | tuple[str, str]] = []
    for share in shares:
        middle = share.end - len(share.taken)  # the worker's answers up to here, then this process's
        inspected += unpacked_shards(share.answered[: middle - share.start], files[share.start : middle])
        inspected += reversed(share.taken)
    return inspected


def _read_answers(shares: list[_Share]) -> None:
    """Whatever the workers have written, read without waiting and added to their shares' answers."""
    readable = {
        share.worker.stdout.fileno(): share
        for share in shares
        if share.worker is not None and share.worker.stdout is not None
    }
    if not readable:
        return
    ready, _, _ = select.select(list(readable), [], [], 0)
    for fd in ready:
        share = readable[fd]
        try:
            data = os.read(fd, 1 << 20)
        except OSError:
            data = b""
        if not data:  # its last frame read, or it died
            _stop([share])
            continue
        share.unread += data
        while len(share.unread) >= 8 and len(share.unread) >= 8 + (
            length := int.from_bytes(share.unread[:8], "little")
        ):
            try:
                share.answered.extend(pickle.loads(share.unread[8 : 8 + length]))
            except Exception:  # not what a worker writes: nothing more of it is believed
                _stop([share])
                break
            del share.unread[: 8 + length]


def _stop(shares: Sequence[_Share]) -> None:
    """Kill the workers still running (their answers read, or given up) and forget them."""
    for share in shares:
        worker, share.worker = share.worker, None
        if worker is None:
            continue
        if worker.poll() is None:
            worker.kill()
        worker.wait()
        if worker.stdout is not None:
            worker.stdout.close()
