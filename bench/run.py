"""All benchmarks in one command: `make bench` (or python bench/run.py [--rows N] [--skip-overhead]).

Prints one table: recorder overhead on a CPU transformer LM, and `tokaudit check` against a naive
pandas audit on a synthetic log of N rows (default 10⁷: 1024 ranks × 2500 steps × 4 microbatches).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measured(kind: str, path: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, str(HERE / "measure.py"), kind, str(path)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=float, default=1e7, help="rows of the synthetic log (1e7 or 1e8)")
    parser.add_argument("--out", type=Path, default=HERE / "out", help="where synthetic logs are kept")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--steps", type=int, default=150, help="steps per loop in the overhead benchmark")
    args = parser.parse_args()
    rows: list[tuple[str, str]] = []
    if not args.skip_overhead:
        sys.path.insert(0, str(HERE))
        import torch
        from overhead import measure

        torch.set_num_threads(2)
        result = measure(args.steps)
        rows += [("recorder: median step, plain", f"{result['plain_ms']:.1f} ms"),
                 ("recorder: median step, Recorder + probe", f"{result['recorded_ms']:.1f} ms"),
                 ("recorder: step-time ratio", f"{result['ratio']:.4f}"),
                 ("recorder: ratio with shard flushes amortized", f"{result['ratio_with_flush']:.4f}")]
    ranks, micro = 1024, 4
    steps = int(args.rows) // (ranks * micro)
    log = args.out / f"synthetic-{ranks}x{steps}x{micro}"
    if not log.exists():
        sys.path.insert(0, str(HERE))
        from synthetic import write_log

        print(f"writing {ranks * steps * micro:,} rows to {log} (once)…", file=sys.stderr)
        write_log(log, ranks, steps, micro)
    check, naive = measured("check", log), measured("naive", log)
    label = f"{ranks * steps * micro:,} rows"
    rows += [(f"tokaudit check, {label}: wall", f"{check['wall_s']:.2f} s"),
             (f"tokaudit check, {label}: peak RSS", f"{check['peak_rss_mb']:.0f} MiB"),
             (f"naive pandas audit, {label}: wall", f"{naive['wall_s']:.2f} s"),
             (f"naive pandas audit, {label}: peak RSS", f"{naive['peak_rss_mb']:.0f} MiB")]
    width = max(len(name) for name, _ in rows)
    print(f"{'benchmark':<{width}}  figure")
    print(f"{'-' * width}  ------")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
