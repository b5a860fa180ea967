"""A real transformers.Trainer run on 2 gloo processes, recorded by one line and audited."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest

from scenarios.harness import run_ddp

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = [pytest.mark.distributed, pytest.mark.integration]


def tiny_model(family: str) -> Any:
    from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

    if family == "bert":
        return BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, max_position_embeddings=32))
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))


def make_trainer(rank: int, log_dir: str, average_tokens: bool, family: str = "llama", smoothing: float = 0.0) -> Any:
    import torch
    from transformers import Trainer, TrainingArguments

    from tests.distributed.padded import padded_sequences

    torch.manual_seed(0)
    model = tiny_model(family)
    distributed = {"ddp_backend": "gloo", "ddp_find_unused_parameters": False} if "RANK" in os.environ else {}
    args = TrainingArguments(output_dir=f"{log_dir}/out-{rank}", use_cpu=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3, logging_steps=1,
                             report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
                             average_tokens_across_devices=average_tokens, dataloader_num_workers=0,
                             label_smoothing_factor=smoothing, **distributed)
    return Trainer(model=model, args=args, train_dataset=padded_sequences())


def trained_parameters(rank: int, log_dir: str, family: str, attached: bool, smoothing: float = 0.0) -> list[Any]:
    """Train with the HF Trainer's defaults (average_tokens_across_devices=True), with or without the
    one-line attach; the parameters it ends with."""
    from tokaudit.hooks.huggingface import TokauditCallback

    trainer = make_trainer(rank, log_dir, True, family, smoothing)
    if attached:
        TokauditCallback.attach(trainer, log_dir, run_id=family)
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


def attach_changes_nothing_job(rank: int, world_size: int, log_dir: str, family: str) -> None:
    import torch

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})
    plain = trained_parameters(rank, f"{log_dir}/plain", family, attached=False)
    recorded = trained_parameters(rank, log_dir, family, attached=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded)), "the attach changed the training"


def trainer_job(rank: int, world_size: int, log_dir: str, average_tokens: bool, fp16_scaler: bool = False) -> None:
    import torch

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})
    from tokaudit.hooks.huggingface import TokauditCallback

    trainer = make_trainer(rank, log_dir, average_tokens)
    model = trainer.model
    run_id = f"average_tokens_{average_tokens}"
    if fp16_scaler:
        # fp16 on CPU: Accelerate builds no GradScaler there, so give the Trainer the one it builds on a
        # GPU, before train() (prepare() hands it to the optimizer). Then overflow step 1 on rank 0.
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        forwards = {"count": 0}

        def overflow(module: Any, inputs: Any, output: torch.Tensor) -> None:
            forwards["count"] += 1
            if rank == 0 and forwards["count"] == 3 and torch.is_grad_enabled():
                output.register_hook(lambda grad: grad * float("inf"))

        model.lm_head.register_forward_hook(overflow)
        run_id = "fp16_scaler"
    TokauditCallback.attach(trainer, log_dir, run_id=run_id)  # the one line
    trainer.train()
    del trainer, model
    gc.collect()


@pytest.fixture(scope="session")
def hf_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    for average in (True, False):
        run_ddp(trainer_job, 2, str(root), average, timeout=240)
    run_ddp(trainer_job, 2, str(root), True, True, timeout=240)
    # The raw cross-entropy reaches the Trainer, which scales it in place (`loss *= W`): a BERT-style
    # model that ignores num_items_in_batch. The attach must neither crash nor change the training.
    run_ddp(attach_changes_nothing_job, 2, str(root), "bert", timeout=240)
    return root


def audit_run(root: Path, run: str) -> Any:
    from tokaudit.auditing import audit

    return audit([root / run])


def test_trainer_with_token_averaging_across_devices_is_correct(hf_logs: Path) -> None:
    report = audit_run(hf_logs, "average_tokens_True")
    (run,) = report.runs
    assert report.problems == []
    assert run.verdict == "correct", [f.message for f in report.findings]
    assert run.steps == 4 and run.ranks == 2 and run.microbatches == 2
    assert run.normalization.denominator == "N"


def test_trainer_without_token_averaging_is_a_local_mean(hf_logs: Path) -> None:
    report = audit_run(hf_logs, "average_tokens_False")
    codes = {f.code.value for f in report.findings}
    assert report.runs[0].verdict == "incorrect"
    assert "local_mean" in codes, codes
    # The Trainer logs the mean over ranks of each rank's own mean, not ΣS/N.
    reported = next(f for f in report.findings if f.code.value == "reported_loss_mismatch")
    assert "mean of per-rank means" in reported.message
    finding = next(f for f in report.findings if f.code.value == "local_mean")
    assert finding.evidence["denominator"] == "n_rank"  # num_items_in_batch counted on the rank only


def test_trainer_on_a_bert_style_model_trains_unchanged_and_is_audited(hf_logs: Path) -> None:
    report = audit_run(hf_logs, "bert")
    (run,) = report.runs
    assert run.steps == 4 and run.ranks == 2 and run.microbatches == 2
    # BertForMaskedLM returns each microbatch's own mean, which the Trainer multiplies by W and does not
    # divide by the accumulation steps: tokens of a small microbatch weigh more, read as b·g = W·S/n.
    assert run.verdict == "incorrect", [f.message for f in report.findings]
    finding = next(f for f in report.findings if f.code.value == "local_mean")
    assert (finding.evidence["denominator"], finding.evidence["factor"]) == ("n_micro", pytest.approx(2.0))


@pytest.mark.parametrize("family, smoothing, verdict", [("llama", 0.0, "correct"), ("bert", 0.0, "incorrect"),
                                                        ("llama", 0.1, "correct")])
def test_single_process_trainer_trains_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str,
                                                 smoothing: float, verdict: str) -> None:
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


def test_trainer_under_a_grad_scaler_is_correct_and_its_overflow_is_a_skipped_step(hf_logs: Path) -> None:
    from tests.logs import read_rows

    report = audit_run(hf_logs, "fp16_scaler")
    (run,) = report.runs
    assert run.verdict == "correct", [f.message for f in report.findings]
    assert run.steps == 4 and run.skipped_steps == 1
    rows = read_rows(hf_logs / "fp16_scaler")
    assert {row["step"] for row in rows if row["skipped"]} == {1}, "the Trainer counts the skipped update as a step"
    # The callback found the Trainer's scaler: 2^16, halved by the overflow.
    assert {row["grad_scale"] for row in rows if row["step"] <= 1} == {2.0 ** -16}
    assert {row["grad_scale"] for row in rows if row["step"] >= 2} == {2.0 ** -15}
