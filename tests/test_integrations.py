"""The trainer integrations' table (`tokaudit._recipes.INTEGRATIONS`) against what is written by hand beside it:
pyproject's extras and the Makefile's, so that an integration added to the table and not installed by
`make test`, or installed by an extra that does not exist, fails here and not on a user's machine."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tokaudit._recipes import INTEGRATIONS, NAMES, RECIPES, advice, recipe_for

ROOT = Path(__file__).resolve().parents[1]


def test_every_integration_has_an_extra_and_make_test_installs_its_modules() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    made = re.search(r"^DEFAULT_EXTRAS := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert made is not None
    installed = " ".join(" ".join(extras[extra]) for extra in made.group(1).split(","))
    for integration in INTEGRATIONS:
        assert integration.extra in extras, integration.name
        for module in integration.modules:  # in its own extra, and in one of those `make test` installs
            package = rf"\b{module.split('.')[0]}\b"
            assert re.search(package, " ".join(extras[integration.extra])), (integration.name, module)
            assert re.search(package, installed), (integration.name, module)


def test_a_run_of_no_integration_gets_the_loop_and_the_hooks_helpers() -> None:
    assert recipe_for(None) == RECIPES["loop"] and recipe_for("an unknown trainer") == RECIPES["loop"]
    assert advice(None, "token_mean_settings") == "" and advice("lightning", "token_mean_settings") == ""
    assert "num_items_in_batch" in advice("transformers", "token_mean_settings")
    assert set(RECIPES) <= set(NAMES) and NAMES["loop"] == "a training loop"
