"""Google Cloud Storage through a real emulator on 127.0.0.1 (gcp-storage-emulator, started here): a gs:// URL
that carries its endpoint in its query string takes the run id into its path, and a store that does not answer
ends an audit with one line in seconds, as S3's does."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.needs import needs
from tests.s3 import tokaudit

pytestmark = [needs("gcp_storage_emulator", "torch"), pytest.mark.integration]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture()
def gcs() -> Iterator[int]:
    """An in-memory GCS emulator with a bucket `logs`; its port."""
    from gcp_storage_emulator.server import create_server

    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="logs")
    server.start()
    try:
        yield port
    finally:
        server.stop()


def test_a_run_id_joins_the_path_before_the_query_string(gcs: int) -> None:
    import warnings

    from tokaudit.hooks import Recorder

    url = f"gs://anonymous@logs/runs?scheme=http&endpoint_override=127.0.0.1:{gcs}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(url, run_id="exp", flush_every=5, announce=False) as rec:
            assert rec.run_id == "exp"
            for step in range(20):
                rec.record(loss_sum=2.0, valid_tokens=2, backward_scalar=1.0, step=step)
    assert [str(w.message) for w in caught if "tokaudit" in str(w.message)] == []
    done = tokaudit(
        "check", f"gs://anonymous@logs/runs/exp?scheme=http&endpoint_override=127.0.0.1:{gcs}", "--format", "json"
    )
    (run,) = json.loads(done.stdout)["runs"]
    assert (run["run"], run["rows"], run["verdict"]) == ("exp", 20, "correct"), done.stderr


def test_a_gcs_endpoint_that_does_not_answer_is_one_line_in_seconds(tmp_path: Path) -> None:
    start = time.monotonic()
    done = tokaudit(
        "check",
        f"gs://anonymous@logs/runs?scheme=http&endpoint_override=127.0.0.1:{_free_port()}",
        env={"TOKAUDIT_STORAGE_TIMEOUT": "2"},
    )
    took = time.monotonic() - start
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert took < 60, f"{took:.0f} s"
