"""Record `sample_logs/`: one folder per scenario, each a real multi-process DDP run (gloo, CPU).

Usage: python scripts/record_sample_logs.py [OUT_DIR]   (default: sample_logs)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scenarios.harness import run_ddp  # noqa: E402
from scenarios.setups import ELASTIC, SETUPS, job  # noqa: E402
from scenarios.strategies import SCENARIOS, run_scenario  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "sample_logs")
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Sample logs",
        "",
        "Recorded by `python scripts/record_sample_logs.py` from real DDP runs "
        "(torch.distributed, gloo, CPU), one folder per scenario:",
        "",
    ]
    for heading, runs, body in (
        ("", SCENARIOS, run_scenario),
        (
            "Set-ups people run (mixed precision, skipped updates, several loss terms, an unseen divisor, an "
            "elastic resize), from `scenarios/setups.py`:",
            SETUPS,
            job,
        ),
    ):
        if heading:
            lines += ["", heading, ""]
        for run in runs:
            shutil.rmtree(out / run.name, ignore_errors=True)
            run_ddp(body, run.world_size, run, str(out))
            verdict = "correct" if run.correct else "deliberate mistake"
            lines.append(f"- `{run.name}/` ({verdict}, {run.world_size} processes): {run.description}")
            print(f"recorded {run.name}", file=sys.stderr)
    shutil.rmtree(out / ELASTIC[0].name, ignore_errors=True)
    for part in ELASTIC:  # one run, two jobs: the resumed job appends its shards
        run_ddp(job, part.world_size, part, str(out))
    lines.append(
        f"- `{ELASTIC[0].name}/` (deliberate mistake): {ELASTIC[0].description}, then {ELASTIC[1].description}"
    )
    (out / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
