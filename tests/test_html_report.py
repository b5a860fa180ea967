"""`check --format html`: one self-contained page, opened in a real headless Chromium (Debian's chromium and
chromium-driver, driven by Selenium): no console error, every run and finding shown, each run's heat-map drawn
where its weights are wrong."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.expected import EXPECTED_CODES, EXPECTED_VERDICT
from tests.logs import UNEVEN, local_mean, records, write_by_rank
from tests.needs import needs
from tokaudit.cli import main

SAMPLE_LOGS = Path(__file__).resolve().parents[1] / "sample_logs"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# As root on a machine with no network: no sandbox, and none of Chromium's background connections.
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1200,900",
)


def html_report(paths: list[Path], out: Path, *options: str) -> str:
    result = CliRunner().invoke(main, ["check", *map(str, paths), "--format", "html", "-o", str(out), "-q", *options])
    assert result.exit_code in (0, 1), result.stderr
    return out.read_text(encoding="utf-8")


def test_the_page_is_self_contained_and_prints_log_text_literally(tmp_path: Path) -> None:
    run = '<img src=x onerror="alert(1)">&amp;'
    write_by_rank(tmp_path / "logs" / "run", [dict(r, run_id=run) for r in records(UNEVEN, local_mean)])
    page = html_report([tmp_path / "logs"], tmp_path / "report.html")
    assert "<script" not in page and "<link" not in page and "http" not in page.replace("http-equiv", "")
    assert run not in page and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;amp;" in page
    assert "data-code=local_mean" in page and page.count("class=heatmap") == 1


@pytest.mark.integration
@needs("selenium")
@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromium-driver (.ci/run installs them)",
)
def test_the_report_loads_in_a_real_browser_with_every_run_finding_and_heat_map(tmp_path: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    path = tmp_path / "report.html"
    html_report([SAMPLE_LOGS], path)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        driver.get(path.as_uri())
        assert [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"] == []
        # What the page shows, read in the browser in one call (a WebDriver round trip per element is slow)
        shown = driver.execute_script(PAGE_READER)
        driver.set_window_size(1200, 1600)
        driver.get(path.as_uri() + "#" + shown["first_anchor"])
        assert driver.save_screenshot(str(tmp_path / "report.png"))  # what a person sees, for a look by hand
    finally:
        driver.quit()
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert "D" in shown["run_columns"]
    sections = {section["run"]: section for section in shown["sections"]}
    assert set(sections) == set(EXPECTED_VERDICT)
    for run, section in sections.items():
        assert section["verdict"] == EXPECTED_VERDICT[run]
        assert EXPECTED_CODES[run] <= set(section["codes"]), run
        fills = set(section["fills"])
        if EXPECTED_VERDICT[run] == "correct":
            assert fills == {"#ffffff"}, run
        if "local_mean" in EXPECTED_CODES[run]:  # some token got the wrong weight: a coloured cell
            assert fills - {"#ffffff"}, run
        assert section["cells"] == 0 or section["smallest_cell"] > 0  # drawn: laid out with a size on the page
        assert section["cells"] == 0 or (section["scale"] and section["map_height"] >= 100), run
        # curves equal at every step are one line under both labels, never one hidden under another
        assert len(set(section["curve_labels"])) == len(section["curve_labels"]), run
        one_term = not any("term" in label for label in section["curve_labels"])
        if EXPECTED_VERDICT[run] == "correct" and one_term and section["curve_labels"]:  # true mean = optimized
            assert any("ΣS/N (true)" in label and "optimized Σe·S" in label for label in section["curve_labels"]), (
                run,
                section["curve_labels"],
            )
    assert shown["curves"] > 0 and shown["narrowest_curve"] > 0


PAGE_READER = """
const sections = [...document.querySelectorAll("section.run")].map(section => {
  const cells = [...section.querySelectorAll("svg.heatmap rect.cell")];
  return {run: section.querySelector("h2").textContent.replace(/: [a-z]+$/, ""),
          verdict: section.querySelector("h2 span").textContent,
          codes: [...section.querySelectorAll("div.finding")].map(f => f.dataset.code),
          fills: cells.map(c => c.getAttribute("fill")), cells: cells.length,
          smallest_cell: Math.min(...cells.map(c => { const r = c.getBoundingClientRect(); return Math.min(r.width, r.height); })),
          scale: section.querySelector("svg.scale") !== null,
          map_height: section.querySelector("svg.heatmap") ? section.querySelector("svg.heatmap").getBoundingClientRect().height : 0,
          curve_labels: [...section.querySelectorAll("svg.curves polyline.series title")].map(t => t.textContent)};
});
const curves = [...document.querySelectorAll("svg.curves polyline.series")];
return {sections, curves: curves.length, first_anchor: document.querySelector("section.run").id,
        run_columns: [...document.querySelectorAll("#runs th")].map(th => th.textContent),
        narrowest_curve: Math.min(...curves.map(c => c.getBoundingClientRect().width))};
"""


def test_the_heat_map_leaves_out_the_repeated_records_the_audit_left_out(tmp_path: Path) -> None:
    """A step written twice, its earlier copy wrong: the audit keeps the later file's records, and so does the
    heat-map, where every weight is then the token mean's (white); counted twice, step 7 would weigh 2×."""
    import re

    from tests.logs import UNEVEN_GA, token_mean, write

    rows, run = records(UNEVEN_GA * 4, token_mean), tmp_path / "logs" / "run"
    for first in range(0, 12, 3):
        write(run / f"rank-all-{first:06d}.parquet", [r for r in rows if first <= r["step"] < first + 3])
    wrong = records(UNEVEN_GA * 4, local_mean)
    earlier = write(run / "rank-all-000002.parquet", [r for r in wrong if r["step"] == 7])
    os.utime(earlier, ns=(1_700_000_000_000_000_000,) * 2)  # written before the right copy (its files say no launch)
    page = html_report([tmp_path / "logs"], tmp_path / "report.html")
    assert "data-code=duplicate_records" in page
    fills = re.findall(r'<rect class=cell [^>]*fill="([^"]+)"', page)
    assert fills and set(fills) == {"#ffffff"}, fills
