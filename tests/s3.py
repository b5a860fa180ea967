"""A real S3-compatible server on localhost (moto's server mode) for the object storage tests, and the
`tokaudit` command they run against it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SAMPLE_LOGS = Path(__file__).resolve().parents[1] / "sample_logs"
RUNS = ("bug_local_mean", "correct_token_mean_ga", "amp_told", "bug_global_world_size_on_dp_group")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def endpoint() -> Iterator[dict[str, str]]:
    """A moto S3 server in this process; the environment a user would set to reach it."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket="logs")
        for run in RUNS:
            for shard in sorted((SAMPLE_LOGS / run).glob("*.parquet")):
                client.upload_file(str(shard), "logs", f"runs/{run}/{shard.name}")
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def tokaudit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokaudit", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


class RecordingProxy:
    """A TCP relay in front of an S3 endpoint that keeps the (method, path) of each HTTP request sent through it.
    Only requests without a body are parsed well (GET, HEAD: what an audit sends)."""

    def __init__(self, host: str, port: int) -> None:
        import socket
        import threading

        self.target = (host, port)
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._relay, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._relay, args=(server, client, False), daemon=True).start()

    def _relay(self, source: Any, sink: Any, requests: bool) -> None:
        pending = b""
        try:
            while data := source.recv(65536):
                if requests:
                    pending = self._keep(pending + data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(2)
                except OSError:
                    pass

    def _keep(self, data: bytes) -> bytes:
        """Keeps each complete request head in `data`; gives back what follows the last one."""
        while (end := data.find(b"\r\n\r\n")) >= 0:
            head, data = data[:end], data[end + 4 :]
            method, _, rest = head.split(b"\r\n", 1)[0].decode("ascii", "replace").partition(" ")
            if method.isalpha() and method.isupper():
                with self.lock:
                    self.requests.append((method, rest.rsplit(" ", 1)[0].split("?", 1)[0]))
        return data

    def close(self) -> None:
        self.listener.close()
