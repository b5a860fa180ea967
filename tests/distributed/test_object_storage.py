"""The Recorder writes a real 2-process DDP run straight to object storage (a moto S3 server on localhost),
and a resumed writer of the same rank takes the next free name."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration  # a real S3-compatible server in this process

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")

from tests.s3 import endpoint  # noqa: E402,F401


def recorded_job(rank: int, world_size: int, env: dict[str, str], log_dir: str) -> dict[str, Any]:
    """A real DDP scenario recorded straight to `log_dir` (local or s3://)."""
    os.environ.update(env)  # the forkserver may predate the test's environment
    from scenarios.strategies import SCENARIOS, run_scenario

    scenario = next(s for s in SCENARIOS if s.name == "bug_local_mean")
    return run_scenario(rank, world_size, scenario, log_dir)


@pytest.mark.distributed
def test_the_recorder_writes_to_s3_from_a_ddp_run(endpoint: dict[str, str], tmp_path: Path) -> None:
    from scenarios.harness import run_ddp
    from tokaudit._auditing import audit

    boto3.client("s3").create_bucket(Bucket="written")
    run_ddp(recorded_job, 2, endpoint, "s3://written/runs")
    run_ddp(recorded_job, 2, endpoint, str(tmp_path))
    keys = sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="written")["Contents"])
    assert keys == ["runs/bug_local_mean/rank-00000-000000.parquet", "runs/bug_local_mean/rank-00001-000000.parquet"]
    remote, local = audit(["s3://written/runs"]), audit([tmp_path])
    assert (
        [f.code.value for f in remote.findings]
        == [f.code.value for f in local.findings]
        == ["local_mean", "reported_loss_mismatch"]
    )
    assert [r.verdict for r in remote.runs] == ["incorrect"]
    # A resumed writer of the same rank takes the next free name instead of replacing a shard.
    run_ddp(recorded_job, 2, endpoint, "s3://written/runs")
    keys = sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="written")["Contents"])
    assert keys[-2:] == [
        "runs/bug_local_mean/rank-00001-000000.parquet",
        "runs/bug_local_mean/rank-00001-000001.parquet",
    ]
