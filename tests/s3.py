"""A real S3-compatible server on localhost (moto's server mode) for the object storage tests, and the
`tokaudit` command they run against it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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
    return subprocess.run([sys.executable, "-m", "tokaudit", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


