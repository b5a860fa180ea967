"""Past one machine: the audit's footers and step ranges mapped over a Ray cluster (`tokaudit check --ray`).

Ray schedules, DuckDB aggregates: each step range is aggregated by `engine.aggregate_range` on a worker (the same
query over the same records as in one process, so the same bits), and this process joins the parts in step order
and runs the checks. The workers read the log themselves: object storage, or a folder they all see.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from tokaudit.errors import UsageError, first_line
from tokaudit._loading import BATCH_FILES, Loading, LogSet, inspected_log
from tokaudit._storage import Store

IN_FLIGHT_PER_CPU = 2
"""Tasks submitted ahead per CPU of the cluster: enough to keep every worker busy, few enough that the parts
waiting to be joined in order stay few."""

VISIBLE_SAMPLE = 64
"""Local files each node is asked about before any work starts (the first, the last, and some between)."""


class Cluster:
    """A connection to a Ray cluster, with this tokaudit and DuckDB on every node (`connect`)."""

    def __init__(self, ray: Any, address: str, watch: HeadWatch) -> None:
        self.ray = ray
        self.address = address
        self.cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._watch = watch
        if not address.startswith("ray://"):  # (a Ray client talks to the cluster through its server alone)
            watch.head = str(ray.get_runtime_context().gcs_address)  # the head `auto` stood for
        self._kept_printer = _quiet_pushed_errors(ray)

    @classmethod
    def connect(cls, address: str) -> Cluster:
        """Join the cluster at `address`; one line (a UsageError) where Ray is missing, the cluster does not
        answer, or a node runs another tokaudit or DuckDB than this process."""
        try:
            import ray
        except ImportError:
            raise UsageError(
                "--ray needs Ray on this machine and the cluster's: pip install ray (or the ray extra: pip install "
                "'.[ray]' in a checkout of tokaudit)"
            ) from None
        if ray.is_initialized():
            raise UsageError(
                "Ray is already initialized in this process (ray.init): the audit joins the cluster itself; call "
                "ray.shutdown() first, or audit in a process of its own (tokaudit check … --ray)"
            )
        _answers(address)
        watch = HeadWatch(address)
        # Ray's own C++ warnings and errors (each failed retry of a connection, a line a second; each error it could not
        # push to a driver) are not the audit's output: a failure is one line of the audit's
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
        try:
            with warnings.catch_warnings(), _quiet_stderr():
                warnings.simplefilter("ignore")  # a Ray client's warning of the timeout its error then says again
                ray.init(
                    address=address,
                    logging_level=logging.ERROR,
                    log_to_driver=False,
                    configure_logging=False,
                    runtime_env={"env_vars": forwarded_environment()},
                )
        except Exception as error:  # Ray raises ConnectionError, RuntimeError or its own for an absent cluster
            watch.stop()
            said = " ".join(str(error).split())[:400] or first_line(error)  # Ray's remedy may follow a line break
            if address == "auto" and "Could not find any running Ray instance" in said:  # Ray's remedy names its flag
                said = (
                    "no Ray runs on this machine: start one with `ray start --head`, or give a cluster's address, "
                    "--ray ADDRESS or RAY_ADDRESS"
                )
            raise UsageError(f"cannot reach the Ray cluster at {address} ({said})") from None
        try:
            cluster = cls(ray, address, watch)
        except Exception as error:  # the cluster's head died since it answered
            watch.stop()
            ray.shutdown()
            raise _failed("joining the cluster", error) from None
        try:
            cluster._check_versions()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _on_every_node(self, what: str, function: Callable[..., Any], *arguments: Any) -> list[Any]:
        """`function(*arguments)` once on each live node, pinned there (`what` it asks, for the line of a failure)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        try:
            task = self.ray.remote(function)
            nodes = [node["NodeID"] for node in self.ray.nodes() if node.get("Alive")]
            pinned = [NodeAffinitySchedulingStrategy(node, soft=False) for node in nodes]
            return list(self.ray.get([task.options(scheduling_strategy=where).remote(*arguments) for where in pinned]))
        except Exception as error:  # a node died meanwhile
            raise _failed(what, error) from None

    def _check_versions(self) -> None:
        here = versions()
        for there in self._on_every_node("the versions on every node", versions):
            if there != here:
                raise UsageError(
                    f"a node of the Ray cluster at {self.address} runs {_versions_text(there)}, this "
                    f"process {_versions_text(here)}: install the same on every node"
                )

    def check_visible(self, files: Sequence[Any]) -> None:
        """Refuse, before any work, a local file some node cannot read (a path only this machine has)."""
        if not files:
            return
        step = max(1, len(files) // VISIBLE_SAMPLE)
        sample = sorted({str(files[0]), str(files[-1]), *(str(path) for path in files[::step])})
        for missing in self._on_every_node("the log's files on every node", unreadable, sample):
            if missing:
                raise _unseen(missing)

    def map(self, function: Callable[[Any], Any], items: Sequence[Any]) -> Iterator[Any]:
        """function(item) for each item on the cluster, in order, at most IN_FLIGHT_PER_CPU tasks a CPU ahead. A task
        whose worker dies is run again (Ray's retries); one that still fails ends the audit with one line naming
        its item. An error the function itself raised (DuckDB's, on a file it cannot decode) is raised here as one
        process would raise it, so that the audit names the file and goes on without it, as it does there."""
        task = self.ray.remote(function).options(max_retries=3)
        pending: list[tuple[Any, Any]] = []
        queued = iter(items)
        try:
            while True:
                while len(pending) < self.cpus * IN_FLIGHT_PER_CPU:
                    item = next(queued, None)
                    if item is None:
                        break
                    try:  # (a raylet that died refuses the submission)
                        pending.append((item, task.remote(item)))
                    except Exception as error:
                        raise _failed(item, error) from None
                if not pending:
                    return
                item, reference = pending.pop(0)
                try:
                    yield self.ray.get(reference)
                except self.ray.exceptions.RayTaskError as error:
                    cause = getattr(error, "cause", None)
                    if isinstance(cause, Exception) and not isinstance(cause, self.ray.exceptions.RayError):
                        raise cause from None
                    raise _failed(item, error) from None
                except Exception as error:
                    raise _failed(item, error) from None
        finally:
            for _, reference in pending:
                try:
                    self.ray.cancel(reference, force=True)
                except Exception:  # finished meanwhile
                    pass

    def load(self, found: Loading) -> LogSet:
        """`Loading.result`, the footers of the files `found` read on the workers, BATCH_FILES at a time (those on
        object storage one at a time)."""
        self.check_visible(found.files)
        batches: list[tuple[list[PurePath], list[Store | None] | None]] = [
            (list(found.files[i : i + BATCH_FILES]), None) for i in range(0, len(found.files), BATCH_FILES)
        ]
        batches += [([path], [store]) for path, store in found.remote]
        footers = [_Footers(*batch, found.thorough) for batch in batches]
        inspected = []
        for batch, part in zip(footers, self.map(_inspect, footers), strict=True):
            if isinstance(part, str):  # a file the worker could not open: refused where this process reads it
                if os.access(part, os.R_OK):
                    raise _unseen(part)
                part = _inspect(batch, here=True)  # as one process reads a file it cannot open
            inspected += part
        return inspected_log(inspected, found.problems)

    def close(self) -> None:
        """Leave the cluster. Ray's printer is put back after: the errors of the tasks `map` cancelled arrive until
        then."""
        self._watch.stop()
        try:
            self.ray.shutdown()
        finally:
            if self._kept_printer is not None:
                self.ray._private.worker.print_to_stdstream = self._kept_printer


def _failed(item: object, error: Exception) -> UsageError:
    """The line for a task that failed for good: Ray's text without its terminal colours."""
    said = re.sub(r"\x1b\[[0-9;]*m", "", first_line(error))
    return UsageError(f"the Ray task for {item} failed ({said}); no verdict was made from a part of the log")


FORWARDED_PREFIXES = ("AWS_", "GOOGLE_", "GCS_", "AZURE_", "TOKAUDIT_")
"""The environment the workers get from this process: the object store's endpoint and credentials (as pyarrow's
filesystems read them) and tokaudit's own settings, so that they read the log this process listed."""


def forwarded_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_PREFIXES)}


def _answers(address: str) -> None:
    """A HOST:PORT, or a Ray client's ray://HOST:PORT, that no Ray server answers is refused at once: Ray would retry it
    for minutes (its client for half of one, with a warning of its own), or for ever where another server listens
    there. `auto` is the address Ray would join (RAY_ADDRESS, else the cluster this machine last started), whose
    head may have died since."""
    found = _server(address)
    if found is None:
        return  # `auto` with no cluster started here, `local`, another scheme: Ray's to answer
    served, host, port = found
    try:
        grpc = _speaks_grpc(host, port, CONNECT_SECONDS)
    except OSError as error:
        where = f"{served}: " if served != address.removeprefix("ray://") else ""  # what `auto` stood for
        raise UsageError(f"cannot reach the Ray cluster at {address} ({where}{error.strerror or error})") from None
    if not grpc:
        raise UsageError(
            f"cannot reach the Ray cluster at {address} ({served} answers, but not as Ray does: its head's port, "
            "6379 unless `ray start --head --port` said another, or a Ray client's ray://HOST:10001)"
        )


def _server(address: str) -> tuple[str, str, int] | None:
    """The server an address names (`auto`: the cluster Ray would join; ray://: a Ray client's server): its HOST:PORT,
    its host as sockets take it and its port; None where only Ray can tell."""
    served = (_auto_address() if address == "auto" else address.removeprefix("ray://")) or ""
    host, _, port = served.rpartition(":")
    if not host or not port.isdigit() or "://" in served:
        return None
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # an IPv6 address, as sockets take it
    return served, host, int(port)


def _speaks_grpc(host: str, port: int, timeout: float) -> bool:
    """Whether the server answers as Ray's gRPC does (a cluster that speaks TLS answers no plain preface: connecting
    is all there is to ask it); OSError where it cannot be reached."""
    with socket.create_connection((host, port), timeout=timeout) as connection:
        return _tls() or _speaks_http2(connection)


def _speaks_http2(connection: socket.socket) -> bool:
    """Whether the server speaks HTTP/2, as Ray's gRPC ports do: to a client's preface it answers with a frame of
    SETTINGS (type 4, the fourth byte of its header) first, where an HTTP/1 server answers with text or closes."""
    try:
        connection.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        head = connection.recv(9)
    except OSError:
        return False
    return len(head) >= 4 and head[3] == 4


def _auto_address() -> str | None:
    """The address `ray.init("auto")` joins: RAY_ADDRESS, else the cluster last started on this machine (Ray's note of
    it), None where there is none."""
    from_environment = os.environ.get("RAY_ADDRESS")
    if from_environment:
        return from_environment.removeprefix("ray://")
    try:
        from ray._private.utils import read_ray_address  # (Ray's own reading of its note)

        found = read_ray_address()
        return str(found) if found else None
    except Exception:
        return None


CONNECT_SECONDS = 10

HEAD_PATIENCE = 20.0
"""Seconds the audit waits for a cluster head (its GCS) that stopped answering. Ray's driver waits a minute, blocked
wherever it was (listing nodes, submitting a task, waiting for one), then ends the process itself in exit 1, which
means findings; a head that restarts sooner, as one with fault tolerance does, is waited for."""


class HeadWatch:
    """From before Ray joins the cluster until the audit leaves it, every second: whether the head answers as Ray's
    gRPC does (a frozen head accepts connections but answers nothing). Silent for HEAD_PATIENCE seconds, or half of
    Ray's own wait where that is set shorter, the audit ends in one line and exit 2: the main thread may be blocked in
    Ray's C++, and standard error sent nowhere while Ray joins (`_quiet_stderr`), so the line goes to a copy of it."""

    def __init__(self, address: str) -> None:
        self.address = address
        found = _server(address)
        self.head = found[0] if found else None
        self._stopped = threading.Event()
        try:
            self._error = os.dup(2)
        except OSError:  # standard error closed: the line goes nowhere, the exit code says it
            self._error = os.open(os.devnull, os.O_WRONLY)
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        patience = min(HEAD_PATIENCE, float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", 60)) / 2)
        silent_since = None
        try:
            while not self._stopped.wait(1.0):
                head = self.head
                said = _silence(head) if head else ""
                if not said:
                    silent_since = None
                    continue
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since >= patience and not self._stopped.is_set():
                    line = (
                        f"tokaudit: error: the Ray cluster at {self.address} stopped answering mid-audit (its head, "
                        f"{head}: {said}); no verdict was made from a part of the log\n"
                    )
                    os.write(self._error, line.encode(errors="replace"))
                    os._exit(2)  # (EXIT_BAD_INPUT)
        finally:
            os.close(self._error)


def _silence(head: str) -> str:
    """'' where the head (HOST:PORT) answers, else why not."""
    _, host, port = _server(head) or (head, head, 0)
    try:
        return "" if _speaks_grpc(host, port, 1.0) else "no answer within a second"
    except OSError as error:
        return error.strerror or str(error)


def _tls() -> bool:
    return os.environ.get("RAY_USE_TLS", "0").lower() not in ("", "0", "false")


@dataclass(frozen=True)
class _Footers:
    """A batch of files whose footers a worker reads (`reader.inspect_batch`)."""

    paths: list[PurePath]
    stores: list[Store | None] | None
    thorough: bool

    def __str__(self) -> str:
        return (
            f"the footers of {self.paths[0]} and {len(self.paths) - 1} more"
            if len(self.paths) > 1
            else f"the footer of {self.paths[0]}"
        )


def _inspect(batch: _Footers, here: bool = False) -> list[Any] | str:
    """What `reader.inspect_batch` reads of the batch, or the first of its local files this worker cannot open (one
    outside the sample `Cluster.check_visible` asked every node about)."""
    from tokaudit._reader import inspect_batch

    missing = unreadable([str(path) for path in batch.paths]) if batch.stores is None and not here else ""
    return missing or inspect_batch(batch.paths, batch.thorough, batch.stores)


def _unseen(path: str) -> UsageError:
    return UsageError(
        f"{path}: the Ray cluster's workers cannot read it; give them a folder they all see or an object-storage URL "
        "(s3://, gs://, …)"
    )


def versions() -> tuple[str, str, str]:
    """tokaudit's, DuckDB's and pyarrow's versions where this runs: a part aggregated by another DuckDB may differ
    in its last bits."""
    import duckdb
    import pyarrow

    import tokaudit

    return tokaudit.__version__, duckdb.__version__, pyarrow.__version__


def _versions_text(found: tuple[str, str, str]) -> str:
    return f"tokaudit {found[0]}, DuckDB {found[1]} and pyarrow {found[2]}"


def unreadable(paths: Sequence[str]) -> str:
    """The first of these files this node cannot open for reading, or ''."""
    for path in paths:
        if not os.access(path, os.R_OK):
            return path
    return ""


def _quiet_pushed_errors(ray: Any) -> Callable[..., None] | None:
    """Ray's driver prints each error the cluster pushes to it (a node marked dead, a worker killed) on stdout, where
    the report goes: the audit says such a failure in one line of its own (`Cluster.map`). Ray's printer, to put back."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    kept = getattr(worker, "print_to_stdstream", None)
    if kept is not None:
        worker.print_to_stdstream = lambda *_, **__: None  # type: ignore[union-attr]
    return kept


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Standard error, the file descriptor, to nowhere while Ray starts in this process: what its C++ core and its
    Python say of themselves there (the log level it read, the cluster's token authentication) is not the audit's
    output, and a failure to connect is the exception `connect` says in one line."""
    sys.stderr.flush()
    kept = os.dup(2)
    nowhere = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(nowhere, 2)
        yield
    finally:
        os.dup2(kept, 2)
        os.close(kept)
        os.close(nowhere)
