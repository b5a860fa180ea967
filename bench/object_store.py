"""`tokaudit check` of many small objects on an S3 server (moto's, in its own process) next to the same log on
local disk and to the requests alone: `python bench/object_store.py [--objects 2000] [--repeat 2]`.

The requests alone are one ranged GET of each object's tail, 16 at a time, through pyarrow's S3 client
(`make_fragment` with the listed size: no HEAD), which is what the audit needs of an object whose record its
footer gives. Against moto they measure the server: it is Python on the same two cores.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from synthetic import write_log  # noqa: E402


def start_server() -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, env
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit("moto server did not start")


def requests_alone(env: dict[str, str]) -> float:
    """Seconds for one ranged GET of every object's footer, 16 at a time, and nothing else."""
    import pyarrow.dataset as pads
    import pyarrow.fs as pafs

    filesystem = pafs.S3FileSystem(
        region=env["AWS_REGION"],
        endpoint_override=env["AWS_ENDPOINT_URL"],
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    start = time.perf_counter()
    listed = filesystem.get_file_info(pafs.FileSelector("logs/runs", recursive=True))
    files = [info for info in listed if info.type == pafs.FileType.File]

    def footer(info: pafs.FileInfo) -> None:
        pads.ParquetFileFormat().make_fragment(info.path, filesystem, file_size=info.size).ensure_complete_metadata()

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(footer, files))
    return time.perf_counter() - start


def check(target: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tokaudit", "check", target, "--format", "json"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    if done.returncode not in (0, 1):
        raise SystemExit(done.stderr)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=2000, help="one-row shards, 8 ranks a step")
    parser.add_argument("--repeat", type=int, default=2, help="alternated runs (the best time counts)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder)
        write_log(log, ranks=8, steps=max(1, args.objects // 8), micro=1, steps_per_file=1, ranks_per_file=1)
        server, env = start_server()
        try:
            import boto3

            client = boto3.client(
                "s3",
                endpoint_url=env["AWS_ENDPOINT_URL"],
                region_name=env["AWS_REGION"],
                aws_access_key_id="bench",
                aws_secret_access_key="bench",
            )
            client.create_bucket(Bucket="logs")
            for shard in sorted(log.rglob("*.parquet")):
                client.upload_file(str(shard), "logs", f"runs/{shard.relative_to(log)}")
            times: dict[str, list[float]] = {"requests alone": [], "check s3://": [], "check, local copy": []}
            for _ in range(args.repeat):
                times["requests alone"].append(requests_alone(env))
                times["check s3://"].append(check("s3://logs/runs/", env))
                times["check, local copy"].append(check(str(log), {}))
        finally:
            server.terminate()
    print(f"| {8 * max(1, args.objects // 8)} one-row objects | best | runs |\n|---|---|---|")
    for label, runs in times.items():
        print(f"| {label} | {min(runs):.2f} s | {', '.join(f'{t:.2f}' for t in runs)} |")


if __name__ == "__main__":
    main()
