"""Results of an audit: frozen data the renderers format and the CLI turns into an exit code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tokaudit.codes import Code, Severity
from tokaudit._settings import FAIL_ON_RANK
from tokaudit._schema import UNNAMED

Verdict = Literal["correct", "incorrect", "inconclusive"]

Reporting = Literal["matches", "differs", "absent", "unjudged"]
"""The logged loss against each step's token mean (`RunSummary.reporting`)."""


@dataclass(frozen=True, slots=True)
class StepRange:
    """Which steps a finding covers."""

    first: int
    """First affected step."""
    last: int
    """Last affected step."""
    count: int
    """Number of affected steps (not last - first + 1 when they are not contiguous)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One diagnosis for one run."""

    run: str
    """Run id."""
    code: Code
    """Stable identifier."""
    severity: Severity
    """info, warning or error."""
    steps: StepRange
    """Affected steps."""
    message: str
    """What happened, with numbers from the logs."""
    fix: str
    """What to change, written for this run."""
    evidence: dict[str, Any] = field(default_factory=dict)
    """Numbers a user can check by hand."""
    term: str = UNNAMED
    """The loss term it concerns ("0", UNNAMED: the main one, or the only one)."""
    fix_code: str = ""
    """The token mean as code to paste, for the set-up the log shows (`recipes`); empty where the fix is not it."""
    undecidable: bool | None = None
    """Whether it says the logs cannot tell (`codes.UNDECIDABLE`): None, as its code says; set where this finding
    says so and its code need not (no sync recorded)."""


@dataclass(frozen=True, slots=True)
class Segment:
    """Consecutive steps of one averaging group and loss term that used the same normalization."""

    first: int
    """First step of the segment."""
    last: int
    """Last step of the segment."""
    steps: int
    """Steps in it with valid tokens."""
    denominator: str
    """Recovered denominator: N, N_m, n_rank, n_micro*M, n_micro, T, T_step, 1, undetermined, unexplained."""
    factor: float | None
    """α in b·g = α·S/denominator (W for a correct averaging reduction, 1 for a summing one)."""
    group: str = UNNAMED
    """Averaging group."""
    term: str = UNNAMED
    """Loss term."""


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One run, as the summary table and the JSON `runs` list show it."""

    run: str
    """Run id (the shards' parent folder unless the log says otherwise)."""
    rows: int
    """Records read (after removing duplicates)."""
    steps: int
    """Distinct optimizer steps."""
    ranks: int
    """Distinct ranks (per averaging group)."""
    world_size: list[int]
    """Distinct W values seen."""
    groups: int
    """Averaging groups (more than one under DP×TP)."""
    verdict: Verdict
    """correct, incorrect or inconclusive."""
    normalization: Segment | None
    """The normalization of most steps; None when no step had valid tokens."""
    segments: list[Segment]
    """Every change of normalization, in step order; at most 100 per group and term (the longest)."""
    max_weight_ratio: float
    """Largest ratio between two valid tokens' effective weights inside one step."""
    microbatches: int
    """Most microbatches one rank ran in one step."""
    terms: list[str] = field(default_factory=lambda: [UNNAMED])
    """Loss terms, each audited as its own token mean."""
    skipped_steps: int = 0
    """Steps the trainer marked skipped (a GradScaler overflow, an inf/NaN guard, N = 0)."""
    divisors: list[float] = field(default_factory=list)
    """Distinct divisors D of the gradient reduction (W for DDP's average, 1 for a sum)."""
    reporting: Reporting = "absent"
    """The logged loss against each step's token mean ΣS/N: "matches", "differs" (reported_loss_mismatch, or
    reported_loss_shifted: right, stamped one update off), "absent" (none logged) or "unjudged" (logged, where some
    ranks' files were not given). Beside the verdict, never part of it."""
    precision_bits: int | None = None
    """The fewest significant bits the run's records were computed in (`precision_bits`: 8 for bfloat16); None
    where the log does not say (float32 assumed)."""
    rtol: float | None = None
    """The tolerance the run was judged at: --rtol, or what its precision rounds (`_auditing.judged_rtol`)."""
    normalization_judged: bool = True
    """False where the files given lack some ranks' records (`ranks_not_recorded`): every step's N is partial,
    so neither the normalization nor q is judged (the JSON then has no weight_range)."""
    weight_range: tuple[float, float] | None = None
    """Lowest and highest q = e·N of a valid token over the run: its weight relative to 1/N (1 when correct); None
    where q cannot be stated (ranks without records, or a divisor D nobody could see)."""
    segments_omitted: int = 0
    """Segments not listed in `segments` (a normalization that changes at every step makes one per step)."""
    terms_pooled: bool = False
    """The run's loss terms are judged as one token mean over their combined tokens (terms_one_objective)."""
    ignored: list[str] = field(default_factory=list)
    """Codes of this run's findings left out by --ignore (or `ignore` in [tool.tokaudit]): the verdict still
    counts them; the listing and the exit code do not."""
    decided_by: list[str] = field(default_factory=list)
    """The codes that make the verdict what it is (the warnings and errors about the gradient; none when correct)."""
    gate_verdict: Verdict | None = None
    """The verdict of the listed findings alone, where ignored codes change it (what --fail-on reads); None:
    the verdict itself."""


@dataclass(frozen=True, slots=True)
class AuditReport:
    """Everything `tokaudit check` found."""

    runs: list[RunSummary]
    """One summary per run, sorted by run id."""
    findings: list[Finding]
    """All findings, most severe first."""
    problems: list[str]
    """Unreadable input, one line each (file: problem); the rest was still audited."""
    files: int
    """Parquet files read."""
    steps: Any = None
    """With `audit(..., keep_steps=True)`: the per-step table (a pandas DataFrame, one row per run,
    group, term and step), for notebooks."""
    ignored: list[str] = field(default_factory=list)
    """The codes asked to be left out (`audit(..., ignore=)`), whether or not a run had them."""
    ignored_from: str = ""
    """Where they were asked: "--ignore", or "[tool.tokaudit] in PATH" (set by the command line)."""

    def failing(self, fail_on: str) -> list[str]:
        """The runs that fail `tokaudit check --fail-on` (exit 1), by their listed findings and their gate verdict
        (what --ignore leaves out never fails one): error, the default, fails an incorrect run or one with an
        error; inconclusive also one that is not correct; warning and info, one with a finding of that severity."""
        failed = []
        for run in self.runs:
            worst = max((f.severity.rank for f in self.findings if f.run == run.run), default=-1)
            gate = run.gate_verdict or run.verdict
            if fail_on == "inconclusive":
                fails = worst >= Severity.ERROR.rank or gate != "correct"
            elif fail_on == "error":
                fails = worst >= Severity.ERROR.rank or gate == "incorrect"
            else:
                fails = worst >= FAIL_ON_RANK[fail_on]
            if fails:
                failed.append(run.run)
        return failed

    @property
    def verdicts(self) -> dict[str, Verdict]:
        """Run id → verdict."""
        return {run.run: run.verdict for run in self.runs}

    def to_pandas(self) -> Any:
        """The findings as a DataFrame: run, term, code, severity, first/last step, count, message, fix."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "run": f.run,
                    "term": f.term,
                    "code": f.code.value,
                    "severity": f.severity.value,
                    "first_step": f.steps.first,
                    "last_step": f.steps.last,
                    "steps": f.steps.count,
                    "message": f.message,
                    "fix": f.fix,
                }
                for f in self.findings
            ],
            columns=["run", "term", "code", "severity", "first_step", "last_step", "steps", "message", "fix"],
        )

    def runs_frame(self) -> Any:
        """The run summaries as a DataFrame."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "run": r.run,
                    "verdict": r.verdict,
                    "steps": r.steps,
                    "ranks": r.ranks,
                    "world_size": r.world_size,
                    "normalization": None if r.normalization is None else r.normalization.denominator,
                    "factor": None if r.normalization is None else r.normalization.factor,
                    "max_weight_ratio": r.max_weight_ratio,
                }
                for r in self.runs
            ]
        )

    def _repr_markdown_(self) -> str:
        from tokaudit._render.markdown import render_markdown

        return render_markdown(self)
