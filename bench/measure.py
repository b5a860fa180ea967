"""Run one command in this process and print its wall time and peak RSS as JSON (for bench/run.py)."""

from __future__ import annotations

import json
import resource
import sys
import time


def main() -> None:
    kind, *args = sys.argv[1:]
    start = time.perf_counter()
    if kind in ("check", "check-serial"):
        if kind == "check-serial":  # what the footer workers earn: every footer validated in this process
            import tokaudit._loading

            tokaudit._loading.PARALLEL_FILES = sys.maxsize
        from tokaudit.cli import main as cli

        try:
            cli(["check", *args, "--format", "json", "--output", "/dev/null"])
        except SystemExit as done:
            if done.code not in (0, 1):
                raise
    elif kind == "floor":
        import duckdb

        # The one-query floor: per-step N and the extremes of b/S over the same files, nothing else.
        files = [str(p) for p in sorted(__import__("pathlib").Path(args[0]).rglob("*.parquet"))]
        duckdb.execute(f"""SELECT step, sum(valid_tokens), min(backward_scalar / loss_sum), max(backward_scalar / loss_sum)
                           FROM read_parquet({files!r}) GROUP BY step""").fetchall()
    elif kind == "startup":
        # What `check` imports before it reads anything, and nothing else: the start-up that "audit work"
        # (check − start-up) leaves out.
        import tokaudit._auditing
        import tokaudit.cli
        import tokaudit._render.json_report
        import tokaudit._render.text  # noqa: F401
    elif kind == "naive":
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent))
        from naive import naive_check

        naive_check(Path(args[0]))
    wall = time.perf_counter() - start
    print(json.dumps({"wall_s": wall, "peak_rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak RSS. Not getrusage: Linux keeps ru_maxrss across exec, so a child of a
    parent that ran torch would report the parent's peak; VmHWM belongs to this process image alone."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    main()
