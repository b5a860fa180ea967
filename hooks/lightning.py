"""PyTorch Lightning: one callback records a run.

    trainer = L.Trainer(..., callbacks=[TokauditLightningCallback("runs")])

Every training cross-entropy call is captured with its probe, so tokaudit sees what Lightning's
own normalization (the loss divided by accumulate_grad_batches, DDP's average) did to each token.
Under "16-mixed" the precision plugin's GradScaler is found and followed.

Rank 0 logs the audit to the trainer's loggers (`trainer.loggers`) at train end (and every K steps
with `audit_every=K`; see `tokaudit.hooks.trackers`): TensorBoard, W&B and MLflow loggers get the
numbers and the text, other loggers the numbers through `log_metrics`. `trackers=[...]` chooses
them instead; `trackers=[]` turns it off.
"""

from __future__ import annotations

import os
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from tokaudit.hooks._attach import trainer_run_id, version_of
from tokaudit.hooks._recorder import Recorder

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback  # type: ignore[assignment,unused-ignore]


class TokauditLightningCallback(Callback):  # type: ignore[misc,unused-ignore]
    """Records a Lightning run to `log_dir` (one shard set per rank)."""

    def __init__(self, log_dir: str | os.PathLike[str], run_id: str | None = None, **recorder_options: Any) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.run_id = run_id
        self.recorder_options = recorder_options
        self.recorder: Recorder | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        wrapped = getattr(trainer.strategy, "model", None)
        ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        # "16-mixed": the precision plugin's GradScaler scales the loss; its scale is divided out and the
        # updates it skips are marked (Lightning still counts them as global steps).
        plugin = getattr(trainer.strategy, "precision_plugin", None)
        options = dict(self.recorder_options)
        options.setdefault("scaler", getattr(plugin, "scaler", None))
        if "trackers" not in options and trainer.is_global_zero:
            options["trackers"] = list(trainer.loggers)
        run_id = self.run_id or trainer_run_id(None)  # a logger's version may differ between ranks: not read
        self.recorder = Recorder(self.log_dir, run_id=run_id, model=ddp, optimizer=optimizer, **options)
        self.recorder.provenance.update(trainer="lightning", trainer_version=version_of("lightning"))
        self.recorder.start_capture()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.recorder is not None:
            self.recorder.begin_step(trainer.global_step)  # a resumed run keeps its step numbers

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.recorder is not None:
            self.recorder.close()  # also ends the capture
