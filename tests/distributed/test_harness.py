"""The harness every distributed test runs on: a rank that fails ends its job at once (its peer, waiting in a
collective the failed rank never joins, would otherwise hold the suite for gloo's timeout), and a launch whose
port another process took starts again on another."""

from __future__ import annotations

import socket
import time
import types
from pathlib import Path
from typing import Any

import pytest

from scenarios import harness

pytestmark = pytest.mark.distributed


def _one_rank_fails(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        raise ValueError("rank 0 gave up")
    dist.barrier()  # waits for a rank that will never come


def test_a_failed_rank_ends_the_job_without_waiting_for_its_peers() -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed:(.|\n)*rank 0 gave up"):
        harness.run_ddp(_one_rank_fails, 2)
    assert time.monotonic() - started < harness.GLOO_TIMEOUT_S / 2


SCRIPT = """
import torch.distributed as dist

dist.init_process_group("gloo")  # torchrun's environment: rank 0 serves the store on MASTER_PORT
dist.barrier()
dist.destroy_process_group()
"""


def test_a_launch_whose_port_was_taken_starts_again_on_another(tmp_path: Path, monkeypatch: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    offered: list[int] = []

    class FirstPortTaken:
        """socket.socket for the port search: the first port it finds is the one another process holds."""

        def __init__(self) -> None:
            self.inner = socket.socket()

        def __enter__(self) -> FirstPortTaken:
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.close()

        def bind(self, address: tuple[str, int]) -> None:
            self.inner.bind(address)

        def getsockname(self) -> tuple[str, int]:
            port = taken_port if not offered else self.inner.getsockname()[1]
            offered.append(port)
            return ("127.0.0.1", port)

    monkeypatch.setattr(harness, "socket", types.SimpleNamespace(socket=FirstPortTaken))
    try:
        harness.launch(str(script), world_size=2, timeout=60)
    finally:
        taken.close()
    assert offered[0] == taken_port and len(offered) == 2 and offered[1] != taken_port
