"""Write docs/CODES.md from the table of finding codes in tokaudit.codes (CODE_DOCS).

    python scripts/write_codes_doc.py          # writes docs/CODES.md
    python scripts/write_codes_doc.py --check  # exit 1, with one line, when docs/CODES.md is stale

Edit the text of a code in auditor/codes.py, never in docs/CODES.md; tests/test_codes_doc.py fails when the
two differ."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokaudit._explain import SCRIPT, codes_markdown

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "CODES.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when the file differs from what would be written"
    )
    parser.add_argument("--file", type=Path, default=DOC, help="the file to write or check (default: %(default)s)")
    args = parser.parse_args(argv)
    wanted = codes_markdown()
    path: Path = args.file
    current = path.read_text(encoding="utf-8") if path.exists() else None
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    if args.check:
        if current != wanted:
            print(f"{shown} is out of date with tokaudit.codes: run `python {SCRIPT}`", file=sys.stderr)
            return 1
        return 0
    if current == wanted:
        print(f"{shown}: up to date")
        return 0
    path.write_text(wanted, encoding="utf-8", newline="\n")
    print(f"{shown}: written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
