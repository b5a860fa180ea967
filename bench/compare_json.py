"""The JSON report of `tokaudit check` on the same logs from this tree and from another git revision, compared
byte for byte: `python bench/compare_json.py REV LOG [LOG ...]` (exit 1 on a difference, each one named).

A refactoring that changes no behaviour passes it on `sample_logs/` and on the bench logs; the revision's
code runs from a `git worktree` laid out as the installed package (auditor/ as tokaudit, hooks/ as
tokaudit.hooks), so nothing needs installing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_at(revision: str, into: Path) -> Path:
    """A folder holding `tokaudit` as `revision` had it, for PYTHONPATH."""
    tree = into / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), revision], check=True)
    site = into / "site"
    shutil.copytree(tree / "auditor", site / "tokaudit")
    shutil.copytree(tree / "hooks", site / "tokaudit" / "hooks")
    return site


def report(python_path: Path | None, log: str) -> bytes:
    environment = dict(os.environ, COLUMNS="100")
    if python_path is not None:
        environment["PYTHONPATH"] = str(python_path)
    done = subprocess.run(
        [sys.executable, "-m", "tokaudit", "check", log, "--format", "json"],
        capture_output=True,
        env=environment,
        cwd=tempfile.gettempdir() if python_path else None,
    )
    return done.stdout + f"\nexit {done.returncode}\n".encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("revision")
    parser.add_argument("logs", nargs="+")
    args = parser.parse_args()
    logs = [str(Path(log).resolve()) for log in args.logs]
    with tempfile.TemporaryDirectory(prefix="tokaudit-compare-") as folder:
        try:
            before = package_at(args.revision, Path(folder))
            differ = [log for log in logs if report(before, log) != report(None, log)]
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(folder) / "tree")], check=False
            )
    for log in differ:
        print(f"differs: {log}")
    print(f"{len(logs) - len(differ)} of {len(logs)} logs give the same JSON and exit code as {args.revision}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
