"""The README and docs/ show only what exists: every `tokaudit` subcommand and option (and each --format value),
every `make` target, every option of the repository's scripts, every dotted `tokaudit.…` name, and every keyword
a Python example passes to tokaudit's API. The README stays a front door: at most README_BYTES, the rest in docs/."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from tokaudit.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_BYTES = 15_000

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`\n]+)`")


def blocks(text: str) -> Iterator[tuple[str, str]]:
    """(language, body) of each fenced block."""
    for found in FENCE.finditer(text):
        yield found.group(1), found.group(2)


def command_lines(text: str) -> Iterator[str]:
    """Shell lines a page shows: each line of a fenced block (less a `$ ` prompt and a trailing comment) and each
    inline code span."""
    for language, body in blocks(text):
        if language in ("python", "json", "text"):
            continue
        for line in body.splitlines():
            # a console's prompt, a CI step's `run:`
            line = re.sub(r"^(\$ |- run: |run: )", "", line.strip())
            yield line.split("  #")[0].rstrip(" \\")
    outside = FENCE.sub("", text)
    yield from (span.strip() for span in INLINE.findall(outside))


def words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:  # an unclosed quote in prose
        return line.split()


def shown(program: str) -> list[tuple[str, list[str]]]:
    """(page, words) of every line or span that runs `program`."""
    found = []
    for page in PAGES:
        for line in command_lines(page.read_text()):
            parts = words(line)
            if parts and parts[0] == program:
                found.append((page.name, parts))
    return found


def options_of(command: click.Command) -> dict[str, click.Parameter]:
    return {
        option: parameter for parameter in command.params for option in [*parameter.opts, *parameter.secondary_opts]
    }


def test_every_tokaudit_command_and_option_shown_exists() -> None:
    commands, wrong = shown("tokaudit"), []
    assert len(commands) > 20, "the pages show the CLI"
    group_options = {**options_of(cli), "--help": None, "-h": None}
    assert isinstance(cli, click.Group)
    for page, parts in commands:
        rest = parts[1:]
        while rest and rest[0] in group_options:
            rest = rest[1:]
        if not rest or not re.fullmatch(r"[a-z]+", rest[0]):
            continue  # `tokaudit --version`, `tokaudit --debug COMMAND …`
        command = cli.commands.get(rest[0])
        if command is None:
            wrong.append(f"{page}: no command {rest[0]!r} in {' '.join(parts)!r}")
            continue
        options = {**options_of(command), "--help": None, "-h": None}
        for index, word in enumerate(rest):
            if not word.startswith("-") or word in ("-", "--"):
                continue
            name = word.split("=")[0]
            if name not in options:
                wrong.append(f"{page}: {rest[0]} has no option {name} ({' '.join(parts)!r})")
                continue
            choice = getattr(options[name], "type", None)
            value = word.split("=", 1)[1] if "=" in word else (rest[index + 1] if index + 1 < len(rest) else "")
            if isinstance(choice, click.Choice) and value and not value.isupper() and value not in choice.choices:
                wrong.append(f"{page}: {name} takes no {value!r} ({' '.join(parts)!r})")
    assert not wrong, "\n".join(wrong)


def test_every_make_target_shown_exists() -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    shown_targets = {(page, parts[1]) for page, parts in shown("make") if len(parts) > 1}
    assert {"demo", "test", "test-fast", "bench"} <= {target for _, target in shown_targets}
    missing = sorted(f"{page}: make {target}" for page, target in shown_targets if target not in targets)
    assert not missing, missing


def test_every_script_and_its_options_shown_exist() -> None:
    wrong, seen = [], 0
    for page, parts in shown("python"):
        script = next((word for word in parts[1:] if word.endswith(".py")), None)
        if script is None:
            continue
        path = ROOT / script
        if not path.is_file():
            if "/" in script:
                wrong.append(f"{page}: no {script}")
            continue
        seen += 1
        source = path.read_text()
        for word in parts[parts.index(script) + 1 :]:
            if word.startswith("--") and f'"{word.split("=")[0]}"' not in source:
                wrong.append(f"{page}: {script} takes no {word}")
    assert seen >= 4, "the pages show the bench's commands"
    assert not wrong, "\n".join(wrong)


def resolve(dotted: str) -> Any:
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(dotted)


def metadata_keys() -> set[str]:
    """The Parquet metadata keys of the log format (`tokaudit.provenance`, ...), which the pages name too."""
    import tokaudit._schema as schema

    return {
        value.decode() for name, value in vars(schema).items() if name.endswith("_KEY") and isinstance(value, bytes)
    }


def test_every_dotted_tokaudit_name_shown_exists() -> None:
    names = {
        name for page in PAGES for name in re.findall(r"(?<![\w/.-])tokaudit(?:\.[A-Za-z_]\w*)+", page.read_text())
    }
    keys = metadata_keys()
    assert "tokaudit.provenance" in keys
    missing = []
    for name in sorted(names - keys):
        if name.endswith((".yml", ".yaml", ".md", ".py", ".json")):
            continue  # a file's name
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, missing


API_MODULES = (
    "tokaudit",
    "tokaudit.hooks",
    "tokaudit.hooks.huggingface",
    "tokaudit.hooks.lightning",
    "tokaudit.testing",
)
"""The modules whose names the pages use without an import (the README's one-liners name the module beside)."""


@functools.cache
def public_names() -> dict[str, Any]:
    """Each public name of API_MODULES: its `__all__`, else what the module defines (found once; callers copy)."""
    names: dict[str, Any] = {"tokaudit": importlib.import_module("tokaudit")}
    for module_name in API_MODULES:
        module = importlib.import_module(module_name)
        listed = getattr(module, "__all__", None) or [
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module_name
        ]
        names.update({name: getattr(module, name) for name in listed if not name.startswith("_")})
    return names


def api_calls(body: str) -> Iterator[tuple[Any, ast.Call]]:
    """(callable, call) for each call of tokaudit's API in an example: names imported from tokaudit, `tokaudit.x`,
    and methods of a variable the example assigned from a tokaudit class (`rec = Recorder(...)`)."""
    tree = ast.parse(body)
    known = dict(public_names())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokaudit"):
            known.update({alias.asname or alias.name: resolve(f"{node.module}.{alias.name}") for alias in node.names})
        elif isinstance(node, ast.Import):
            known.update({alias.name: resolve(alias.name) for alias in node.names if alias.name == "tokaudit"})
    for node in ast.walk(tree):  # variables made by a tokaudit class, in any order of the walk
        if isinstance(node, (ast.Assign, ast.withitem)):
            value = node.value if isinstance(node, ast.Assign) else node.context_expr
            targets = node.targets if isinstance(node, ast.Assign) else [node.optional_vars]
            if (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and inspect.isclass(known.get(value.func.id))
            ):
                known.update({t.id: known[value.func.id] for t in targets if isinstance(t, ast.Name)})
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id in known:
            yield known[node.func.id], node
        elif (
            isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in known
        ):
            yield getattr(known[node.func.value.id], node.func.attr), node


def wrong_keywords(body: str) -> tuple[int, list[str]]:
    """(calls checked, each keyword an example passes that the called function lacks)."""
    checked, wrong = 0, []
    for function, call in api_calls(body):
        parameters = inspect.signature(function).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            continue
        checked += 1
        name = getattr(function, "__qualname__", repr(function))
        wrong += [f"{name} takes no {k.arg}=" for k in call.keywords if k.arg is not None and k.arg not in parameters]
    return checked, wrong


def python_shown(text: str) -> Iterator[str]:
    """The Python a page shows: its python blocks, and each inline span that parses as a call."""
    yield from (body for language, body in blocks(text) if language == "python")
    for span in INLINE.findall(FENCE.sub("", text)):
        expression = span.replace("...", "None").replace("…", "None")  # an elided argument
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError:
            continue
        if any(isinstance(node, ast.Call) for node in ast.walk(tree)):
            yield expression


def test_every_keyword_an_example_passes_to_tokaudit_exists() -> None:
    checked, wrong = 0, []
    for page in PAGES:
        for body in python_shown(page.read_text()):
            calls, found = wrong_keywords(body)
            checked += calls
            wrong += [f"{page.name}: {line}" for line in found]
    assert checked >= 5, "the examples call the API"
    assert not wrong, "\n".join(wrong)


def test_the_checks_catch_a_wrong_keyword_a_wrong_option_and_a_wrong_name() -> None:
    example = (
        "from tokaudit.hooks import Recorder\nrec = Recorder('runs', run_id='x', no_such=1)\n"
        "rec.record(loss_sum=s, valid_tokens=n, nor_this=2)\n"
    )
    assert wrong_keywords(example)[1] == ["Recorder takes no no_such=", "Recorder.record takes no nor_this="]
    assert "--no-such-flag" not in options_of(cli.commands["check"])
    with pytest.raises(AttributeError):
        resolve("tokaudit.hooks.no_such_name")


def test_the_readme_reads_in_five_minutes() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_BYTES, f"README.md is {size:,} bytes: move a section to a page under docs/"


SHOWN_OUTPUTS = {
    "README.md": "tokaudit check sample_logs/bug_local_mean sample_logs/correct_token_mean_ga",
    "docs/mixed-precision.md": "tokaudit check sample_logs/ --run amp_told --run amp_untold --run nan_guard_skip \\\n"
    "    --run aux_head_local_mean --run mtp_heads --run unknown_hook_wrong --run counted_positions \\\n"
    "    --run elastic_stale_w",
}
"""The pages that show a command's output, and the command as the page writes it."""


@pytest.mark.parametrize("page", list(SHOWN_OUTPUTS))
def test_an_output_a_page_shows_is_what_the_command_prints_at_100_columns(page: str) -> None:
    """The front door's example, and the other pages' shown output, are the command's own output, word for word
    (their code blocks are 100 wide), up to the exit code or the end of the block."""
    import os
    import subprocess
    import sys

    command = SHOWN_OUTPUTS[page]
    shown = (ROOT / page).read_text().split(f"$ {command}\n", 1)[1].split("$ echo $?", 1)[0].split("```", 1)[0]
    done = subprocess.run(
        [sys.executable, "-m", "tokaudit", *command.replace("\\\n", " ").split()[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "100", "NO_COLOR": "1"},
    )
    assert done.returncode == 1 and done.stdout == shown
