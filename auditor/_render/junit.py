"""JUnit XML for CI systems that read test reports (GitLab, Jenkins, Azure): one test case per run, failed
when the run is `incorrect` (its findings in the failure), skipped when it is `inconclusive` (why, in the
skip), passed when `correct`; each input that could not be read is an errored case."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree

from tokaudit._render.text import printable
from tokaudit._report import AuditReport


def render_junit(report: AuditReport) -> str:
    suite = ElementTree.Element("testsuite", name="tokaudit")
    failures = skipped = 0
    for run in report.runs:
        case = ElementTree.SubElement(suite, "testcase", classname="tokaudit", name=printable(run.run))
        findings = [f for f in report.findings if f.run == run.run]
        text = "\n\n".join(
            f"{f.severity.value} {f.code.value} steps {f.steps.first}–{f.steps.last} "
            f"({f.steps.count}): {printable(f.message)}\nfix: {printable(f.fix)}"
            for f in findings
        )
        codes = ", ".join(sorted({f.code.value for f in findings}))
        if run.verdict == "incorrect":
            failures += 1
            ElementTree.SubElement(case, "failure", message=f"incorrect: {codes}", type="incorrect").text = text
        elif run.verdict == "inconclusive":
            skipped += 1
            ElementTree.SubElement(
                case, "skipped", message=f"inconclusive: {codes or 'the logs cannot tell'}"
            ).text = text
        elif text:
            ElementTree.SubElement(case, "system-out").text = text
    for problem in report.problems:
        case = ElementTree.SubElement(suite, "testcase", classname="tokaudit.input", name=printable(problem))
        ElementTree.SubElement(case, "error", message=printable(problem), type="unreadable")
    suite.set("tests", str(len(report.runs) + len(report.problems)))
    suite.set("failures", str(failures))
    suite.set("errors", str(len(report.problems)))
    suite.set("skipped", str(skipped))
    ElementTree.indent(suite)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ElementTree.tostring(suite, encoding="unicode") + "\n"
