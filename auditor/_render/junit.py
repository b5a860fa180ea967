"""JUnit XML for CI systems that read test reports (GitLab, Jenkins, Azure): one test case per run, failed when
the run fails the gate the command exits by (`--fail-on`: an `incorrect` run by default; its findings in the
failure), skipped when it is `inconclusive` and passes the gate (why, in the skip), passed otherwise; each input
that could not be read is an errored case. The report agrees with the exit code."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree

from tokaudit._render.text import printable
from tokaudit._report import AuditReport


def render_junit(report: AuditReport, fail_on: str = "error") -> str:
    suite = ElementTree.Element("testsuite", name="tokaudit")
    failures = skipped = 0
    failing = set(report.failing(fail_on))
    for run in report.runs:
        case = ElementTree.SubElement(suite, "testcase", classname="tokaudit", name=printable(run.run))
        findings = [f for f in report.findings if f.run == run.run]
        text = "\n\n".join(
            f"{f.severity.value} {f.code.value} steps {f.steps.first}–{f.steps.last} "
            f"({f.steps.count}): {printable(f.message)}\nfix: {printable(f.fix)}"
            for f in findings
        )
        # the codes that decided the verdict (a reporting finding never does), else every one listed
        codes = ", ".join(run.decided_by or sorted({f.code.value for f in findings}))
        if run.run in failing:
            failures += 1
            why = f"{run.verdict}: {codes}" if codes else run.verdict
            ElementTree.SubElement(
                case, "failure", message=f"{why} (--fail-on {fail_on})", type=run.verdict
            ).text = text
        elif run.verdict == "inconclusive":
            skipped += 1
            ElementTree.SubElement(
                case, "skipped", message=f"inconclusive: {codes or 'the logs cannot tell'}"
            ).text = text
        elif text or run.verdict != "correct":
            ignored = f", --ignore {','.join(run.ignored)}" if run.ignored else ""
            if run.gate_verdict not in (None, run.verdict) and not run.ignored:  # what made its findings information
                ignored = ", --min-ratio"
            passed = f"{run.verdict}, which this gate passes (--fail-on {fail_on}{ignored})\n\n"
            ElementTree.SubElement(case, "system-out").text = (passed if run.verdict != "correct" else "") + text
    for problem in report.problems:
        case = ElementTree.SubElement(suite, "testcase", classname="tokaudit.input", name=printable(problem))
        ElementTree.SubElement(case, "error", message=printable(problem), type="unreadable")
    suite.set("tests", str(len(report.runs) + len(report.problems)))
    suite.set("failures", str(failures))
    suite.set("errors", str(len(report.problems)))
    suite.set("skipped", str(skipped))
    ElementTree.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ElementTree.tostring(suite, encoding="unicode") + "\n"
