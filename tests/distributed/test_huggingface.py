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


def trainer_job(rank: int, world_size: int, log_dir: str, average_tokens: bool, fp16_scaler: bool = False) -> None:
    import torch

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from tests.distributed.padded import padded_sequences
    from tokaudit.hooks.huggingface import TokauditCallback

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(output_dir=f"{log_dir}/out-{rank}", use_cpu=True, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3, logging_steps=1,
                             report_to=[], save_strategy="no", disable_tqdm=True, seed=0, ddp_backend="gloo",
                             average_tokens_across_devices=average_tokens, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=padded_sequences())
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


@pytest.fixture(scope="module")
def hf_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    for average in (True, False):
        run_ddp(trainer_job, 2, str(root), average, timeout=240)
    run_ddp(trainer_job, 2, str(root), True, True, timeout=240)
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
