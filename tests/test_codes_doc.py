"""docs/CODES.md is generated from tokaudit.codes.CODE_DOCS (scripts/write_codes_doc.py), and every code is
documented there and in `tokaudit explain`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tokaudit.cli import main
from tokaudit.codes import CODE_DOCS, DEFAULT_SEVERITY, UNDECIDABLE, Code, Severity
from tokaudit._explain import codes_markdown

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "CODES.md"
SCRIPT = ROOT / "scripts" / "write_codes_doc.py"
REGENERATE = "docs/CODES.md is stale: run `python scripts/write_codes_doc.py` and commit the result"


def test_the_doc_is_what_the_script_writes() -> None:
    assert DOC.read_text(encoding="utf-8") == codes_markdown(), REGENERATE


def test_the_script_checks_and_writes(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)

    done = run("--check")
    assert done.returncode == 0, done.stderr or REGENERATE
    stale = tmp_path / "CODES.md"
    stale.write_text(codes_markdown().replace("`local_mean`", "`local mean`", 1), encoding="utf-8")
    done = run("--check", "--file", str(stale))
    assert done.returncode == 1 and done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done
    assert "python scripts/write_codes_doc.py" in done.stderr
    assert run("--file", str(stale)).returncode == 0
    assert stale.read_text(encoding="utf-8") == codes_markdown()
    assert run("--check", "--file", str(stale)).returncode == 0


def test_the_table_covers_every_code_in_order() -> None:
    assert list(CODE_DOCS) == list(Code)
    for code, doc in CODE_DOCS.items():
        assert doc.title and doc.why and doc.fix and doc.example, code
        assert DEFAULT_SEVERITY[code] is doc.severity
        assert not doc.undecidable or doc.severity is Severity.WARNING, code
    assert UNDECIDABLE == {
        Code.LOSS_SCALE,
        Code.UNKNOWN_DIVISOR,
        Code.NO_WEIGHTS,
        Code.RECORDS_DROPPED,
        Code.COUNT_MISMATCH,
        Code.RANKS_NOT_RECORDED,
        Code.UNREADABLE_FILES,
        Code.UPDATE_ENDS_GUESSED,
        Code.UNDECLARED_TERM_WEIGHT,
    }


@pytest.mark.parametrize("code", list(Code), ids=lambda c: c.value)
def test_every_code_is_in_the_doc_and_explained(code: Code) -> None:
    doc, text = CODE_DOCS[code], DOC.read_text(encoding="utf-8")
    row = next((line for line in text.splitlines() if line.startswith(f"| [`{code.value}`]")), None)
    assert row is not None and doc.severity.value in row, (code, REGENERATE)
    assert f"\n### `{code.value}`\n" in text, REGENERATE

    runner = CliRunner()
    listed = runner.invoke(main, ["explain"])
    assert listed.exit_code == 0
    assert any(line.split()[0] == code.value and doc.title in line for line in listed.output.splitlines())
    explained = runner.invoke(main, ["explain", code.value])
    assert explained.exit_code == 0, explained.output
    out = explained.output
    assert " ".join(out.split("\n\n")[0].split()) == f"{code.value} ({doc.severity.value}): {doc.title}"
    words = " ".join(out.split())  # wrapped to the terminal: the same words, lines broken elsewhere
    for heading, body in (("Why", doc.why), ("Fix", doc.fix), ("Worked example", doc.example)):
        assert f"\n{heading}\n  " in out and " ".join(body.split()) in words, (code, heading)
