"""`tokaudit explain CODE` and docs/CODES.md, both rendered from the one table tokaudit.codes.CODE_DOCS.

`scripts/write_codes_doc.py` writes codes_markdown() to docs/CODES.md; tests/test_codes_doc.py fails when the
file differs from it."""

from __future__ import annotations

import re
import textwrap

from tokaudit.codes import CODE_DOCS, EXAMPLE_SETUP, REPORTING, TOKEN_MEAN_FIXES, UNDECIDABLE, Code, CodeDoc
from tokaudit._recipes import NAMES, RECIPES

LIST_WIDTH = 26
"""The code column of `tokaudit explain`'s list: the longest code and a space."""


def explain(code: Code) -> str:
    """The derivation, the fix and a worked example of one code, as `tokaudit explain CODE` prints it (prose)."""
    doc = CODE_DOCS[code]
    return (
        f"{code.value} ({doc.severity.value}): {doc.title}\n\n"
        f"Why\n  {doc.why}\n\nFix\n  {doc.fix}\n\n"
        f"Worked example\n  Set-up for the example: {EXAMPLE_SETUP}\n  {doc.example}\n"
    )


def explain_code(code: Code) -> str:
    """Where the fix of `code` is the token mean: its code for each set-up, to paste (never wrapped); else ""."""
    if code not in TOKEN_MEAN_FIXES:
        return ""
    return "".join(
        f"\nThe token mean in {NAMES[name]}\n{textwrap.indent(recipe, '  ')}\n" for name, recipe in RECIPES.items()
    )


def listing() -> list[str]:
    """Every code and its title, one a line, as `tokaudit explain` without a code prints them."""
    return [f"{code.value:<{LIST_WIDTH}} {doc.title}" for code, doc in CODE_DOCS.items()]


# docs/CODES.md

_CODE_SPAN = re.compile(r"(`[^`]*`)")


def _markdown(text: str, cell: bool = False) -> str:
    """Plain text as Markdown: `code spans` kept, `*` escaped (n_micro*M is no emphasis), and `|` too in a table
    cell (GitHub splits cells on it even inside a code span)."""
    parts = _CODE_SPAN.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("*", r"\*")
    joined = "".join(parts)
    return joined.replace("|", r"\|") if cell else joined


def _severity(doc: CodeDoc) -> str:
    return f"{doc.severity.value}, or {doc.severity_note}" if doc.severity_note else doc.severity.value


def _what_it_says(doc: CodeDoc) -> str:
    return f"{doc.title}: {doc.detail}" if doc.detail else doc.title


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _codes(codes: frozenset[Code]) -> str:
    return ", ".join(f"`{code.value}`" for code in Code if code in codes)


SCRIPT = "scripts/write_codes_doc.py"

_VERDICT = textwrap.fill(
    "Verdict (per run), about the gradient: `correct` with no warning or error; `inconclusive` when every "
    f"warning says the logs cannot tell ({_codes(UNDECIDABLE)}, or a finding of another code whose message says "
    "why it cannot: update ends guessed, a file unread, an earlier launch replaced, copies inside one file, weights "
    f"within two roundings of the run's precision), when the run is `{Code.BALANCED_COUNTS.value}`, "
    "or when no step could be judged (no step with valid tokens carries a usable weight); `incorrect` otherwise. "
    f"The logged loss ({_codes(REPORTING)}) is the run's `reporting` (matches, differs, absent, unjudged), "
    "shown beside the verdict, never part of it.",
    width=105,
    break_long_words=False,
    break_on_hyphens=False,
)

_HEADER = f"""\
<!-- Generated from tokaudit.codes.CODE_DOCS by {SCRIPT}: edit the table there, then run
     `python {SCRIPT}`. tests/test_codes_doc.py fails when this file is stale. -->

# Finding codes

Stable identifiers: tests, JSON consumers and CI gates (`--ignore CODE`) match on them, never on
the text. `tokaudit explain CODE` prints the derivation, the fix and a worked two-rank example: the
same text as [each code's section](#each-code) below.

{_VERDICT}

| code | severity | what it says | fix |
|---|---|---|---|
"""


def codes_markdown() -> str:
    """docs/CODES.md: the verdict, a table of every code (severity, what it says, fix), then each code's
    derivation and worked example."""
    rows = [
        f"| [`{code.value}`](#{code.value}) | {_markdown(_severity(doc), cell=True)} "
        f"| {_markdown(_what_it_says(doc), cell=True)} | {_markdown(doc.fix, cell=True)} |"
        for code, doc in CODE_DOCS.items()
    ]
    sections = [
        "## Each code",
        "",
        f"The worked examples share one set-up unless they state their own: {_markdown(EXAMPLE_SETUP)}",
    ]
    for code, doc in CODE_DOCS.items():
        verdict = "; alone, it makes the verdict `inconclusive`" if doc.undecidable else ""
        sections += [
            "",
            f"### `{code.value}`",
            "",
            f"*{_markdown(_severity(doc))}{verdict}.* {_markdown(_sentence(doc.title))}",
            "",
            f"**Why.** {_markdown(doc.why)}",
            "",
            f"**Fix.** {_markdown(doc.fix)}",
            "",
            f"**Worked example.** {_markdown(doc.example)}",
        ]
    recipes = [
        "",
        "## The token mean in code",
        "",
        f"The fix of {_codes(TOKEN_MEAN_FIXES)}, for each set-up a log can show (a finding carries the one "
        "its run's trainer needs, as `fix_code` in the JSON):",
    ]
    for name, recipe in RECIPES.items():
        recipes += ["", f"**{NAMES[name][:1].upper() + NAMES[name][1:]}.**", "", "```python", recipe, "```"]
    return _HEADER + "\n".join(rows) + "\n\n" + "\n".join(sections) + "\n" + "\n".join(recipes) + "\n"
