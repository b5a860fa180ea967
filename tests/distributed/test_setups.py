"""Mixed precision, skipped updates, several loss terms, an unseen divisor and an elastic resize, in
real DDP (gloo): the float64 reference decides what is correct, then tokaudit must agree.

A correct set-up is never `incorrect`; a wrong one is never `correct`; where the logs cannot tell
(an unrecorded loss scale, a divisor nobody can see) the verdict is `inconclusive` with the code
that says why.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch

from scenarios.harness import run_ddp, run_ddp_each
from scenarios.setups import _UNEVEN, ELASTIC, SETUPS, Setup, job, reference_gradient
from scenarios.strategies import SCENARIOS_BY_NAME, run_scenario
from tests.expected import EXPECTED_CODES, EXPECTED_VERDICT
from tests.logs import read_rows
from tokaudit._auditing import audit

pytestmark = pytest.mark.distributed

# name: (loss terms, skipped steps); codes and verdicts are in tests/expected.py, shared with sample_logs/
SHAPE: dict[str, tuple[list[str], list[int]]] = {
    "amp_told": (["0"], [1]),
    "amp_untold": (["0"], [1]),
    "nan_guard_skip": (["0"], [2]),
    "aux_head_named": (["0", "head1"], []),
    "aux_head_captured": (["0", "1"], []),
    "aux_head_local_mean": (["0", "1"], []),
    "chunked_cross_entropy": (["0"], []),
    "chunked_cross_entropy_copied": (["0"], []),
    "chunked_cross_entropy_named": (["0", "chunk1", "chunk2"], []),
    "chunked_cross_entropy_chunk_means": (["0"], []),
    "mtp_heads": (["0", "1", "2"], []),
    "zero_grad_inside_accumulation": (["0"], [0, 2, 4, 6]),  # each update split at its zero_grad()
    "near_miss_local_mean": (["0"], []),
    "ignored_positions_summed": (["0"], []),
    "padding_labelled": (["0"], []),
    "unknown_hook_right": (["0"], []),
    "unknown_hook_wrong": (["0"], []),
    "counted_positions": (["0"], []),
    "elastic_stale_w": (["0"], []),
}


@pytest.fixture(scope="session")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[list[dict[str, Any]]]]]:
    root = tmp_path_factory.mktemp("setups")
    histories: dict[str, list[list[dict[str, Any]]]] = {}
    for world_size in sorted({s.world_size for s in SETUPS}):  # the set-ups of one W in one set of processes
        alike = [s for s in SETUPS if s.world_size == world_size]
        for setup, ranks in zip(alike, run_ddp_each(job, world_size, alike, str(root))):
            histories[setup.name] = [r["history"] for r in ranks]
    for part in ELASTIC:  # in order: the run resized from W=3 to W=2
        histories[f"{part.name}/W={part.world_size}"] = [
            r["history"] for r in run_ddp(job, part.world_size, part, str(root))
        ]
    return root, histories


def _matches(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(got, want, strict=True))


def _check_against_reference(setup: Setup, histories: list[list[dict[str, Any]]]) -> None:
    members = list(range(setup.world_size))
    judged = 0
    agree = []
    for history in histories:
        for step, record in enumerate(history):
            if record["skipped"]:
                assert setup.overflow is not None and step == setup.overflow[0]
                # The skipped update left the parameters where they were.
                assert all(torch.equal(a, b) for a, b in zip(record["before"], history[step + 1]["before"]))
                continue
            judged += 1
            agree.append(_matches(record["grads"], reference_gradient(setup, record["before"], step, members)))
    assert judged
    if setup.correct:
        assert all(agree), f"{setup.name}: the reduced gradient is not the token mean of every term"
    else:
        assert not any(agree), f"{setup.name}: a wrong set-up that trains the token mean"


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_the_float64_reference_says_which_set_ups_are_correct(recorded: Any, setup: Setup) -> None:
    _, histories = recorded
    _check_against_reference(setup, histories[setup.name])


def test_the_elastic_resize_trains_right_then_wrong(recorded: Any) -> None:
    _, histories = recorded
    for part in ELASTIC:
        _check_against_reference(part, histories[f"{part.name}/W={part.world_size}"])


@pytest.mark.parametrize("name", list(SHAPE))
def test_the_verdict_agrees_with_the_reference(recorded: Any, name: str) -> None:
    root, _ = recorded
    terms, skipped = SHAPE[name]
    report = audit([root / name])
    (run,) = report.runs
    assert {f.code.value for f in report.findings} == EXPECTED_CODES[name]
    assert run.verdict == EXPECTED_VERDICT[name]
    if not any(s.name == name and s.correct for s in SETUPS):
        assert run.verdict != "correct"
    assert run.terms == terms
    rows = read_rows(root / name)
    steps = sorted({row["step"] for row in rows})
    assert steps == list(range(len(steps))), "step numbers are the loop's, a skipped update included"
    assert sorted({row["step"] for row in rows if row["skipped"]}) == skipped


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_loss_reported_before_or_after_the_optimizer_step_is_the_right_step_s(tmp_path: Path, when: str) -> None:
    """W·S/N on 2 ranks, the loop reporting the all-reduced token mean with rec.report_loss() and no step,
    before optimizer.step() or after it: the float64 reference says the set-up is right, and tokaudit finds
    each step's reported loss its own token mean (no reported_loss_mismatch, nor a shift): correct."""
    setup = Setup(name=f"reported_{when}", counts=_UNEVEN, reported=when, correct=True)
    _check_against_reference(setup, [r["history"] for r in run_ddp(job, setup.world_size, setup, str(tmp_path))])
    rows = read_rows(tmp_path / setup.name)
    assert rows and all(row["reported_loss"] is not None for row in rows)
    report = audit([tmp_path / setup.name])
    assert report.findings == [] and report.runs[0].verdict == "correct"


def test_a_loss_recorded_but_never_trained_on_is_no_microbatch(tmp_path: Path) -> None:
    """W·S/N on 2 ranks, and after each update's microbatches a loss computed with gradients on one more batch and
    recorded, never backpropagated (an evaluation inside the loop): the float64 reference says the set-up is right,
    the log holds the trained microbatches only, and tokaudit says correct (its tokens in N would make it
    a scale mismatch)."""
    setup = Setup(name="evaluated_inside_the_loop", counts=_UNEVEN, evaluated=True, correct=True)
    _check_against_reference(setup, [r["history"] for r in run_ddp(job, setup.world_size, setup, str(tmp_path))])
    rows = read_rows(tmp_path / setup.name)
    assert sorted((row["step"], row["rank"], row["micro"]) for row in rows) == [
        (step, rank, micro) for step in range(len(_UNEVEN)) for rank in (0, 1) for micro in (0, 1)
    ]
    report = audit([tmp_path / setup.name])
    assert report.findings == [] and report.runs[0].verdict == "correct"


def test_a_told_scaler_is_divided_out_and_its_overflow_marked(recorded: Any) -> None:
    root, _ = recorded
    rows = read_rows(root / "amp_told")
    by_step = {row["step"]: row for row in rows if row["rank"] == 0 and row["micro"] == 0}
    # GradScaler starts at 2^16 and halves at the overflow of step 1.
    assert [by_step[s]["grad_scale"] for s in range(4)] == [2.0**-16, 2.0**-16, 2.0**-15, 2.0**-15]
    assert all(row["skipped"] is (row["step"] == 1) for row in rows)
    untold = audit([root / "amp_untold"])
    (finding,) = untold.findings
    assert finding.evidence["loss_scale_exponents"] == [15, 16]


def test_terms_are_guessed_from_the_targets(recorded: Any) -> None:
    root, _ = recorded
    report = audit([root / "aux_head_local_mean"])
    (finding,) = report.findings
    assert finding.term == "1" and finding.evidence["denominator"] in ("n_micro", "n_rank")
    chunked = read_rows(root / "chunked_cross_entropy")
    setup = next(s for s in SETUPS if s.name == "chunked_cross_entropy")
    # The two chunks of each microbatch are one record: its n is the microbatch's whole count.
    assert sorted((r["step"], r["rank"], r["micro"], r["valid_tokens"]) for r in chunked) == sorted(
        (step, rank, micro, n)
        for step, per_rank in enumerate(setup.counts)
        for rank, mine in enumerate(per_rank)
        for micro, n in enumerate(mine)
    )


def test_an_unseen_divisor_is_written_down(recorded: Any) -> None:
    root, _ = recorded
    for name in ("unknown_hook_right", "unknown_hook_wrong"):
        table = pq.read_table(sorted((root / name).glob("*.parquet"))[0])
        assert set(table.column("divisor_known").to_pylist()) == {False}


def test_a_near_miss_is_named_with_how_far_it_is_off(recorded: Any) -> None:
    root, _ = recorded
    (finding,) = audit([root / "near_miss_local_mean"]).findings
    assert finding.evidence["approximate"] is True and finding.evidence["denominator"] in ("n_micro", "n_micro*M")
    assert 0 < finding.evidence["approximation_error"] < 0.1


def test_an_auxiliary_head_weighed_on_purpose_is_judged_against_its_declared_weight(tmp_path: Path) -> None:
    """Two heads on 2 ranks, the second's token mean weighed λ = 1/2 (= 1/W, the factor a missing W would leave):
    the float64 reference of ΣS/N + λ·ΣS_aux/N_aux says the training is right. Declared with
    loss_term(name, weight=λ), tokaudit judges the head against λ/N: correct, no finding. Not declared, the logs
    cannot tell λ from a missing W: inconclusive, undeclared_term_weight, whose fix declares λ."""
    setups = [
        Setup(
            name=f"aux_weighed_{said}",
            counts=_UNEVEN,
            heads=2,
            aux_weight=0.5,
            aux_weight_declared=said == "told",
            correct=True,
        )
        for said in ("told", "untold")
    ]
    for setup, ranks in zip(setups, run_ddp_each(job, 2, setups, str(tmp_path))):
        _check_against_reference(setup, [r["history"] for r in ranks])
    told, untold = (audit([tmp_path / setup.name]) for setup in setups)
    assert told.findings == [] and told.runs[0].verdict == "correct" and told.runs[0].terms == ["0", "head1"]
    assert {row["term_weight"] for row in read_rows(tmp_path / "aux_weighed_told")} == {None, 0.5}
    (finding,) = untold.findings
    assert finding.code.value == "undeclared_term_weight" and finding.term == "head1"
    assert untold.runs[0].verdict == "inconclusive"
    assert "λ = 0.5" in finding.message and "weight=0.5" in finding.fix


def test_an_auxiliary_head_switched_off_by_a_declared_weight_of_zero_is_not_judged(tmp_path: Path) -> None:
    """λ = 0 declared (a warm-up's first steps): the head weighs its tokens 0, which the float64 reference of
    ΣS/N + 0·ΣS_aux/N_aux says is right. Its records carry λ = 0 and no weight to judge: correct, no finding (the
    recorder refused the 0 and the head read "0/N instead of 1/N", scale_mismatch: incorrect)."""
    setup = Setup(name="aux_off", counts=_UNEVEN, heads=2, aux_weight=0.0, correct=True)
    _check_against_reference(setup, [r["history"] for r in run_ddp(job, setup.world_size, setup, str(tmp_path))])
    report = audit([tmp_path / setup.name])
    assert report.findings == [] and report.runs[0].verdict == "correct" and report.runs[0].terms == ["0", "head1"]
    assert {row["term_weight"] for row in read_rows(tmp_path / setup.name)} == {None, 0.0}


def test_an_auxiliary_loss_of_the_first_microbatch_alone_every_term_named_is_correct(tmp_path: Path) -> None:
    """Every term named: "lm", and "aux", an auxiliary loss computed on each update's first microbatch alone (its own
    token mean over those microbatches' tokens). The float64 reference says the set-up is right. With no term "0",
    the main term is the one of the most records, "lm": "aux", first by name, was taken for it, and its records,
    unsynchronized as every first microbatch under no_sync() is, read missing_sync (incorrect)."""
    setup = Setup(
        name="aux_first_named", counts=_UNEVEN, heads=2, aux_first_only=True, names=("lm", "aux"), correct=True
    )
    _check_against_reference(setup, [r["history"] for r in run_ddp(job, setup.world_size, setup, str(tmp_path))])
    assert {(row["term"], row["micro"]) for row in read_rows(tmp_path / setup.name)} == {
        ("lm", 0),
        ("lm", 1),
        ("aux", 0),
    }
    report = audit([tmp_path / setup.name])
    assert report.findings == [] and report.runs[0].verdict == "correct" and report.runs[0].terms == ["lm", "aux"]


def test_without_the_optimizer_or_begin_step_the_updates_are_the_backwards_that_synchronize(tmp_path: Path) -> None:
    """The token mean over 2 microbatches under no_sync() on 2 ranks, the recorder given the DDP model but neither
    the optimizer nor begin_step: each update ends at the backward that all-reduces, so the log holds the loop's
    4 updates of 2 microbatches each and the run is correct (each backward its own update read as missing_sync)."""
    setup = Setup(name="steps_untold", counts=_UNEVEN, steps_told=False, correct=True)
    _check_against_reference(setup, [r["history"] for r in run_ddp(job, setup.world_size, setup, str(tmp_path))])
    rows = read_rows(tmp_path / setup.name)
    assert sorted({(row["step"], row["micro"]) for row in rows}) == [(s, m) for s in range(4) for m in range(2)]
    report = audit([tmp_path / setup.name])
    assert report.findings == [] and report.runs[0].verdict == "correct"


def test_without_the_optimizer_an_update_of_backwards_that_all_synchronize_is_a_guess(tmp_path: Path) -> None:
    """The same loop without no_sync(): every backward all-reduces, the gradient the same (the float64 reference),
    but nothing tells an update of 2 microbatches from 2 updates: the footers say the ends were guessed, and the
    run is inconclusive, not incorrect for each microbatch's N_micro/N."""
    setup = Setup(name="steps_untold_synced", counts=_UNEVEN, steps_told=False, no_sync=False, correct=True)
    _check_against_reference(setup, [r["history"] for r in run_ddp(job, setup.world_size, setup, str(tmp_path))])
    report = audit([tmp_path / setup.name])
    assert report.runs[0].verdict == "inconclusive"
    assert "update_ends_guessed" in {f.code.value for f in report.findings}


def test_a_forward_that_bypasses_ddp_is_no_synchronized_backward(tmp_path: Path) -> None:
    """The token mean's construction on 2 ranks, W·S/N, but each forward through `ddp.module`: DDP all-reduces
    nothing, and each rank steps on its own gradient (the float64 reference disagrees at every update). The recorder,
    given the DDP model, saw no forward of it: every record says it did not synchronize, and the audit says
    missing_sync and incorrect (it read correct: the weights alone are the token mean's)."""
    setup = Setup(name="bypassed", counts=_UNEVEN, forward="module", correct=False)
    _check_against_reference(setup, [r["history"] for r in run_ddp(job, setup.world_size, setup, str(tmp_path))])
    assert {row["sync"] for row in read_rows(tmp_path / setup.name)} == {False}
    report = audit([tmp_path / setup.name])
    assert report.runs[0].verdict == "incorrect" and {f.code.value for f in report.findings} == {"missing_sync"}
    # `ddp.forward(tokens)` runs no module hook, but DDP's own: its reducer all-reduces the last microbatch, and the
    # records say so (it read missing_sync, incorrect, where the reference says the token mean was trained)
    method = Setup(name="method", counts=_UNEVEN, forward="method", correct=True)
    _check_against_reference(method, [r["history"] for r in run_ddp(job, method.world_size, method, str(tmp_path))])
    report = audit([tmp_path / method.name])
    assert report.runs[0].verdict == "correct" and report.findings == []


def test_a_rank_that_skips_an_update_alone_parts_the_replicas_and_is_skip_mismatch(tmp_path: Path) -> None:
    """The token mean on 2 real ranks, but rank 0's own guard skips update 1 while rank 1 applies it: from then on the
    replicas hold different weights (the truth, their parameters compared), though every token weighed 1/N. The
    audit says skip_mismatch and incorrect."""
    scenario = replace(SCENARIOS_BY_NAME["correct_token_mean_ga"], name="skip_on_one_rank", extra={"skip_on": (1, 0)})
    history = {result["rank"]: result["recorded"] for result in run_ddp(run_scenario, 2, scenario, str(tmp_path))}
    same = [all(torch.equal(a, b) for a, b in zip(history[0][s]["before"], history[1][s]["before"])) for s in (1, 2)]
    assert same == [True, False]  # one weights before update 1, two after it
    report = audit([tmp_path / scenario.name])
    assert report.runs[0].verdict == "incorrect" and {f.code.value for f in report.findings} == {"skip_mismatch"}


def test_a_rank_killed_at_once_leaves_the_steps_it_never_wrote_unjudged(tmp_path: Path) -> None:
    """The token mean on 2 real ranks (correct_token_mean_ga's construction, which the float64 reference holds right),
    writing a shard every 4 records; after update 4, rank 0 is SIGKILLed (the OOM killer: its last records never
    written) and rank 1 stops and closes. The ranks' records end at different steps: the steps rank 0 never wrote are
    left out and said (unfinished_update), never missing_rank, and the run is correct."""
    base = SCENARIOS_BY_NAME["correct_token_mean_ga"]
    scenario = replace(base, name="killed", counts=base.counts * 2, extra={"killed": (4, 0), "flush_every": 4})
    with pytest.raises(RuntimeError, match="rank 0 died"):
        run_ddp(run_scenario, 2, scenario, str(tmp_path))
    last = {rank: max(row["step"] for row in read_rows(tmp_path / "killed") if row["rank"] == rank) for rank in (0, 1)}
    assert last[0] < last[1] == 4  # what rank 0 held at the kill is lost
    report = audit([tmp_path / "killed"])
    (finding,) = report.findings
    assert report.runs[0].verdict == "correct" and finding.code.value == "unfinished_update"
    assert (finding.steps.first, finding.steps.last) == (last[0] + 1, 4)
    # the same records compacted into one file: no footer says how wide a rank's unwritten records were, so the
    # steps are left out and the run is inconclusive (once, missing_rank: incorrect on a correct run)
    compacted = _compacted(tmp_path / "killed")
    (finding,) = compacted.findings
    assert finding.code.value == "unfinished_update" and finding.undecidable
    assert compacted.runs[0].verdict == "inconclusive"


def _compacted(log: Path) -> Any:
    """The audit of a log's records rewritten as one file without the recorder's footers (as a compaction job leaves
    them)."""
    folder = log.with_name(log.name + "-compacted")
    folder.mkdir()
    pq.write_table(pq.read_table(log).replace_schema_metadata(None), folder / "part-00000.parquet")
    return audit([folder])


def _joined(rank: int, world_size: int, log_dir: str, right: bool = False) -> list[float]:
    """DDP under `join()`: rank 1's data runs out after 3 updates, rank 0 trains 2 more alone, and both close their
    recorders. Each rank's b is S/n (every record holds 8 valid tokens: the token mean while both train); alone, rank
    0's b is W·S/N with N its own n where `right` (join() still divides by W), else S/n still. Returns, for rank 0's
    updates alone, the applied gradient over the float64 token mean's (∇ S/N, N its own n)."""
    from torch.nn.parallel import DistributedDataParallel

    from tokaudit.hooks import Recorder

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(log_dir, run_id="joined", model=model, optimizer=optimizer, announce=False)
    ratios = []
    with model.join():
        for step in range(5 if rank == 0 else 3):
            generator = torch.Generator().manual_seed(10 * step + rank)
            tokens, labels = (torch.randint(0, 16, (1, 8), generator=generator) for _ in range(2))
            loss_sum = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="sum")
            scalar = loss_sum * world_size / 8 if right and step >= 3 else loss_sum / 8
            rec.record(loss_sum, 8, scalar)
            scalar.backward()
            if step >= 3:  # alone: the reference is rank 0's own token mean, in float64
                reference = copy.deepcopy(net).double()
                torch.nn.functional.cross_entropy(
                    reference(tokens).flatten(0, 1), labels.flatten(), reduction="sum"
                ).div(8).backward()
                applied, truth = net[1].weight.grad.double().flatten(), reference[1].weight.grad.flatten()
                ratios.append(float(applied @ truth / (truth @ truth)))  # g = ratio · ∇(S/N), projected
            optimizer.step()
            optimizer.zero_grad()
    rec.close()
    return ratios


def test_a_rank_out_of_data_under_join_is_a_missing_rank_not_a_kill(tmp_path: Path) -> None:
    """Rank 1 runs out of data and closes its recorder; rank 0 trains on under DDP's join(), which still divides by
    W = 2: the float64 reference says its tokens then get half the token-mean weight. The short rank's last shard says
    the training code closed it, so its early end is missing_rank, and the run incorrect (never excused as a kill)."""
    ratios = run_ddp(_joined, 2, str(tmp_path))[0]
    assert ratios == [pytest.approx(0.5), pytest.approx(0.5)]
    report = audit([tmp_path / "joined"])
    assert report.runs[0].verdict == "incorrect" and "missing_rank" in {f.code.value for f in report.findings}
    # compacted, no footer says the recorder was closed: the logs cannot tell, and the run is never correct
    assert _compacted(tmp_path / "joined").runs[0].verdict == "inconclusive"


def test_a_rank_out_of_data_under_join_with_the_token_mean_of_the_ranks_left_is_never_incorrect(
    tmp_path: Path,
) -> None:
    """The same join() run, rank 0 alone backpropagating W·S/N over its own tokens: join() still divides by W = 2, so
    the float64 reference says it trains the token mean. Its records weigh each token 1/N of the ranks still training,
    which is also what a join() that divides by the ranks still joined (divide_by_initial_world_size=False) would
    double: the logs cannot tell, the run is inconclusive (it read incorrect, missing_rank)."""
    ratios = run_ddp(_joined, 2, str(tmp_path), True)[0]
    assert ratios == [pytest.approx(1.0), pytest.approx(1.0)]
    report = audit([tmp_path / "joined"])
    assert report.runs[0].verdict == "inconclusive"
    (missing,) = [f for f in report.findings if f.code.value == "missing_rank"]
    assert missing.undecidable and missing.severity.value == "warning" and "join()" in missing.message
    assert {f.code.value for f in report.findings} == {"missing_rank"}
