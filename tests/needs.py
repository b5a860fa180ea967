"""Skip markers for optional packages, found without importing them: `pytest.importorskip` imports at
collection, in every xdist worker, which costs seconds for a trainer package (lightning, accelerate).

Also a plugin (tests/conftest.py loads it): where TOKAUDIT_REQUIRE_EXTRAS is 1, as `make test` and
`make test-fast` set it after installing every extra the suite uses, a test skipped for a missing package
fails the run. A skip there means a broken set-up, and a suite that passes by skipping proves nothing."""

from __future__ import annotations

import importlib.util
import os

import pytest

NEEDS = "not installed: "
"""How `needs` starts its reason (not "needs ...", which other skips say of a device)."""

IMPORT_FAILED = "could not import"
"""How `pytest.importorskip` starts its reason."""


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skip where any of `modules` is not installed."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{NEEDS}{', '.join(missing)}")


def needs_integration(*names: str) -> pytest.MarkDecorator:
    """Skip where the modules of any of these trainer integrations (`tokaudit._recipes.INTEGRATIONS`) are missing."""
    from tokaudit._recipes import INTEGRATION_BY_NAME

    return needs(*(module.split(".")[0] for name in names for module in INTEGRATION_BY_NAME[name].modules))


def missing_package(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The reason a skipped test or module gave, where it was skipped for a package that is not installed."""
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    return reason if reason.startswith((NEEDS, IMPORT_FAILED)) else None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("TOKAUDIT_REQUIRE_EXTRAS") != "1" or hasattr(session.config, "workerinput"):
        return  # the xdist controller sees every worker's reports
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    missing = sorted(
        {
            f"{report.nodeid}: {reason}"
            for report in reporter.stats.get("skipped", [])
            if (reason := missing_package(report)) is not None
        }
    )
    if missing:
        reporter.write_line(
            f"TOKAUDIT_REQUIRE_EXTRAS=1: {len(missing)} test(s) skipped for a missing package "
            "(the set-up installs every extra the suite uses):",
            red=True,
        )
        for line in missing:
            reporter.write_line(f"  {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
