"""A real transformers.Trainer run on 2 gloo processes, recorded by one line and audited."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest

from scenarios.harness import run_ddp
from tests.needs import needs_integration

pytestmark = [needs_integration("transformers", "accelerate"), pytest.mark.distributed, pytest.mark.integration]


def tiny_model(family: str) -> Any:
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    if family == "bert":
        return BertForMaskedLM(
            BertConfig(
                vocab_size=64,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                max_position_embeddings=32,
            )
        )
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )


def make_trainer(rank: int, log_dir: str, average_tokens: bool, family: str = "llama", smoothing: float = 0.0) -> Any:
    import torch
    from transformers import Trainer, TrainingArguments

    from scenarios.padded import padded_sequences

    torch.manual_seed(0)
    model = tiny_model(family)
    distributed = {"ddp_backend": "gloo", "ddp_find_unused_parameters": False} if "RANK" in os.environ else {}
    args = TrainingArguments(
        output_dir=f"{log_dir}/out-{rank}",
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        average_tokens_across_devices=average_tokens,
        dataloader_num_workers=0,
        label_smoothing_factor=smoothing,
        **distributed,
    )
    return Trainer(model=model, args=args, train_dataset=padded_sequences())


def trained_parameters(
    rank: int, log_dir: str, family: str, attached: bool, smoothing: float = 0.0, as_callback: bool = False
) -> list[Any]:
    """Train with the HF Trainer's defaults (average_tokens_across_devices=True), with or without the
    one-line attach (or the callback given as Trainer(callbacks=[...]) does, no trainer known to it); the
    parameters it ends with."""
    from tokaudit.hooks.huggingface import TokauditCallback

    trainer = make_trainer(rank, log_dir, True, family, smoothing)
    if as_callback:
        trainer.add_callback(TokauditCallback(log_dir, run_id=f"{family}_callback"))
    elif attached:
        TokauditCallback.attach(trainer, log_dir, run_id=family)
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


def attach_changes_nothing_job(rank: int, world_size: int, log_dir: str, family: str) -> None:
    import torch

    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
        }
    )
    plain = trained_parameters(rank, f"{log_dir}/plain", family, attached=False)
    recorded = trained_parameters(rank, log_dir, family, attached=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded)), "the attach changed the training"
    if family == "llama":
        trained_parameters(rank, log_dir, family, attached=True, as_callback=True)


def scaler_job(rank: int, world_size: int, log_dir: str) -> None:
    """Llama with average_tokens_across_devices=True under fp16's GradScaler, step 1 overflowing on rank 0."""
    import torch

    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
        }
    )
    from tokaudit.hooks.huggingface import TokauditCallback

    trainer = make_trainer(rank, log_dir, True)
    model = trainer.model
    # fp16 on CPU: Accelerate builds no GradScaler there, so give the Trainer the one it builds on a
    # GPU, before train() (prepare() hands it to the optimizer). Then overflow step 1 on rank 0.
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    forwards = {"count": 0}

    def overflow(module: Any, inputs: Any, output: torch.Tensor) -> None:
        forwards["count"] += 1
        if rank == 0 and forwards["count"] == 3 and torch.is_grad_enabled():
            output.register_hook(lambda grad: grad * float("inf"))

    model.lm_head.register_forward_hook(overflow)
    TokauditCallback.attach(trainer, log_dir, run_id="fp16_scaler")  # the one line
    trainer.train()
    del trainer, model
    gc.collect()


@pytest.fixture(scope="session")
def hf_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    run_ddp(scaler_job, 2, str(root), timeout=240)
    # The raw cross-entropy reaches the Trainer, which scales it in place (`loss *= W`): a BERT-style
    # model that ignores num_items_in_batch. The attach must neither crash nor change the training.
    run_ddp(attach_changes_nothing_job, 2, str(root), "bert", timeout=240)
    run_ddp(attach_changes_nothing_job, 2, str(root), "llama", timeout=240)
    return root


MATRIX_CELLS = (
    "llama",
    "llama-no-average",
    "bert",
    "gpt2",
    "trl-sft-completion",
    "trl-sft-packing",
    "trl-sft-callbacks",  # the callback given as callbacks=[...]: found to be SFTTrainer's by its config
    "lightning-token-mean",
    "custom-sum-gpt2",  # tokaudit._recipes.TRANSFORMERS, the fix its findings give Trainer users, on GPT-2
)
"""The cells of docs/trainer-matrix.md run here (`python scripts/trainer_matrix.py` runs them all)."""


@pytest.fixture(scope="session")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from scenarios.trainer_matrix import CELLS_BY_NAME, measure

    root = tmp_path_factory.mktemp("matrix")
    return {row.cell.name: row for row in measure([CELLS_BY_NAME[name] for name in MATRIX_CELLS], root, together=True)}


def audit_run(root: Path, run: str) -> Any:
    from tokaudit._auditing import audit

    return audit([root / run])


@pytest.mark.parametrize("name", MATRIX_CELLS)
def test_the_verdict_and_exit_code_follow_the_float64_reference(matrix: dict[str, Any], name: str) -> None:
    """Cells of the trainer matrix: the truth is each update's gradient against a float64 token-mean
    reference on the same weights and tokens; `tokaudit check` calls the right set-up correct (exit 0) and
    each wrong one incorrect (exit 1), with the mistake it is."""
    row = matrix[name]
    (run,) = row.report["runs"]
    assert row.report["problems"] == [] and (run["steps"], run["ranks"], run["microbatches"]) == (4, 2, 2)
    assert row.verdict == ("correct" if row.correct else "incorrect"), (row.truth, row.report["findings"])
    assert row.exit_code == (0 if row.correct else 1)
    findings = {f["code"]: f for f in row.report["findings"]}
    if name == "llama":  # num_items_in_batch is the update's N on both ranks, and the loss is ×W
        assert row.correct and run["normalization"]["denominator"] == "N"
    elif name == "llama-no-average":  # num_items_in_batch counted on the rank only
        assert not row.correct and findings["local_mean"]["evidence"]["denominator"] == "n_rank"
        # The Trainer logs the mean over ranks of each rank's own mean, not ΣS/N.
        assert "mean of per-rank means" in findings["reported_loss_mismatch"]["message"]
    elif name == "gpt2":
        # GPT-2's loss_type is None: the Trainer counts num_items_in_batch over the unshifted labels, one per
        # sequence too many, while the model's loss shifts them: uniform weights, q = N/(N + sequences) < 1
        assert not row.correct
        finding = findings["scale_mismatch"]
        assert 0.8 < finding["evidence"]["distortion"] < 1.0
        assert "after the causal shift" in finding["fix"] and 'model.loss_type = "ForCausalLM"' in finding["fix"]
    elif name in ("lightning-token-mean", "custom-sum-gpt2"):  # tokaudit._recipes' LIGHTNING and TRANSFORMERS
        assert row.correct and run["normalization"]["denominator"] == "N"
    elif name.startswith("trl-"):
        # TRL's SFTTrainer: no cross-entropy call, the loss from its fused LM head, recorded there; completion-only
        # labels and bfd packing (padding-free rows) train the token mean over the labels the loss counts
        assert row.correct and run["normalization"]["denominator"] == "N"
    else:
        # BertForMaskedLM returns each microbatch's own mean, which the Trainer multiplies by W and does not
        # divide by the accumulation steps: tokens of a small microbatch weigh more, read as b·g = W·S/n.
        assert not row.correct
        evidence = findings["local_mean"]["evidence"]
        assert (evidence["denominator"], evidence["factor"]) == ("n_micro", pytest.approx(2.0))
        # said as what happened, with the Trainer's own fix (the shards name the Trainer)
        assert "multiplied by W=2 and not divided by the M=2 microbatches" in findings["local_mean"]["message"]
        assert "compute_loss_func that sums the per-token losses" in findings["local_mean"]["fix"]


def test_trainer_on_a_bert_style_model_trains_unchanged_and_is_audited(hf_logs: Path) -> None:
    """The attach changed no parameter (checked on each rank in the job), and the run is audited."""
    report = audit_run(hf_logs, "bert")
    (run,) = report.runs
    assert run.steps == 4 and run.ranks == 2 and run.microbatches == 2 and run.verdict == "incorrect"


@pytest.mark.parametrize(
    "family, smoothing, verdict", [("llama", 0.0, "correct"), ("bert", 0.0, "incorrect"), ("llama", 0.1, "correct")]
)
def test_single_process_trainer_trains_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, smoothing: float, verdict: str
) -> None:
    """One process, no torchrun: the Trainer scales the loss in place (`loss *= 1`), on BERT the raw
    cross-entropy output; nothing crashes or changes. Llama divides a sum by num_items_in_batch (right);
    BERT returns each microbatch's mean, not divided by the accumulation steps (wrong). With label smoothing
    the Trainer's LabelSmoother computes the loss (no cross-entropy call): it is recorded too, and divides
    by num_items_in_batch (right)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    import torch

    plain = trained_parameters(0, str(tmp_path / "plain"), family, attached=False, smoothing=smoothing)
    recorded = trained_parameters(0, str(tmp_path), family, attached=True, smoothing=smoothing)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded)), "the attach changed the training"
    report = audit_run(tmp_path, family)
    (run,) = report.runs
    assert run.ranks == 1 and run.steps == 4
    assert run.verdict == verdict, [f.message for f in report.findings]
    import json

    import pyarrow.parquet as pq

    for shard in (tmp_path / family).glob("*.parquet"):  # the fixes may then name the Trainer's settings
        assert json.loads(pq.read_schema(shard).metadata[b"tokaudit.provenance"])["trainer"] == "transformers"


def test_the_callback_given_as_trainer_callbacks_finds_the_ddp_model_as_the_attach_does(hf_logs: Path) -> None:
    """TokauditCallback given to the Trainer as a callback (no trainer known to it, only the model it is handed):
    the DDP wrapper around that model gives D and each backward's sync, so the run reads as the attach's does."""
    attached, given = (audit_run(hf_logs, name) for name in ("llama", "llama_callback"))
    assert given.findings == attached.findings == []
    assert given.runs[0].verdict == attached.runs[0].verdict == "correct" and given.runs[0].divisors == [2.0]


def test_trainer_under_a_grad_scaler_is_correct_and_its_overflow_is_a_skipped_step(hf_logs: Path) -> None:
    from tests.logs import read_rows

    report = audit_run(hf_logs, "fp16_scaler")
    (run,) = report.runs
    assert run.verdict == "correct", [f.message for f in report.findings]
    assert run.steps == 4 and run.skipped_steps == 1
    rows = read_rows(hf_logs / "fp16_scaler")
    assert {row["step"] for row in rows if row["skipped"]} == {1}, "the Trainer counts the skipped update as a step"
    # The callback found the Trainer's scaler: 2^16, halved by the overflow.
    assert {row["grad_scale"] for row in rows if row["step"] <= 1} == {2.0**-16}
    assert {row["grad_scale"] for row in rows if row["step"] >= 2} == {2.0**-15}


def test_two_experiments_in_one_folder_are_two_runs_named_after_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`TokauditCallback.attach(trainer, "runs")` as the README shows it, twice into one folder: the run is named
    after TrainingArguments.run_name, so the second experiment (average_tokens_across_devices=False) is a run of
    its own with its own verdict, never merged into the first (one process: both count N alike, both right)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    from tokaudit.hooks.huggingface import TokauditCallback

    for run_name, average in (("exp-average", True), ("exp-local", False)):
        trainer = make_trainer(0, str(tmp_path / "out"), average)
        trainer.args.run_name = run_name
        TokauditCallback.attach(trainer, tmp_path / "runs")  # no run_id
        trainer.train()
    report = audit_run(tmp_path, "runs")
    assert report.verdicts == {"exp-average": "correct", "exp-local": "correct"}
    assert [run.steps for run in report.runs] == [4, 4]
    assert not any(f.code.value == "duplicate_records" for f in report.findings)


def test_without_a_run_name_each_launch_has_its_own_id(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokaudit.hooks._attach import trainer_run_id

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4b1f6c2e-aaaa-bbbb")  # torchrun --standalone: a fresh one each launch
    assert trainer_run_id(None) == "run-4b1f6c2e" and trainer_run_id("my-exp") == "my-exp"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default rendezvous id says nothing
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert trainer_run_id(None).startswith("run-") and str(os.getpid()) in trainer_run_id(None)  # type: ignore[union-attr]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert trainer_run_id(None) is None  # several processes and nothing they share: the folder's name
