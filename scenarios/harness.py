"""Run a function on W real gloo processes with a strict teardown and a kill timeout."""

from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

GLOO_TIMEOUT_S = 30
_context: Any = None


PRELOAD = ("scenarios.preload",)
"""The one module the forkserver imports before it forks any job (what it imports and why: its docstring)."""


def _forkserver() -> Any:
    # spawn would pay every import in every job; fork from a parent that has run torch is not safe.
    global _context
    if _context is None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(list(PRELOAD))
    return _context


def run_ddp_each(
    fn: Callable[..., Any], world_size: int, items: list[Any], *args: Any, timeout: float = 90.0
) -> list[list[Any]]:
    """`fn(rank, world_size, item, *args)` for each item in turn, in one set of `world_size` gloo processes
    (one process start and one rendezvous for all): per item, each rank's value."""
    by_rank = run_ddp(_each, world_size, fn, items, args, timeout=timeout * max(1, len(items)))
    return [[by_rank[rank][index] for rank in range(world_size)] for index in range(len(items))]


def _each(rank: int, world_size: int, fn: Callable[..., Any], items: list[Any], args: tuple[Any, ...]) -> list[Any]:
    return [fn(rank, world_size, item, *args) for item in items]


def _worker(fn: Callable[..., Any], rank: int, world_size: int, workdir: str, args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    def job() -> Any:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=GLOO_TIMEOUT_S),
        )
        try:
            return fn(rank, world_size, *args)
        finally:
            gc.collect()
            dist.destroy_process_group()

    _report(job, rank, workdir)


def _report(job: Callable[[], Any], rank: int, workdir: str) -> None:
    """Run `job` on one thread of torch and leave its value, or its traceback, where `_gather` reads it."""
    import torch

    torch.set_num_threads(1)
    outcome: tuple[str, Any]
    try:
        outcome = ("ok", job())
    except BaseException:
        outcome = ("error", traceback.format_exc())
    with open(f"{workdir}/result-{rank}.pkl.tmp", "wb") as handle:
        pickle.dump(outcome, handle)
    os.replace(f"{workdir}/result-{rank}.pkl.tmp", f"{workdir}/result-{rank}.pkl")


def run_ddp(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` gloo processes; return each rank's value.

    Raises RuntimeError with the rank's traceback when one fails, TimeoutError when a job hangs
    (every process is then killed, so a hung collective never stalls the suite).
    """
    return _gather(lambda rank, workdir: (fn, rank, world_size, workdir, args), _worker, world_size, timeout)


def launch(program: str, *args: str, world_size: int = 2, timeout: float = 180.0) -> None:
    """Run a training script (a path, or `-m module`) as `torchrun --nproc-per-node W` runs it: in `world_size`
    processes, each with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...),
    as `__main__` with these arguments, the script making its own process group. The processes are the
    forkserver's, torch already imported: seconds a process less than a torchrun launch. Fails as `run_ddp`."""
    for attempt in range(3):
        # A free port, let go so that rank 0's store can take it: another process may take it first, which rank 0
        # reports at once (its store cannot listen), and the launch starts again on another port.
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        try:
            _gather(
                lambda rank, workdir: (program, args, rank, world_size, port, workdir), _program, world_size, timeout
            )
            return
        except RuntimeError as failed:
            if attempt == 2 or "EADDRINUSE" not in str(failed) and "address already in use" not in str(failed):
                raise


def _program(program: str, args: tuple[str, ...], rank: int, world_size: int, port: int, workdir: str) -> None:
    import runpy

    import torch.distributed as dist

    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )

    def job() -> None:
        try:
            if program == "-m":
                sys.argv = [args[0], *args[1:]]
                runpy.run_module(args[0], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [program, *args]
                runpy.run_path(program, run_name="__main__")
        except SystemExit as done:
            if done.code not in (None, 0):
                raise
        finally:
            gc.collect()
            if dist.is_initialized():  # a script that left its group
                dist.destroy_process_group()

    _report(job, rank, workdir)


def _gather(
    arguments: Callable[[int, str], tuple[Any, ...]], target: Callable[..., None], world_size: int, timeout: float
) -> list[Any]:
    """`target(*arguments(rank, workdir))` on `world_size` forkserver processes; each rank's value (`_report`)."""
    context = _forkserver()
    workdir = tempfile.mkdtemp(prefix="tokaudit-ddp-")
    processes = [
        context.Process(target=target, args=arguments(rank, workdir), daemon=True) for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        failed = _wait(processes, workdir, timeout)
        results = []
        for rank in range(world_size) if failed is None else [failed]:  # a failed rank raises
            path = Path(workdir) / f"result-{rank}.pkl"
            if not path.exists():
                raise RuntimeError(f"rank {rank} died (exit code {processes[rank].exitcode}) without a result")
            status, value = pickle.loads(path.read_bytes())
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
    finally:
        for process in processes:
            if process.pid is None:
                continue
            if process.is_alive():
                process.kill()
            process.join(5)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait(processes: list[Any], workdir: str, timeout: float) -> int | None:
    """Until every process has ended, or one has reported a failure (its peers would wait in a collective it
    never joins, until their own timeouts): None, or the rank that failed. TimeoutError when they hang."""
    deadline = time.monotonic() + timeout
    read: set[int] = set()
    while any(process.is_alive() for process in processes):
        if time.monotonic() > deadline:
            hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
            raise TimeoutError(f"ranks {hung} still running after {timeout:.0f}s")
        mp.connection.wait([process.sentinel for process in processes if process.is_alive()], timeout=0.2)
        for rank in range(len(processes)):
            path = Path(workdir) / f"result-{rank}.pkl"
            if rank not in read and path.exists():
                read.add(rank)
                if pickle.loads(path.read_bytes())[0] != "ok":
                    return rank
    return None


def torchrun(*args: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    """`torchrun --standalone --nproc-per-node 2 ARGS…` started as a user's shell would (gloo on loopback,
    one thread a process); several may run at once, each being mostly start-up. `finished` waits for them."""
    launcher = Path(sys.executable).with_name("torchrun")
    return subprocess.Popen(
        [str(launcher), "--standalone", "--nproc-per-node", "2", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
    )


def finished(*runs: subprocess.Popen[str], timeout: float = 180) -> None:
    """Wait for each launch; a failed one raises with the end of its stderr, a hung one is killed."""
    for run in runs:
        try:
            _, errors = run.communicate(timeout=timeout)
        finally:
            run.kill()
        assert run.returncode == 0, errors[-3000:]
