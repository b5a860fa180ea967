"""Settings where Python tools keep them: `[tool.tokaudit]` in a pyproject.toml, the first one that holds such a
table from the current folder upward (as ruff and pytest find theirs). The command line wins over them.

```toml
[tool.tokaudit]
fail-on = "inconclusive"
ignore = ["reported_loss_mismatch"]
rtol = 1e-3
min-ratio = 1.01
ray = "auto"          # or a cluster's address: tokaudit check --ray
```
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokaudit.codes import Code, Severity
from tokaudit.errors import UsageError

KEYS = {"fail-on": "fail_on", "ignore": "ignore", "rtol": "rtol", "min-ratio": "min_ratio", "ray": "ray"}
"""Each setting and the `tokaudit check` option it sets (the option's name without its dashes)."""


RAY_ADDRESS = re.compile(r"^(auto|local|(ray|anyscale)://\S+|(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):\d+)$")
"""What `ray.init` takes for a cluster: `auto`, `local`, a client's ray://… (anyscale://… on Anyscale), or the head's
HOST:PORT; never a log's s3://…"""


def ray_address_problem(value: str) -> str | None:
    """Why `value` is no Ray address (None where it is one): what `--ray runs/` would otherwise pass to Ray, the
    folder taken as the address."""
    if RAY_ADDRESS.match(value):
        return None
    return f"{value!r} is no Ray cluster's address (auto, local, HOST:PORT or ray://HOST:PORT)"


FAIL_ON_RANK = {
    "error": Severity.ERROR.rank,
    "inconclusive": Severity.ERROR.rank,
    "warning": Severity.WARNING.rank,
    "info": Severity.INFO.rank,
    "never": 99,
}
"""--fail-on's choices (and `fail-on`'s here): the least severity of a finding that fails a run
(`AuditReport.failing`)."""


def find_settings(start: Path) -> tuple[Path, Any] | None:
    """The first pyproject.toml from `start` upward that holds a [tool.tokaudit] table, and that table."""
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file() and isinstance(tool := _read(candidate).get("tool"), dict) and "tokaudit" in tool:
            return candidate, tool["tokaudit"]
    return None


def check_defaults(start: Path, fail_on: Sequence[str]) -> tuple[dict[str, Any], Path | None, UsageError | None]:
    """The options [tool.tokaudit] sets for `tokaudit check` (as click's default_map takes them), the file, and what
    is wrong with its `ray` (said unless --no-ray sets it aside: `ray = …` is then read by no one); another setting
    that is unknown or of the wrong kind is a UsageError naming the file."""
    found = find_settings(start)
    if found is None:
        return {}, None, None
    path, settings = found
    where = f"{path}: [tool.tokaudit]"
    if not isinstance(settings, dict):
        raise UsageError(f"{where} is not a table")
    out: dict[str, Any] = {}
    ray: UsageError | None = None
    for key, value in settings.items():
        if key not in KEYS:
            raise UsageError(f"{where} has no setting {key!r} (settings: {', '.join(KEYS)})")
        if key == "fail-on" and value not in fail_on:
            raise UsageError(f"{where} fail-on = {value!r}: expected one of {', '.join(fail_on)}")
        if key == "ignore" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise UsageError(f'{where} ignore = {value!r}: expected a list of codes, such as ["balanced_counts"]')
        if key == "ignore":
            for code in value:
                try:
                    code_named(code)
                except ValueError as error:
                    raise UsageError(f"{where} ignore: {error}; `tokaudit explain` lists the codes") from None
        if key in ("rtol", "min-ratio") and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UsageError(f"{where} {key} = {value!r}: expected a number")
        if key in ("rtol", "min-ratio"):
            value = _number(value, where, key)
        if key == "ray" and (ray := _ray_problem(value, where)) is not None:
            continue
        out[KEYS[key]] = tuple(value) if key == "ignore" else value
    return out, path, ray


def _ray_problem(value: Any, where: str) -> UsageError | None:
    """What is wrong with a `ray` setting's value, if anything."""
    if not isinstance(value, str):
        return UsageError(f'{where} ray = {value!r}: expected a cluster\'s address, such as "auto"')
    problem = ray_address_problem(value)
    return None if problem is None else UsageError(f"{where} ray: {problem}")


BOUNDS = {"rtol": "above 0 and below 0.5", "min-ratio": "of at least 1"}
"""What rtol and min-ratio may be, as their errors say it (`within`)."""


def within(key: str, value: float) -> bool:
    """Whether a number is one the setting may take: rtol in (0, 0.5), since two weights within 2·rtol of each other
    are one (`fits.cluster`) and that must stay below 1; min-ratio finite and at least 1 (inf would make every
    weighting finding a note)."""
    return 0 < value < 0.5 if key == "rtol" else 1 <= value < math.inf


def _number(value: float, where: str, key: str) -> float:
    """A setting's number as a float, `within` its bounds (an integer of 400 digits is no float)."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not within(key, number):
        raise UsageError(f"{where} {key} = {value!r}: expected a finite number {BOUNDS[key]}")
    return number


def _read(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: no TOML reader in the standard library, so no settings file
        return {}
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
        return tomllib.loads(raw.decode("utf-8", errors="replace"))
    except OSError:
        return {}  # a file that cannot be opened holds no settings of ours
    except (tomllib.TOMLDecodeError, ValueError) as error:  # (an integer of more digits than Python converts)
        if b"tool.tokaudit" not in raw:  # (a header missing its bracket, a dotted key: ours as well)
            return {}  # another project's broken file: not ours to refuse, the search goes on upward
        raise UsageError(f"{path}: cannot be read as TOML ({error})") from None


def code_named(text: str | Code) -> Code:
    """The code a user typed, in either spelling (local_mean, local-mean, any case); ValueError naming the
    nearest code where there is one."""
    if isinstance(text, Code):
        return text
    name = text.strip().lower().replace("-", "_")
    try:
        return Code(name)
    except ValueError:
        import difflib

        near = difflib.get_close_matches(name, [code.value for code in Code], n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ValueError(f"unknown code {text!r}{hint}") from None
