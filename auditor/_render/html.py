"""`check --format html`: one self-contained page (no script, no network, no font or stylesheet from elsewhere):
the runs, each finding with its derivation and fix, and per run a rank × step heat-map of q = e·N (where the
wrong weights are) and the loss curves, drawn as inline SVG. Text from a log is escaped, never interpreted."""

from __future__ import annotations

import html
import json
import math
from typing import TYPE_CHECKING

import numpy as np

from tokaudit import __version__
from tokaudit.codes import CODE_DOCS
from tokaudit._render.text import factor_text, finding_counts, printable, q_range_text, ratio_text, steps_text
from tokaudit._render.text import verdict_counts
from tokaudit._report import AuditReport, Finding, RunSummary
from tokaudit._schema import UNNAMED

if TYPE_CHECKING:  # the figures are data handed in: the renderer reads no log
    from tokaudit._figures import RunFigures

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;padding:0 16px;color:#1d2125}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #d0d7de}h3{font-size:15px}
table{border-collapse:collapse}th,td{padding:4px 8px;border-bottom:1px solid #e4e8ec;text-align:left}
td.n{text-align:right}code{font-size:13px;background:#f3f4f6;padding:0 3px;border-radius:3px}
.correct{color:#1a7f37}.incorrect{color:#cf222e}.inconclusive{color:#9a6700}
.finding{border:1px solid #d0d7de;border-radius:6px;padding:8px 12px;margin:10px 0}
.error{border-left:5px solid #cf222e}.warning{border-left:5px solid #d4a72c}.info{border-left:5px solid #8c959f}
pre{background:#f6f8fa;padding:8px;overflow-x:auto;font-size:12px}figure{margin:12px 0}
figcaption{font-size:12px;color:#57606a}svg text{font:11px system-ui,sans-serif;fill:#57606a}
"""
COLORS = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#57606a")
"""The curves' colours, in the order of their series."""
HEAT_WIDTH, HEAT_HEIGHT = 640, 240
"""The heat-map's grid in pixels, about: its cells share it, each 4–40 wide and 8–60 high (at least 120 in all)."""


def _e(text: object) -> str:
    return html.escape(printable(str(text)))


def render_html(report: AuditReport, figures: dict[str, RunFigures]) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>tokaudit report</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>tokaudit report</h1><p id=summary>{_e(verdict_counts(report))}; {_e(finding_counts(report))}</p>",
    ]
    parts += [f"<p class=incorrect>unreadable: {_e(problem)}</p>" for problem in report.problems]
    if report.runs:
        parts.append(_run_table(report.runs))
    for run in report.runs:
        parts.append(_run_section(run, [f for f in report.findings if f.run == run.run], figures.get(run.run)))
    parts.append(
        f"<p><small>tokaudit {_e(__version__)}: q = e·N is each valid token's weight relative to 1/N "
        "(1 when correct). <code>tokaudit explain CODE</code> derives each finding.</small></p>"
    )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _run_table(runs: list[RunSummary]) -> str:
    rows = [
        "<table id=runs><tr><th>run</th><th>verdict</th><th>logged loss</th><th>steps</th><th>ranks</th>"
        "<th>W</th><th>D</th><th>normalization</th><th>q = e·N</th><th>max ratio</th></tr>"
    ]
    for run in runs:
        q = q_range_text(run, " – ")
        rows.append(
            f'<tr><td><a href="#{_anchor(run.run)}">{_e(run.run)}</a></td>'
            f"<td class={run.verdict}>{run.verdict}</td><td>{run.reporting}</td>"
            f"<td class=n>{run.steps}</td><td class=n>{run.ranks}</td>"
            f"<td>{', '.join(map(str, run.world_size))}</td>"
            f"<td>{', '.join(f'{d:g}' for d in run.divisors) or '?'}</td>"
            f"<td>{_e(factor_text(run))}</td>"
            f"<td>{q}</td><td class=n>{_e(ratio_text(run.max_weight_ratio))}</td></tr>"
        )
    return "\n".join(rows) + "</table>"


def _anchor(run: str) -> str:
    return "run-" + "".join(c if c.isalnum() else f"-{ord(c):x}-" for c in run)


def _run_section(run: RunSummary, findings: list[Finding], figures: RunFigures | None) -> str:
    parts = [
        f'<section class=run id="{_anchor(run.run)}"><h2>{_e(run.run)}: '
        f"<span class={run.verdict}>{run.verdict}</span></h2>"
    ]
    parts += [_finding(f) for f in findings] or ["<p>No findings.</p>"]
    if figures is not None:
        parts.append(_heatmap(figures, run))
        parts.append(_curves(figures))
    parts.append("</section>")
    return "\n".join(parts)


def _finding(finding: Finding) -> str:
    doc = CODE_DOCS[finding.code]
    term = f" · term {_e(finding.term)}" if finding.term != UNNAMED else ""
    evidence = json.dumps(finding.evidence, indent=1, default=str, allow_nan=True)
    return (
        f"<div class='finding {finding.severity.value}' data-code={finding.code.value}>"
        f"<h3>{finding.severity.value} <code>{finding.code.value}</code>{term} · steps "
        f"{_e(steps_text(finding.steps))}</h3><p>{_e(finding.message)}</p><p><b>Fix:</b> {_e(finding.fix)}</p>"
        + (f"<pre><code>{_e(finding.fix_code)}</code></pre>" if finding.fix_code else "")
        + f"<details><summary>derivation</summary><p>{_e(doc.why)}</p><p>{_e(doc.example)}</p>"
        f"<pre>{html.escape(evidence)}</pre></details></div>"
    )


def _shade(q: float) -> str:
    """White at q = 1, red as q grows, blue as it shrinks, full at a factor of 4 either way."""
    strength = min(abs(math.log2(q)) / 2.0, 1.0) if q > 0 else 1.0
    fade = round(255 * (1 - strength))
    return f"rgb(255,{fade},{fade})" if q > 1 else f"rgb({fade},{fade},255)"


def _heatmap(figures: RunFigures, run: RunSummary) -> str:
    cells = figures.heat
    if cells.empty:
        if not run.divisors:  # the reduction's D was not seen: e = c·g/D and q are not known
            return "<p>The divisor D of the reduction could not be seen, so no q = e·N: no heat-map.</p>"
        return "<p>No valid token carries a weight: no heat-map.</p>"
    rows, columns = int(cells.row.max()) + 1, int(cells.col.max()) + 1
    cell, height = max(4, min(40, HEAT_WIDTH // columns)), max(8, min(60, HEAT_HEIGHT // rows), -(-120 // rows))
    left, top = 64, 6
    width, tall = max(left + columns * cell + 8, 420), top + rows * height + 22
    tolerance = run.rtol or 0.0
    out = [f'<figure><svg class=heatmap width="{width}" height="{tall}" role="img" aria-label="q by rank and step">']
    for at in cells.itertuples(index=False):
        low, high = float(at.q_low), float(at.q_high)
        worst = high if abs(math.log(max(high, 1e-300))) >= abs(math.log(max(low, 1e-300))) else low
        fill = "#ffffff" if abs(high - 1) <= tolerance and abs(low - 1) <= tolerance else _shade(worst)
        ranks = _span("rank", at.rank_first, at.rank_last)
        steps = _span("step", at.step_first, at.step_last)
        out.append(
            f'<rect class=cell x="{left + int(at.col) * cell}" y="{top + int(at.row) * height}" '
            f'width="{cell}" height="{height}" fill="{fill}" stroke="#eaeef2" stroke-width="0.5">'
            f"<title>{ranks}, {steps}: q {_q(low, high)}</title></rect>"
        )
    first, last = int(cells.step_first.min()), int(cells.step_last.max())
    out.append(
        f'<text x="{left - 4}" y="{top + 10}" text-anchor="end">rank {int(cells.rank_first.min())}</text>'
        f'<text x="{left - 4}" y="{top + rows * height}" text-anchor="end">rank {int(cells.rank_last.max())}'
        f'</text><text x="{left}" y="{tall - 4}">step {first}</text>'
        f'<text x="{left + columns * cell}" y="{tall - 4}" text-anchor="end">step {last}</text></svg>'
    )
    right = all(
        abs(float(a) - 1) <= tolerance and abs(float(b) - 1) <= tolerance for a, b in zip(cells.q_low, cells.q_high)
    )
    said = "every cell is white: each valid token weighed 1/N, the token mean. " if right else ""
    out.append(
        f"<figcaption>{_scale()} q = e·N per rank (rows) and step (columns): {said}White within tolerance "
        "of 1, red where a token weighs more than 1/N, blue less (full colour at 4× either way); hover a cell "
        "for its values.</figcaption></figure>"
    )
    return "".join(out)


def _scale() -> str:
    """The heat-map's colour scale: q from ¼ to 4, white at 1."""
    stops = [0.25, 0.5, 1.0, 2.0, 4.0]
    boxes = "".join(
        f'<rect x="{40 + 44 * i}" y="2" width="44" height="12" fill="{_shade(q)}" stroke="#d0d7de" '
        f'stroke-width="0.5"/><text x="{62 + 44 * i}" y="26" text-anchor="middle">'
        f"{'¼' if q == 0.25 else '½' if q == 0.5 else f'{q:g}'}</text>"
        for i, q in enumerate(stops)
    )
    return (
        f'<svg class=scale width="280" height="30" role="img" aria-label="colour scale of q">'
        f'<text x="0" y="12">q</text>{boxes}</svg><br>'
    )


def _merged(series: list[tuple[str, np.ndarray, np.ndarray]]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Curves equal at every step drawn once, under their labels joined: one on top of another hides it."""
    out: list[tuple[str, np.ndarray, np.ndarray]] = []
    for label, x, y in series:
        same = next(
            (
                i
                for i, (_, ox, oy) in enumerate(out)
                if len(ox) == len(x)
                and np.array_equal(ox, x)
                and np.allclose(oy, y, rtol=1e-6, atol=0.0, equal_nan=True)
            ),
            None,
        )
        if same is None:
            out.append((label, x, y))
        else:
            joined, ox, oy = out[same]
            out[same] = (f"{joined} = {label}", ox, oy)
    return out


def _span(name: str, first: object, last: object) -> str:
    return f"{name} {first}" if first == last else f"{name}s {first}–{last}"


def _q(low: float, high: float) -> str:
    return f"{low:.4g}" if f"{low:.4g}" == f"{high:.4g}" else f"{low:.4g} – {high:.4g}"


def _curves(figures: RunFigures) -> str:
    series = figures.curves
    if not series:
        return "<p>No loss curve: no step has a value.</p>"
    series = _merged(series)
    xs = np.concatenate([x for _, x, _ in series])
    ys = np.concatenate([y for _, _, y in series])
    x_low, x_high, y_low, y_high = float(xs.min()), float(xs.max()), float(ys.min()), float(ys.max())
    width, height, left, bottom = 640, 220, 56, 20
    x_scale = (width - left - 10) / max(x_high - x_low, 1.0)
    y_scale = (height - bottom - 10) / (y_high - y_low if y_high > y_low else 1.0)
    out = [
        f'<figure><svg class=curves width="{width}" height="{height}" role="img" aria-label="loss curves">',
        f'<text x="4" y="14">{y_high:.4g}</text><text x="4" y="{height - bottom}">{y_low:.4g}</text>',
        f'<text x="12" y="{(height - bottom) / 2:.0f}" transform="rotate(-90 12 {(height - bottom) / 2:.0f})" '
        'text-anchor="middle">loss</text>',
        f'<text x="{left}" y="{height - 4}">step {x_low:.0f}</text>'
        f'<text x="{width - 10}" y="{height - 4}" text-anchor="end">step {x_high:.0f}</text>',
    ]
    legend = []
    for index, (label, x, y) in enumerate(series):
        color = COLORS[index % len(COLORS)]
        points = " ".join(
            f"{left + (a - x_low) * x_scale:.1f},{height - bottom - (b - y_low) * y_scale:.1f}"
            for a, b in zip(x.tolist(), y.tolist())
        )
        dash = ' stroke-dasharray="4 3"' if index % 2 else ""
        out.append(
            f'<polyline class=series fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{points}">'
            f"<title>{_e(label)}</title></polyline>"
        )
        legend.append(f'<span style="color:{color}">■</span> {_e(label)}')
    out.append(
        "</svg><figcaption>" + " &nbsp; ".join(legend) + "<br>ΣS/N is the true token mean; the optimized "
        "objective Σe·S is what the weights trained, equal to ΣS/N when the run is correct.</figcaption></figure>"
    )
    return "".join(out)
