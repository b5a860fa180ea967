"""Logs on object storage, against a real S3-compatible server on localhost (moto's server mode):
`tokaudit check s3://…` gives the same report as the local copy, a recorder's shards reach the store
or wait for it, and what cannot be read is one exit-2 line. (The Recorder writing from a real DDP run:
tests/distributed/test_object_storage.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration  # a real S3-compatible server in this process

moto_server = pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

from tests.s3 import CREDENTIALS, RecordingProxy, RUNS, SAMPLE_LOGS, endpoint, tokaudit  # noqa: E402,F401


def test_an_s3_log_gives_the_report_of_its_local_copy(endpoint: dict[str, str]) -> None:
    remote = tokaudit("check", "s3://logs/runs/", "--format", "json", env=endpoint)
    local = tokaudit("check", *(str(SAMPLE_LOGS / run) for run in RUNS), "--format", "json")
    assert remote.returncode == local.returncode == 1, remote.stderr
    remote_report, local_report = json.loads(remote.stdout), json.loads(local.stdout)
    assert remote_report == local_report
    assert {run["run"] for run in remote_report["runs"]} == set(RUNS)


def test_a_relaunch_on_s3_judges_the_copies_left_out_as_its_local_copy_does(
    endpoint: dict[str, str], tmp_path: Path
) -> None:
    """A rank-local mean, then a right replay of its steps uploaded later (another writer's files, no launch in their
    footers): the copies left out are read from the store and judged alone, inconclusive as on disk (it read correct:
    only local files were judged again)."""
    from tests.logs import UNEVEN_GA, local_mean, records, token_mean, write

    client = boto3.client("s3")
    for launch, mean in enumerate((local_mean, token_mean)):
        path = write(tmp_path / "relaunch" / f"all-{launch}.parquet", records(UNEVEN_GA * 2, mean))
        os.utime(path, ns=((1_700_000_000 + 60 * launch) * 1_000_000_000,) * 2)
        client.upload_file(str(path), "logs", f"relaunch/run/{path.name}")
        time.sleep(1.1)  # (the store's modification times are whole seconds)
    remote = tokaudit("check", "s3://logs/relaunch/run", "--format", "json", env=endpoint)
    local = tokaudit("check", str(tmp_path / "relaunch"), "--format", "json")
    verdicts = [json.loads(report.stdout)["runs"][0]["verdict"] for report in (remote, local)]
    assert verdicts == ["inconclusive", "inconclusive"], remote.stderr


def test_weights_and_curve_read_from_s3(endpoint: dict[str, str]) -> None:
    remote = tokaudit("weights", "s3://logs/runs/bug_local_mean", "--step", "1", env=endpoint)
    local = tokaudit("weights", str(SAMPLE_LOGS / "bug_local_mean"), "--step", "1")
    assert remote.returncode == local.returncode == 0 and remote.stdout == local.stdout


def test_a_hive_partitioned_log_on_s3_gives_the_report_of_its_local_copy(
    endpoint: dict[str, str], tmp_path: Path
) -> None:
    """Spark's partitionBy("rank") on object storage: `rank=0/` prefixes whose objects lack the column."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    client = boto3.client("s3")
    client.create_bucket(Bucket="hive")
    local = tmp_path / "bug_local_mean"
    table = pq.read_table(SAMPLE_LOGS / "bug_local_mean").replace_schema_metadata(None)
    ds.write_dataset(table, local, format="parquet", partitioning=["rank"], partitioning_flavor="hive")
    for path in sorted(local.rglob("*.parquet")):
        client.upload_file(str(path), "hive", f"runs/{path.relative_to(tmp_path)}")
    remote = tokaudit("check", "s3://hive/runs/", "--format", "json", env=endpoint)
    here = tokaudit("check", str(local), "--format", "json")
    assert remote.returncode == here.returncode == 1, remote.stderr
    assert json.loads(remote.stdout) == json.loads(here.stdout)
    assert [(run["run"], run["ranks"]) for run in json.loads(remote.stdout)["runs"]] == [("bug_local_mean", 2)]


def test_a_delta_table_on_s3_is_audited_at_its_current_version(endpoint: dict[str, str], tmp_path: Path) -> None:
    """A Delta table uploaded whole (its log and every file a rewrite left): the report of its local copy, the files
    it no longer holds skipped and said."""
    pytest.importorskip("deltalake")
    from tests.auditor.test_delta import _history

    _history(tmp_path / "run")
    client = boto3.client("s3")
    client.create_bucket(Bucket="delta")
    for path in sorted((tmp_path / "run").rglob("*")):
        if path.is_file():
            client.upload_file(str(path), "delta", f"runs/{path.relative_to(tmp_path)}")
    remote = tokaudit("check", "s3://delta/runs", "--format", "json", env=endpoint)
    local = tokaudit("check", str(tmp_path), "--format", "json")
    assert remote.returncode == local.returncode == 0, remote.stderr
    assert json.loads(remote.stdout) == json.loads(local.stdout)
    assert remote.stderr.splitlines()[0].startswith(
        "tokaudit: note: s3://delta/runs/run: a Delta table at version 3: 6 Parquet file(s) it no longer holds"
    )
    inside = tokaudit("check", "s3://delta/runs/run/rank=1/", "--format", "json", env=endpoint)  # a prefix in it
    assert inside.returncode == 0 and json.loads(inside.stdout)["files"] == 1, inside.stderr


def test_an_iceberg_table_and_a_file_a_delta_table_lost_on_s3_are_one_line_each(endpoint: dict[str, str]) -> None:
    """An Iceberg table (metadata/*.metadata.json beside data/) is refused, none of its files read; a Delta table
    uploaded without one of its files names that file; a plain run beside them is audited."""
    client = boto3.client("s3")
    client.create_bucket(Bucket="tables")
    shards = sorted((SAMPLE_LOGS / "bug_local_mean").glob("*.parquet"))
    for shard in shards:
        client.upload_file(str(shard), "tables", f"runs/plain/{shard.name}")
        client.upload_file(str(shard), "tables", f"runs/ice/data/{shard.name}")
    client.put_object(Bucket="tables", Key="runs/ice/metadata/00001-a.metadata.json", Body=b"{}")
    client.upload_file(str(shards[0]), "tables", "runs/lake/a.parquet")
    adds = "".join(json.dumps({"add": {"path": f"{name}.parquet", "partitionValues": {}}}) + "\n" for name in "ab")
    client.put_object(Bucket="tables", Key=f"runs/lake/_delta_log/{0:020d}.json", Body=adds.encode())
    done = tokaudit("check", "s3://tables/runs", "--format", "json", env=endpoint)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("tokaudit: error:")]
    assert errors == [
        "tokaudit: error: s3://tables/runs/ice: an Iceberg table (its metadata/ says which of the files under it the "
        "table holds now), which tokaudit does not read: export it as Parquet (spark.table(...).write.parquet(...))",
        "tokaudit: error: s3://tables/runs/lake/b.parquet: a file the Delta table holds at version 0 (its log says "
        "so), not there: a partial copy of the table?",
    ]
    runs = sorted(run["run"] for run in json.loads(done.stdout)["runs"])  # one run id in two folders: named apart
    assert runs == ["s3://tables/runs/lake:bug_local_mean", "s3://tables/runs/plain:bug_local_mean"]


def test_a_writer_s_own_prefixes_on_s3_are_skipped_and_said(endpoint: dict[str, str]) -> None:
    """`_temporary/` and `_spark_metadata/` under a run on object storage are skipped as on disk, in one note; a folder
    whose name begins with '.' and holds Parquet files, in one of its own."""
    client = boto3.client("s3")
    client.create_bucket(Bucket="spark")
    for shard in sorted((SAMPLE_LOGS / "bug_local_mean").glob("*.parquet")):
        client.upload_file(str(shard), "spark", f"runs/bug_local_mean/{shard.name}")
    client.put_object(Bucket="spark", Key="runs/bug_local_mean/_temporary/0/part-0.parquet", Body=b"not parquet")
    client.put_object(Bucket="spark", Key="runs/bug_local_mean/_spark_metadata/0", Body=b"{}")
    client.put_object(Bucket="spark", Key="runs/bug_local_mean/_SUCCESS", Body=b"")
    client.put_object(Bucket="spark", Key="runs/.staging/run/part-0.parquet", Body=b"not parquet")  # said, not read
    remote = tokaudit("check", "s3://spark/runs", "--format", "json", env=endpoint)
    local = tokaudit("check", str(SAMPLE_LOGS / "bug_local_mean"), "--format", "json")
    assert remote.returncode == local.returncode == 1, remote.stderr
    assert json.loads(remote.stdout) == json.loads(local.stdout)
    assert remote.stderr.splitlines() == [
        "tokaudit: note: s3://spark/runs: 2 folder(s) a writer keeps beside its data skipped (Spark's _temporary of "
        "uncommitted tasks, a streaming sink's _spark_metadata, whose list of committed files is not read: every part "
        "file beside it is), as pyarrow skips them",
        "tokaudit: note: s3://spark/runs/.staging: a folder whose name begins with '.' is skipped (writers stage files "
        "there), and it holds Parquet files: give it as a path to audit them",
    ]


def test_a_key_with_a_space_or_unicode_is_read_as_written_and_one_with_a_query_is_told_how(
    endpoint: dict[str, str],
) -> None:
    """Keys hold any character: a space or `ünï ✓` given as written (pyarrow parses a URI, which holds neither) is read
    as its local copy is (it read 'Install s3fs to access S3'); a '?' reads as a query string, and the line says how
    to write it."""
    client = boto3.client("s3")
    client.create_bucket(Bucket="odd")
    for prefix in ("sp ace", "ünï ✓", "q?x", "br[1]"):
        for shard in sorted((SAMPLE_LOGS / "bug_local_mean").glob("*.parquet")):
            client.upload_file(str(shard), "odd", f"{prefix}/bug_local_mean/{shard.name}")
    local = tokaudit("check", str(SAMPLE_LOGS / "bug_local_mean"), "--format", "json")
    for prefix in ("sp ace", "ünï ✓", "q%3Fx", "br[1]"):
        remote = tokaudit("check", f"s3://odd/{prefix}/", "--format", "json", env=endpoint)
        assert remote.returncode == local.returncode == 1, remote.stderr
        assert json.loads(remote.stdout) == json.loads(local.stdout)
    query = tokaudit("check", "s3://odd/q?x/", env=endpoint)
    assert query.returncode == 2 and query.stderr.count("\n") == 1, query.stderr
    assert query.stderr.endswith("a key's '?', '#' and '%' are written %3F, %23 and %25\n"), query.stderr
    # a '#' would cut the key short: pyarrow read s3://odd/q/, another folder, without a word
    fragment = tokaudit("check", "s3://odd/q#x/", env=endpoint)
    assert fragment.returncode == 2 and fragment.stdout == "", fragment.stderr
    assert fragment.stderr == (
        "tokaudit: error: s3://odd/q#x/: a URL's '#' begins a fragment, which object storage has none of: write a "
        "key's '#' %23\n"
    )


def test_an_object_removed_while_the_audit_reads_is_said_gone_and_the_others_are_audited(
    endpoint: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As on disk: a late step range's object deleted once the audit has listed the log (as the first range starts)
    is named as gone and the other ranges audited (it was a traceback from the library, and from the command an
    "output:" line that audited nothing)."""
    from tests.logs import UNEVEN_GA, records, token_mean, write
    from tokaudit import audit

    client = boto3.client("s3")
    client.create_bucket(Bucket="gone")
    rows = records(UNEVEN_GA * 10, token_mean)
    for first in range(0, 30, 3):
        path = write(tmp_path / f"rank-all-{first:06d}.parquet", [r for r in rows if first <= r["step"] < first + 3])
        client.upload_file(str(path), "gone", f"run/{path.name}")
    for name, value in endpoint.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", "24")
    monkeypatch.setattr("tokaudit._opening.PROGRESS_ROWS", 0)  # progress said of a log this small
    report = audit(["s3://gone/run/"], progress=lambda *_: client.delete_object(Bucket="gone", Key=LATE))
    assert report.runs[0].steps == 27
    assert f"s3://gone/{LATE}: gone: removed or renamed since the audit listed it" in report.problems, report.problems


LATE = "run/rank-all-000024.parquet"


def test_a_damaged_object_is_one_line_and_the_others_are_audited(endpoint: dict[str, str]) -> None:
    client = boto3.client("s3")
    client.create_bucket(Bucket="damaged")
    shard = sorted((SAMPLE_LOGS / "bug_local_mean").glob("*.parquet"))[0]
    client.upload_file(str(shard), "damaged", "runs/bug_local_mean/rank-00000-000000.parquet")
    client.put_object(
        Bucket="damaged", Key="runs/bug_local_mean/rank-00001-000000.parquet", Body=shard.read_bytes()[:200]
    )  # truncated
    done = tokaudit("check", "s3://damaged/runs", "--format", "json", env=endpoint)
    assert done.returncode == 2
    assert "s3://damaged/runs/bug_local_mean/rank-00001-000000.parquet: not a readable Parquet file" in done.stderr
    assert json.loads(done.stdout)["files"] == 1
    assert "Traceback" not in done.stderr


def test_a_missing_bucket_and_an_unreachable_endpoint_are_one_line(endpoint: dict[str, str]) -> None:
    missing = tokaudit("check", "s3://no-such-bucket/runs", env=endpoint)
    assert missing.returncode == 2
    assert (
        missing.stderr.strip().splitlines()[-1] == "tokaudit: error: s3://no-such-bucket/runs: no such bucket "
        "'no-such-bucket'"
    )
    unreachable = tokaudit("check", "s3://logs/runs", env={**endpoint, "AWS_ENDPOINT_URL": "http://127.0.0.1:1"})
    assert unreachable.returncode == 2 and "Traceback" not in unreachable.stderr
    assert "s3://logs/runs: cannot reach the storage endpoint" in unreachable.stderr


def test_denied_access_is_one_line(tmp_path: Path) -> None:
    """A server that checks credentials (moto with authentication on) and a key it does not know."""
    server, port = _authenticating_server(tmp_path)
    try:
        denied = tokaudit(
            "check", "s3://logs/runs", env={**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
        )
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert denied.returncode == 2 and "Traceback" not in denied.stderr
    assert "tokaudit: error: s3://logs/runs: access denied" in denied.stderr


def _authenticating_server(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A moto server in a process of its own, with authentication on, and its port. The port is found free
    and then given to the server, so another process may take it in between: a server that exits before it
    listens is started again on another port, up to three times."""
    for attempt in range(3):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        log = tmp_path / f"moto-{attempt}.log"
        with open(log, "wb") as out:
            server = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60  # its imports take seconds on a loaded machine
        while server.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return server, port
            except OSError:
                time.sleep(0.1)
        server.kill()
        server.wait(timeout=10)
    raise AssertionError(f"moto server did not start: {log.read_text(errors='replace')[-2000:]}")


def _soon(condition: Any, seconds: float = 20.0) -> bool:
    """Whether `condition()` holds within `seconds` (the uploader thread acts on its own time)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_unreachable_store_is_retried_after_a_pause_and_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed upload costs seconds of SDK retries: the uploader thread keeps the records instead of trying
    again at each flush; close() tries once more, and what it writes is every record."""
    import warnings

    import torch

    import tokaudit.hooks._output as output_module
    import tokaudit.hooks._uploads as uploads
    from tokaudit.hooks import Recorder
    from tests.logs import read_rows

    from tokaudit.hooks._shards import ShardWriter

    attempts: list[str] = []
    reachable = {"now": False}

    class Flaky:
        """The store's writer: unreachable at first, then writing (to a local folder standing in for it)."""

        def __init__(self, url: str, prefix: str) -> None:
            attempts.append(url)
            if not reachable["now"]:
                raise OSError("AWS Error NETWORK_CONNECTION: Could not connect to server")
            self.inner = ShardWriter(tmp_path / "flaky", prefix)
            self.sequence = self.inner.sequence  # the next shard's number, as StoreShardWriter's

        def write(self, table: Any, metadata: Any = None) -> str:
            return self.inner.write(table, metadata)

    monkeypatch.setattr(output_module, "StoreShardWriter", Flaky)
    monkeypatch.setattr(uploads, "STORE_RETRY_S", 3600.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = Recorder("s3://bucket/runs", run_id="flaky", flush_every=1)
        for step in range(3):
            rec.record(loss_sum=torch.tensor(2.0), valid_tokens=2, backward_scalar=torch.tensor(1.0), step=step)
            rec.flush()
            assert _soon(lambda: any("could not write a shard" in str(w.message) for w in caught))
        assert len(attempts) == 1, "one failed attempt, then the records wait"
        reachable["now"] = True
        rec.close()
    assert len(attempts) == 2
    assert [row["step"] for row in read_rows(tmp_path / "flaky")] == [0, 1, 2]
    assert not [w for w in caught if "could not be written" in str(w.message)]


def test_a_frozen_store_never_stalls_training_and_close_spools_what_it_could_not_write(
    monkeypatch: pytest.MonkeyPatch, endpoint: dict[str, str], tmp_path: Path
) -> None:
    """An endpoint that accepts connections and never answers (a frozen store): every step returns at once,
    since uploads run in their own thread; close() gives up within the storage timeout's bound, keeps every record
    in the local spool and says so in one warning; `tokaudit sync`, once the store answers, writes them there and
    the audit of the store sees every record."""
    import warnings

    import torch

    from tokaudit.hooks import Recorder

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # accepted by the kernel, never read nor answered
    monkeypatch.setenv("TOKAUDIT_SPOOL", str(tmp_path / "spool"))
    try:
        for key, value in {
            **CREDENTIALS,
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{hole.getsockname()[1]}",
            "TOKAUDIT_STORAGE_TIMEOUT": "1",
        }.items():
            monkeypatch.setenv(key, value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rec = Recorder("s3://frozen/runs", run_id="stalled", flush_every=2)
            slowest = 0.0
            for step in range(20):
                start = time.monotonic()
                rec.record(loss_sum=torch.tensor(2.0), valid_tokens=2, backward_scalar=torch.tensor(1.0), step=step)
                slowest = max(slowest, time.monotonic() - start)
            start = time.monotonic()
            rec.close()
            closing = time.monotonic() - start
        assert slowest < 0.5, f"a step waited {slowest:.1f} s on storage"
        assert closing < 30, f"close() took {closing:.0f} s"
        kept = [str(w.message) for w in caught if "could not be written" in str(w.message)]
        assert len(kept) == 1 and "s3://frozen/runs/stalled" in kept[0] and "20 record(s)" in kept[0], kept
        assert "steps 0–19" in kept[0] and "they are kept in" in kept[0] and "tokaudit sync" in kept[0], kept[0]
    finally:
        hole.close()
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint["AWS_ENDPOINT_URL"])  # the store answers again
    boto3.client("s3").create_bucket(Bucket="frozen")
    done = tokaudit("sync")
    assert done.returncode == 0 and "wrote s3://frozen/runs/stalled/rank-00000-spooled-" in done.stderr, done.stderr
    assert not list((tmp_path / "spool").rglob("*.parquet"))  # written, so gone from the spool
    audited = tokaudit("check", "s3://frozen/runs/stalled", "--format", "json")
    (run,) = json.loads(audited.stdout)["runs"]
    assert run["rows"] == 20 and run["steps"] == 20


def test_one_row_shards_on_s3_are_read_from_their_footers_with_the_local_report(
    endpoint: dict[str, str], tmp_path: Path
) -> None:
    """A recorder that flushes every record leaves one-row shards: their records come from the footers
    already fetched to validate them (`Shard.record`), with no second request per object, and the report
    and a step's weights are the local copy's."""
    import pyarrow.parquet as pq

    local = tmp_path / "bug_local_mean"
    local.mkdir()
    client = boto3.client("s3")
    for shard in sorted((SAMPLE_LOGS / "bug_local_mean").glob("*.parquet")):
        table = pq.read_table(shard)
        for row in range(table.num_rows):
            name = f"{shard.stem}-{row:04d}.parquet"
            pq.write_table(table.slice(row, 1), local / name)
            client.upload_file(str(local / name), "logs", f"one-row/bug_local_mean/{name}")
    from tokaudit._loading import load

    assert all(s.record is not None for s in load([local]).shards)
    from tokaudit._engine import Engine

    remote_shards = load(["s3://logs/one-row/"]).shards
    engine = Engine.open(remote_shards)
    assert len(remote_shards) == 6 and engine.remote_views == {}, "no dataset opened on an object"
    engine.close()
    host, port = endpoint["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
    proxy = RecordingProxy(host, int(port))
    try:
        remote = tokaudit(
            "check",
            "s3://logs/one-row/",
            "--format",
            "json",
            env={**endpoint, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"},
        )
    finally:
        proxy.close()
    # the listing, then a ranged GET of each object: its size is the listing's, so no object is asked for it
    # (a HEAD each); its record is its footer's, so no second read (no dataset, above)
    objects = {path for method, path in proxy.requests if path.endswith(".parquet")}
    assert len(objects) == len(remote_shards), proxy.requests
    assert {method for method, path in proxy.requests if path.endswith(".parquet")} == {"GET"}, proxy.requests
    here = tokaudit("check", str(local), "--format", "json")
    assert remote.returncode == here.returncode == 1, remote.stderr
    whole = json.loads(tokaudit("check", str(SAMPLE_LOGS / "bug_local_mean"), "--format", "json").stdout)
    assert json.loads(remote.stdout) == json.loads(here.stdout) == dict(whole, files=len(list(local.iterdir())))
    remote = tokaudit("weights", "s3://logs/one-row/bug_local_mean", "--step", "1", env=endpoint)
    here = tokaudit("weights", str(local), "--step", "1")
    assert remote.returncode == here.returncode == 0 and remote.stdout == here.stdout


def test_a_run_id_that_would_leave_the_prefix_stays_inside_it_on_s3(endpoint: dict[str, str]) -> None:
    """The same rule as on a local folder: `../../escaped` under s3://logs/hostile writes inside the prefix."""
    from tokaudit.hooks import Recorder

    with pytest.warns(RuntimeWarning, match="would leave log_dir"):
        with Recorder("s3://logs/hostile", run_id="../../escaped", flush_every=1) as rec:
            for step in range(2):
                rec.record(loss_sum=2.0, valid_tokens=2, backward_scalar=1.0, step=step)
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="logs")["Contents"]]
    written = [key for key in keys if "escaped" in key]  # (other tests share the bucket)
    assert written and all(key.startswith("hostile/escaped/") for key in written), written


def test_an_endpoint_that_goes_away_during_the_audit_ends_it_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store is listed, then stops before the footers are read (300 objects): one line naming the endpoint,
    exit 2, within seconds, not every object paying the SDK's retries in turn."""
    import boto3
    from click.testing import CliRunner
    from moto.server import ThreadedMotoServer

    import tokaudit._loading as loading
    from tokaudit.cli import main

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for key, value in {
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "TOKAUDIT_STORAGE_TIMEOUT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    client = boto3.client("s3")
    client.create_bucket(Bucket="going")
    shard = sorted((SAMPLE_LOGS / "bug_local_mean").glob("*.parquet"))[0].read_bytes()
    for index in range(300):
        client.put_object(Bucket="going", Key=f"runs/run{index // 2}/rank-{index % 2:05d}-000000.parquet", Body=shard)
    listed = loading.start_loading

    def then_stopped(*args: Any, **kwargs: Any) -> Any:
        found = listed(*args, **kwargs)
        server.stop()  # listed; every footer is still to be read
        return found

    monkeypatch.setattr(loading, "start_loading", then_stopped)
    start = time.monotonic()
    result = CliRunner().invoke(main, ["check", "s3://going/runs", "--format", "json"])
    took = time.monotonic() - start
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("tokaudit: error:")]
    assert len(lines) == 1 and "cannot reach the storage endpoint" in lines[0], result.stderr
    assert took < 20, f"{took:.0f} s"
    assert "Traceback" not in result.output


class HoldingProxy(RecordingProxy):
    """A relay in front of the S3 server that, while `hold` is set, keeps for `seconds` its answer to the request
    that completes a multipart upload (a POST after the parts' PUTs): the server has stored the object, the client
    times out, as behind a store that hangs in its answer."""

    def __init__(self, host: str, port: int, seconds: float) -> None:
        super().__init__(host, port)
        self.hold, self.seconds = True, seconds
        self.uploads = 0

    def _relay(self, source: Any, sink: Any, requests: bool) -> None:
        if requests:
            super()._relay(source, sink, requests)
            return
        try:
            while data := source.recv(65536):
                with self.lock:
                    methods = [method for method, _ in self.requests]
                    held = self.hold and methods[-1:] == ["POST"] and "PUT" in methods
                    self.uploads += held
                if held:
                    time.sleep(self.seconds)
                sink.sendall(data)
        except OSError:
            pass


def test_an_upload_stored_after_its_timeout_is_not_published_twice(
    endpoint: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store keeps an upload but its answer comes after the timeouts: the shard is published, the recorder
    sees a failure. At the retry it finds the object under the name it used and writes only what is new: the
    store holds every record once."""
    import warnings

    import boto3
    import torch

    import tokaudit.hooks._uploads as uploads
    from tokaudit.hooks import Recorder

    host, port = endpoint["AWS_ENDPOINT_URL"].rsplit("/", 1)[-1].split(":")
    proxy = HoldingProxy(host, int(port), seconds=15.0)  # past any retry of the SDK: the client gives up first
    boto3.client("s3").create_bucket(Bucket="slow")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("TOKAUDIT_STORAGE_TIMEOUT", "1")
    monkeypatch.setattr(uploads, "STORE_RETRY_S", 3600.0)  # the retry comes with close()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rec = Recorder("s3://slow/runs", run_id="late", flush_every=10, announce=False)
            for step in range(10):
                rec.record(loss_sum=torch.tensor(2.0), valid_tokens=2, backward_scalar=torch.tensor(1.0), step=step)
            assert _soon(lambda: any("could not write a shard" in str(w.message) for w in caught), 30)
            for step in range(10, 20):
                rec.record(loss_sum=torch.tensor(2.0), valid_tokens=2, backward_scalar=torch.tensor(1.0), step=step)
            proxy.hold = False
            rec.close()
        assert proxy.uploads >= 1
        assert not [w for w in caught if "could not be written" in str(w.message)]
    finally:
        proxy.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint["AWS_ENDPOINT_URL"])
    done = tokaudit("check", "s3://slow/runs/late", "--format", "json")
    report = json.loads(done.stdout)
    (run,) = report["runs"]
    assert run["rows"] == 20 and run["steps"] == 20, done.stderr
    assert not [f for f in report["findings"] if f["code"] == "duplicate_records"], report["findings"]
