"""The package's dependencies point one way, read from its sources' import statements (no import is run).

The auditor is a stack of layers, each importing only those below it: reading the logs, the aggregation, the
checks, the report, the renderers, the command line. The hooks run inside training and know of the auditor only
its contract (the log schema, storage) and its public `tokaudit.audit`. No module imports another's private name.
Each module does one job and each function fits a screen: at most MODULE_LINES and FUNCTION_LINES lines.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = (
    "errors",
    "_schema",
    "_code_names",
    "codes",
    "_recipes",
    "_settings",
    "_partitions",
    "_delta",
    "_storage",
    "_sorting",
    "_validation",
    "_footers",
    "_reader",
    "_spool",
    "_discovery",
    "_loading",
    "_engine",
    "_cluster",
    "_opening",
    "_normalization",
    "_report",
    "_checks",
    "_ends",
    "_cut",
    "_summary",
    "_step_parts",
    "_auditing",
    "_postmortem",
    "_figures",
    "_explain",
    "_render",
    "testing",
    "_outputs",
    "_cli_exits",
    "_cli_inputs",
    "_cli_progress",
    "cli",
    "__main__",
)
"""The auditor's modules and subpackages, lowest first: each may import those before it."""

UPWARD = {
    (
        "tokaudit._report",
        "tokaudit._render.markdown",
    ): "a report shows itself in a notebook as its Markdown report, imported when Jupyter asks"
}
"""The imports that point up, each inside the one function that needs it, and why."""

MODULE_LINES, FUNCTION_LINES = 500, 60

HOOKS_MAY_IMPORT = ("tokaudit._schema", "tokaudit._storage", "tokaudit")
"""The auditor's modules the hooks import: the log's contract, storage, and the package's public names."""


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module (tokaudit.…)."""
    target: str
    names: tuple[str, ...]
    typing_only: bool


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in (("auditor", "tokaudit"), ("hooks", "tokaudit.hooks")):
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def imports_of(module: str, path: Path) -> list[Import]:
    found: list[Import] = []

    def visit(nodes: list[ast.stmt], typing_only: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tokaudit":
                found.append(Import(module, node.module, tuple(a.name for a in node.names), typing_only))
            elif isinstance(node, ast.Import):
                found.extend(
                    Import(module, a.name, (), typing_only) for a in node.names if a.name.startswith("tokaudit")
                )
            checking = isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child], typing_only or checking)

    visit(ast.parse(path.read_text(encoding="utf-8")).body, False)
    return found


@functools.cache  # read once: every rule reads the same imports
def every_import() -> list[Import]:
    return [found for module, path in modules().items() for found in imports_of(module, path)]


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_auditor_module_is_in_a_layer() -> None:
    unplaced = sorted({layer(m) for m in modules() if not m.startswith("tokaudit.hooks") and layer(m)} - set(LAYERS))
    assert not unplaced, f"add to LAYERS where they belong: {unplaced}"


def test_the_auditor_imports_only_the_layers_below_each_module() -> None:
    upward = []
    for found in every_import():
        if found.module.startswith("tokaudit.hooks") or found.typing_only:
            continue
        assert not found.target.startswith("tokaudit.hooks"), (
            f"{found.module} imports {found.target}: no torch in the audit"
        )
        here, there = layer(found.module), layer(found.target)
        if not here or not there or here == there:
            continue  # the package's own lazy names; a layer's modules among themselves
        if LAYERS.index(there) > LAYERS.index(here) and (found.module, found.target) not in UPWARD:
            upward.append(f"{found.module} -> {found.target}")
    assert not upward, upward
    assert {(f.module, f.target) for f in every_import()} >= set(UPWARD), "an allowed upward import is gone: drop it"


def test_the_hooks_know_only_the_auditor_s_contract_and_public_names() -> None:
    outside = [
        f"{f.module} -> {f.target}"
        for f in every_import()
        if f.module.startswith("tokaudit.hooks")
        and not f.target.startswith("tokaudit.hooks")
        and f.target not in HOOKS_MAY_IMPORT
    ]
    assert not outside, outside


def test_no_module_imports_another_s_private_name() -> None:
    private = [
        f"{f.module} imports {name} from {f.target}"
        for f in every_import()
        for name in f.names
        if name.startswith("_") and not name.startswith("__") and f.target != f.module
    ]
    assert not private, private


PUBLIC = (
    "tokaudit",
    "tokaudit.__main__",
    "tokaudit.cli",
    "tokaudit.codes",
    "tokaudit.errors",
    "tokaudit.testing",
    "tokaudit.hooks",
    "tokaudit.hooks.huggingface",
    "tokaudit.hooks.lightning",
    "tokaudit.hooks.trackers",
)
"""The modules a user imports (docs/development.md, "What is public"); every other one is the implementation."""


def test_every_implementation_module_is_private() -> None:
    named = [m for m in modules() if m not in PUBLIC and not any(part.startswith("_") for part in m.split("."))]
    assert not named, f"name them _module (a user imports only {PUBLIC}): {named}"
    assert set(PUBLIC) <= set(modules()), "a public module is gone: say so in CHANGES.md and drop it here"


ENTERED_BY_INIT = ("tokaudit._checks", "tokaudit._engine", "tokaudit._normalization")
"""Subpackages the rest of the package enters only by the names their __init__ hands on (the renderers are
imported module by module, lazily: a format costs only its own import)."""


def test_the_checks_engine_and_recovery_are_entered_by_their_init() -> None:
    through = [
        f"{f.module} imports {f.target}"
        for f in every_import()
        for package in ENTERED_BY_INIT
        if f.target.startswith(package + ".") and not f.module.startswith(package)
    ]
    assert not through, through


def test_the_rules_see_a_wrong_import(tmp_path: Path) -> None:
    """The checks above read what they should: an upward import, a typing-only one, and a private name."""
    source = tmp_path / "module.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nfrom tokaudit._render.text import printable\n"
        "if TYPE_CHECKING:\n    from tokaudit.cli import main\n"
        "def f():\n    from tokaudit._engine.tables import _hidden\n",
        encoding="utf-8",
    )
    found = imports_of("tokaudit._reader", source)
    assert [(f.target, f.names, f.typing_only) for f in found] == [
        ("tokaudit._render.text", ("printable",), False),
        ("tokaudit.cli", ("main",), True),
        ("tokaudit._engine.tables", ("_hidden",), False),
    ]
    assert LAYERS.index(layer("tokaudit._render.text")) > LAYERS.index(layer("tokaudit._reader"))


def module_level_targets(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules `module` imports when it is imported: its module-level imports, typing-only ones included (a
    function's own import runs when it is called), each `from package import name` counted as the submodule where
    `name` is one, else as the package (its __init__)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tokaudit":
                found.update(
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
                )
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, (ast.If, ast.Try)):
                visit([*node.body, *node.orelse, *getattr(node, "finalbody", [])])

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return {target for target in found if target in known and target != module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while True:
                member = stack.pop()
                part.append(member)
                if member == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_within_a_layer_in_the_hooks_or_through_a_package() -> None:
    """What the layer rule leaves to this one: modules of one layer, the hooks among themselves and a package's
    __init__ with its own modules import each other in one direction only, typing-only imports included."""
    known = modules()
    graph = {module: module_level_targets(module, path, known) for module, path in known.items()}
    assert not cycles(graph), cycles(graph)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


HOOK_LAYERS = (
    "_columns",
    "_fix",
    "_amp",
    "_probe",
    "_record",
    "_attach",
    "_identity",
    "_signals",
    "_shards",
    "_uploads",
    "_output",
    "_buffer",
    "_terms",
    "_capture",
    "_pipeline",
    "trackers",
    "_recorder_steps",
    "_recorder",
    "",
    "_trl_trainers",
    "huggingface",
    "lightning",
)
"""The hooks' modules, lowest first ("": the package's __init__, `tokaudit.hooks`): each imports only those before it."""


def test_the_hooks_import_only_the_modules_below_each() -> None:
    def place(module: str) -> str:
        return module.removeprefix("tokaudit.hooks").lstrip(".")

    hooks = [m for m in modules() if m.startswith("tokaudit.hooks")]
    assert sorted(place(m) for m in hooks) == sorted(HOOK_LAYERS), "add the new hook module to HOOK_LAYERS"
    upward = [
        f"{f.module} -> {f.target}"
        for f in every_import()
        if f.module.startswith("tokaudit.hooks")
        and f.target.startswith("tokaudit.hooks")
        and not f.typing_only
        and place(f.target) in HOOK_LAYERS
        and HOOK_LAYERS.index(place(f.target)) > HOOK_LAYERS.index(place(f.module))
    ]
    assert not upward, upward


def test_modules_and_functions_stay_short() -> None:
    long = []
    for module, path in modules().items():
        source = path.read_text(encoding="utf-8")
        if source.count("\n") > MODULE_LINES:
            long.append(f"{module}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno is not None
                and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
            ):
                long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long
