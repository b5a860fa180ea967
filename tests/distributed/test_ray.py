"""The audit on a real local Ray cluster (a head and 2 worker processes, started and torn down here): the same JSON
as one process, byte for byte, and one line for each way it can fail."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.needs import needs

pytestmark = [pytest.mark.distributed, pytest.mark.slow, needs("ray")]

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def _started() -> Iterator[tuple[str, str]]:
    """A head node on 127.0.0.1 with 2 CPUs (two worker processes), Ray's usage reporting off and its files under a
    temporary folder (short: Ray's sockets live there); its address and folder, then stopped and the folder removed."""
    ray = Path(sys.executable).with_name("ray")
    folder = tempfile.mkdtemp(prefix="tray", dir="/tmp")
    port = _free_port()
    environment = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    started = subprocess.run(
        [
            str(ray),
            "start",
            "--head",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-cpus",
            "2",
            "--temp-dir",
            folder,
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
        ],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert started.returncode == 0, started.stderr
        yield f"127.0.0.1:{port}", folder
    finally:
        subprocess.run([str(ray), "stop", "--force"], env=environment, capture_output=True, timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def running() -> Iterator[tuple[str, str]]:
    """The module's cluster: its address and its folder (the last test stops its head)."""
    with _started() as started:
        yield started


@pytest.fixture
def cluster(running: tuple[str, str]) -> str:
    return running[0]


def _json(paths: list[Path], **kwargs: object) -> str:
    from tokaudit._auditing import audit
    from tokaudit._render.json_report import render_json

    return render_json(audit([str(p) for p in paths], **kwargs))  # type: ignore[arg-type]


def test_the_cluster_s_report_is_the_one_process_s(
    cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sample_logs/ and a bench log cut into several step ranges (planted local means, duplicates), also as a
    Hive-partitioned dataset, each range aggregated on a worker: the same JSON as one process."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from tests.logs import bench_synthetic

    bench = tmp_path / "bench"
    bench_synthetic().write_log(
        bench / "run", ranks=8, steps=600, micro=2, steps_per_file=100, ranks_per_file=4, local_mean_every=2
    )
    shutil.copy(next((bench / "run").glob("*.parquet")), bench / "run" / "zz-copy.parquet")  # repeated keys
    hive = tmp_path / "hive"  # the same records as Spark's partitionBy("rank") leaves them
    ds.write_dataset(
        pq.read_table(bench / "run"),
        hive / "run",
        format="parquet",
        partitioning=["rank"],
        partitioning_flavor="hive",
        max_rows_per_group=1000,
    )
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", "2000")  # several ranges
    for log in (ROOT / "sample_logs", bench, hive):
        assert _json([log], ray=cluster) == _json([log]), log


def test_a_file_whose_data_pages_are_damaged_is_named_and_left_out_as_in_one_process(
    cluster: str, tmp_path: Path
) -> None:
    """Its footer reads, so the workers aggregate it and DuckDB fails there: the audit names the file and audits the
    rest, the same report as one process (once, the whole audit ended in a line that named no file)."""
    import struct

    log = tmp_path / "run"
    shutil.copytree(ROOT / "sample_logs" / "bug_local_mean", log)
    damaged = log / "rank-00001-000000.parquet"
    data = bytearray(damaged.read_bytes())
    footer = struct.unpack("<I", data[-8:-4])[0]
    for at in range(4, len(data) - 8 - footer):  # every data page, the footer kept
        data[at] ^= 0xA5
    damaged.write_bytes(bytes(data))
    here = _json([log], ray=cluster)
    assert here == _json([log]) and f"{damaged}: corrupt data" in here


def test_the_command_line_takes_the_cluster_from_ray_address(cluster: str) -> None:
    from click.testing import CliRunner

    from tokaudit.cli import main

    alone = CliRunner().invoke(main, ["check", str(ROOT / "sample_logs"), "--format", "json"])
    here = CliRunner().invoke(
        main, ["check", str(ROOT / "sample_logs"), "--format", "json", "--ray"], env={"RAY_ADDRESS": cluster}
    )
    assert here.exit_code == alone.exit_code == 1 and here.stdout == alone.stdout


def test_quiet_on_the_cluster_says_nothing_on_stderr(cluster: str) -> None:
    """-q: Ray's C++ core and its Python said of themselves on the process's stderr as it joined (the log level it
    read from the environment, a cluster's token authentication)."""
    command = [sys.executable, "-m", "tokaudit", "check", str(ROOT / "sample_logs"), "-q", "--format", "json"]
    done = subprocess.run([*command, "--ray", cluster], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr == ""


def test_a_worker_that_dies_is_replaced_and_one_that_always_dies_ends_the_audit_in_one_line(
    cluster: str, tmp_path: Path
) -> None:
    """A task whose worker process is killed is run again; a task that kills every worker it gets ends the map
    with one line naming its item, never a partial result."""
    from tokaudit._cluster import Cluster
    from tokaudit.errors import UsageError

    marker = str(tmp_path / "died-once")

    def dies_once(item: int) -> int:  # (a closure: Ray sends it by value)
        if item == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return item * 10

    def always_dies(item: int) -> int:
        if item == 2:
            os._exit(1)
        return item

    connected = Cluster.connect(cluster)
    try:
        assert list(connected.map(dies_once, [1, 2, 3])) == [10, 20, 30] and os.path.exists(marker)
        with pytest.raises(UsageError, match=r"^the Ray task for 2 failed \(.*\); no verdict was made"):
            list(connected.map(always_dies, [1, 2, 3]))
    finally:
        connected.close()


def test_a_node_with_another_tokaudit_is_refused_in_one_line(cluster: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import tokaudit
    from tokaudit._cluster import Cluster
    from tokaudit.errors import UsageError

    # this process says another version; the workers import the installed one
    monkeypatch.setattr(tokaudit, "__version__", "0.0.1")
    with pytest.raises(UsageError, match=r"runs tokaudit .*, this process tokaudit 0\.0\.1"):
        Cluster.connect(cluster)


def test_a_cluster_that_does_not_answer_and_ray_missing_are_one_line_each(tmp_path: Path) -> None:
    env = {**os.environ, "RAY_ADDRESS": ""}
    refused = subprocess.run(
        [sys.executable, "-m", "tokaudit", "check", str(ROOT / "sample_logs"), "--ray", f"127.0.0.1:{_free_port()}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "cannot reach the Ray cluster at 127.0.0.1:" in refused.stderr and "Traceback" not in refused.stderr
    client = subprocess.run(  # a Ray client's address: refused at once too, not after its half-minute timeout
        [sys.executable, "-m", "tokaudit", "check", str(ROOT / "sample_logs"), f"--ray=ray://127.0.0.1:{_free_port()}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=20,
    )
    assert client.returncode == 2 and client.stderr.startswith(
        "tokaudit: error: cannot reach the Ray cluster at ray://"
    )
    assert client.stderr.count("\n") == 1
    # a Python where `import ray` fails
    blocker = tmp_path / "noray"
    (blocker / "ray").mkdir(parents=True)
    (blocker / "ray" / "__init__.py").write_text("raise ImportError('no ray here')\n")
    missing = subprocess.run(
        [sys.executable, "-m", "tokaudit", "check", str(ROOT / "sample_logs"), "--ray"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(blocker)},
        timeout=60,
    )
    assert missing.returncode == 2 and missing.stderr == (
        "tokaudit: error: --ray needs Ray on this machine and the cluster's: pip install ray (or the ray extra: "
        "pip install '.[ray]' in a checkout of tokaudit)\n"
    )


def test_a_path_some_node_cannot_read_is_refused_before_any_work() -> None:
    """The check each node runs (`unreadable`), and the line it gives (the nodes here are this machine, which reads
    every path, so the answer is staged)."""
    from tokaudit._cluster import Cluster, unreadable
    from tokaudit.errors import UsageError

    assert unreadable([__file__, "/no/such/file.parquet"]) == "/no/such/file.parquet" and unreadable([__file__]) == ""

    class Staged(Cluster):
        def __init__(self) -> None:
            self.address = "here"

        def _on_every_node(self, what: str, function: object, *arguments: object) -> list[object]:
            return ["", "/local/run/rank-00000.parquet"]

    with pytest.raises(UsageError, match=r"^/local/run/rank-00000\.parquet: the Ray cluster's workers cannot read it"):
        Staged().check_visible([Path("/local/run/rank-00000.parquet")])


@needs("moto", "boto3")
def test_a_log_on_s3_is_read_by_the_workers_with_the_one_process_s_report(cluster: str) -> None:
    """The workers read the objects themselves (a local S3 server here), with the store this process opened."""
    from tests.s3 import endpoint as s3_endpoint

    with contextlib.contextmanager(s3_endpoint.__wrapped__)():  # type: ignore[attr-defined]
        assert _json(["s3://logs/runs/"], ray=cluster) == _json(["s3://logs/runs/"])  # type: ignore[list-item]


def test_auto_with_no_ray_on_this_machine_names_tokaudit_s_own_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's own remedy names its `--address` flag, which tokaudit has not: the line names --ray ADDRESS instead."""
    import ray

    from tokaudit import audit
    from tokaudit.errors import UsageError

    def absent(**_: object) -> None:
        raise ConnectionError(
            "Could not find any running Ray instance. Please specify the one to connect to by setting `--address` "
            "flag or `RAY_ADDRESS` environment variable."
        )

    monkeypatch.setattr(ray, "init", absent)
    with pytest.raises(UsageError) as refused:
        audit([ROOT / "sample_logs" / "bug_local_mean"], ray="auto")
    assert str(refused.value) == (
        "cannot reach the Ray cluster at auto (no Ray runs on this machine: start one with `ray start --head`, or "
        "give a cluster's address, --ray ADDRESS or RAY_ADDRESS)"
    )


def test_an_address_where_another_server_listens_is_one_line_at_once() -> None:
    """A port where a server that is not Ray listens (a web server): Ray retried it for ever. Refused in one line,
    given as HOST:PORT, as an IPv6 [HOST]:PORT (its brackets were passed to the socket: "Name or service not
    known"), or as RAY_ADDRESS behind a bare --ray."""
    import http.server
    import threading

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_: object) -> None:
            pass

    for host, shown in (("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")):
        server_class = type("Server", (http.server.HTTPServer,), {"address_family": socket.getaddrinfo(host, 0)[0][0]})
        server = server_class((host, 0), Quiet)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            address = f"{shown}:{server.server_address[1]}"
            for args, env in (
                (["--ray", address], {**os.environ, "RAY_ADDRESS": ""}),
                (["--ray"], {**os.environ, "RAY_ADDRESS": address}),
            ):
                result = subprocess.run(
                    [sys.executable, "-m", "tokaudit", "check", str(ROOT / "sample_logs" / "bug_local_mean"), *args],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=60,
                )
                assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
                assert f"{address} answers, but not as Ray does" in result.stderr
        finally:
            server.shutdown()
            server.server_close()


def test_a_file_outside_the_sample_that_the_workers_cannot_read_is_refused_as_the_sample_is(
    cluster: str, tmp_path: Path
) -> None:
    """Each node is asked about 64 of the files before work; the worker that reads a file's footer asks about it
    too. Here one file of 200 is a link through /proc/self/cwd: this process, started in tmp_path, reads it, a worker
    (started elsewhere) does not. Once, the audit went on past it as a damaged file."""
    import random

    from tests.logs import records, token_mean, write_by_rank

    rng = random.Random(5)
    write_by_rank(
        tmp_path / "run",
        records([[[rng.randint(1, 40)] for _ in range(2)] for _ in range(200)], token_mean),
        steps_per_file=2,
    )
    name = "rank-00001-000102.parquet"  # outside the sample: every third file, the first and the last
    (tmp_path / "hidden").mkdir()
    (tmp_path / "run" / name).rename(tmp_path / "hidden" / name)
    (tmp_path / "run" / name).symlink_to(f"/proc/self/cwd/hidden/{name}")
    command = [sys.executable, "-m", "tokaudit", "check", "run", "-q", "--format", "json"]
    alone = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert alone.returncode == 0, alone.stderr
    done = subprocess.run([*command, "--ray", cluster], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == (
        f"tokaudit: error: {tmp_path / 'run' / name}: the Ray cluster's workers cannot read it; give them a folder "
        "they all see or an object-storage URL (s3://, gs://, …)"
    )


def test_an_error_the_cluster_pushes_to_the_driver_is_not_printed_among_the_report(
    cluster: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Ray's driver prints each error the cluster pushes to it (a node marked dead) on stdout, where a JSON report
    goes: joined for an audit, it prints none, and Ray's printer is back after."""
    import ray

    from tokaudit._cluster import Cluster

    pushed = {"lines": ["The node with node id: 7678 has been marked dead"], "pid": "raylet", "is_err": False}
    connected = Cluster.connect(cluster)
    try:
        ray._private.worker.print_to_stdstream(pushed, ignore_prefix=False)
        assert capfd.readouterr().out == ""
    finally:
        connected.close()
    ray._private.worker.print_to_stdstream(pushed, ignore_prefix=False)
    assert "has been marked dead" in capfd.readouterr().out


def test_a_process_that_already_joined_ray_is_told_so_in_one_line(cluster: str) -> None:
    """A notebook or training script that called ray.init itself: Ray's second init said the cluster could not be
    reached, which it can."""
    import ray

    from tokaudit._cluster import Cluster
    from tokaudit.errors import UsageError

    ray.init(address=cluster, log_to_driver=False)
    try:
        with pytest.raises(UsageError, match=r"^Ray is already initialized in this process \(ray\.init\)"):
            Cluster.connect(cluster)
    finally:
        ray.shutdown()
    Cluster.connect(cluster).close()


def test_a_node_that_dies_as_a_node_is_asked_ends_the_audit_in_one_line() -> None:
    """The raylet dying while every node is asked something (Ray's LocalRayletDiedError; once, an internal error)."""
    from tokaudit._cluster import Cluster
    from tokaudit.errors import UsageError

    class Died(Exception):
        pass

    class Ray:
        def remote(self, function: object) -> object:
            return function

        def nodes(self) -> list[object]:
            raise Died("The task's local raylet died. Check raylet.out for more information.")

    class Staged(Cluster):
        def __init__(self) -> None:
            self.address, self.ray = "here", Ray()

    with pytest.raises(UsageError, match=r"^the Ray task for the versions on every node failed \(The task's local"):
        Staged()._check_versions()


HEAD_SCRIPT = """
import os, signal, sys
address, log, how, head = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if how == "frozen":  # once joined
    import tokaudit._cluster as cluster
    joined = cluster.Cluster.connect(address)
    cluster.Cluster.connect = classmethod(lambda cls, address: joined)
    os.kill(head, signal.SIGSTOP)
else:  # inside ray.init, as Ray builds this process's view of the node
    import ray._private.node as node
    class Node(node.Node):
        def __init__(self, *args, **kwargs):
            os.kill(head, signal.SIGKILL)
            super().__init__(*args, **kwargs)
    node.Node = Node
sys.argv = ["tokaudit", "check", log, "--format", "json", "--ray", address]
from tokaudit.cli import run
run()
"""


# Last: the second case stops the module's cluster.
@pytest.mark.parametrize("how, said", [("frozen", "no answer within a second"), ("killed", "Connection refused")])
def test_a_cluster_whose_head_stops_answering_ends_the_audit_in_one_line_and_exit_2(
    running: tuple[str, str], tmp_path: Path, how: str, said: str
) -> None:
    """Ray waits for a head (GCS) that died for a minute, blocked, then ends the process in exit 1, which means
    findings; a head that froze (SIGSTOP), or one killed while Ray joins the cluster, it waits for for ever. The audit
    says it in one line and exit 2 (here after half of a 10-second Ray wait), with nothing on stdout."""
    address, folder = running
    (script := tmp_path / "head.py").write_text(HEAD_SCRIPT)
    head = subprocess.run(["pgrep", "-f", f"gcs_server.*{folder}"], capture_output=True, text=True).stdout.split()
    assert len(head) == 1
    try:
        done = subprocess.run(
            [sys.executable, str(script), address, str(ROOT / "sample_logs"), how, head[0]],
            capture_output=True,
            text=True,
            env={**os.environ, "RAY_gcs_rpc_server_reconnect_timeout_s": "10"},
            timeout=120,
        )
    finally:
        if how == "frozen":
            os.kill(int(head[0]), 18)  # SIGCONT: the cluster goes on for the next case
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert re.fullmatch(
        rf"tokaudit: error: the Ray cluster at {address} stopped answering mid-audit \(its head, [0-9.]+:"
        rf"{address.split(':')[1]}: {said}\); no verdict was made from a part of the log\n",
        done.stderr,
    ), done.stderr
