"""A real Lightning DDP run on 2 gloo processes with accumulate_grad_batches=2, recorded and audited."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from scenarios.harness import run_ddp
from tests.needs import needs_integration

pytestmark = [needs_integration("lightning"), pytest.mark.distributed, pytest.mark.integration]


def lightning_job(rank: int, world_size: int, log_dir: str, fp16_scaler: bool = False) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    # As torchrun would set them: Lightning then joins the existing process group instead of launching.
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29555",
        }
    )
    import lightning as L

    from tokaudit.hooks.lightning import TokauditLightningCallback

    class Padded(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 32

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            generator = torch.Generator().manual_seed(index)
            tokens = torch.randint(0, 32, (12,), generator=generator)
            length = int(torch.randint(1, 12, (), generator=generator))
            labels = torch.roll(tokens, -1).masked_fill(torch.arange(12) >= length, -100)
            return tokens, labels

    class TinyLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(32, 16)
            self.head = torch.nn.Linear(16, 32)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
            tokens, labels = batch
            logits = self.head(self.embed(tokens))
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)  # a local mean

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    # "16-mixed" on CPU falls back to bf16 without a scaler; the plugin keeps fp16 and its GradScaler.
    plugins = []
    if fp16_scaler:
        from lightning.pytorch.plugins import MixedPrecision

        plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp",
        max_steps=3,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=plugins,
        callbacks=[TokauditLightningCallback(log_dir, run_id="lightning")],
    )  # the one line
    trainer.fit(TinyLM(), DataLoader(Padded(), batch_size=2, shuffle=False))
    del trainer
    gc.collect()


def test_lightning_default_normalization_is_a_per_microbatch_local_mean(tmp_path: Path) -> None:
    from tokaudit._auditing import audit

    run_ddp(lightning_job, 2, str(tmp_path), timeout=240)
    report = audit([tmp_path / "lightning"])
    (run,) = report.runs
    assert report.problems == [] and run.steps == 3 and run.ranks == 2 and run.microbatches == 2
    finding = next(f for f in report.findings if f.code.value == "local_mean")
    # mean over the microbatch's own tokens, then ÷ accumulate_grad_batches: b·g = S/(n·M)
    assert finding.evidence["denominator"] == "n_micro*M" and finding.evidence["factor"] == 1.0
    assert run.verdict == "incorrect"


def test_lightning_16_mixed_divides_its_loss_scale_out(tmp_path: Path) -> None:
    from tests.logs import read_rows

    from tokaudit._auditing import audit

    run_ddp(lightning_job, 2, str(tmp_path), True, timeout=240)
    report = audit([tmp_path / "lightning"])
    (run,) = report.runs
    codes = {f.code.value for f in report.findings}
    assert "loss_scale" not in codes and "local_mean" in codes, codes  # the same mistake, no false alarm
    rows = read_rows(tmp_path / "lightning")
    assert {row["grad_scale"] for row in rows} == {2.0**-16}
