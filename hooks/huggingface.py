"""Hugging Face `transformers.Trainer` (and TRL's SFTTrainer, `tokaudit.hooks._trl_trainers`): one line records a run.

    TokauditCallback.attach(trainer, "runs")      # before trainer.train()

Every training cross-entropy call is captured with its probe (evaluation runs without grad and is
not recorded), so the weight each token received is measured whatever the Trainer and the model do
with the loss: num_items_in_batch, the ×W of average_tokens_across_devices, ÷GAS, auxiliary terms.
Under fp16 the Trainer's GradScaler (`trainer.accelerator.scaler`) is found and followed. With
`label_smoothing_factor`, the Trainer's LabelSmoother (log_softmax and gather, no cross-entropy call) is
wrapped the same way: it returns what it would, and its loss is recorded and probed.

With `attach`, the trackers of `report_to` (TensorBoard's writer, the W&B run, the MLflow run) are
found at train begin, and rank 0 logs the audit to them at train end (and every K steps with
`audit_every=K`; see `tokaudit.hooks.trackers`). `trackers=[...]` chooses them instead; `trackers=[]`
turns it off.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from tokaudit.hooks._capture import record_mean, reraise_control
from tokaudit.hooks._attach import ddp_around, trainer_run_id, version_of
from tokaudit.hooks._recorder import Recorder
from tokaudit.hooks._trl_trainers import refused, trl_trainer, watch_fused_head


class TokauditCallback(TrainerCallback):  # type: ignore[misc,unused-ignore]
    """Records a Trainer run to `log_dir` (one shard set per rank)."""

    def __init__(
        self, log_dir: str | os.PathLike[str], run_id: str | None = None, trainer: Any = None, **recorder_options: Any
    ) -> None:
        self.log_dir = log_dir
        self.run_id = run_id
        self.trainer = trainer
        self.recorder_options = recorder_options
        self.recorder: Recorder | None = None
        self.hooks: list[Any] = []

    @classmethod
    def attach(
        cls, trainer: Any, log_dir: str | os.PathLike[str], run_id: str | None = None, **recorder_options: Any
    ) -> TokauditCallback:
        """Add the callback to `trainer`, with access to its DDP-wrapped model (for the sync flag)."""
        callback = cls(log_dir, run_id=run_id, trainer=trainer, **recorder_options)
        trainer.add_callback(callback)
        return callback

    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        trl = trl_trainer(self.trainer, args)
        if (why := refused(trl, args)) is not None:
            warnings.warn(why, RuntimeWarning, stacklevel=2)
            return
        wrapped = getattr(self.trainer, "model_wrapped", None) if self.trainer is not None else None
        if not isinstance(wrapped, DistributedDataParallel) and model is not None:
            wrapped = ddp_around(model)  # given as callbacks=[...]: no trainer, the DDP wrapper found around its model
        ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
        # Accelerate wraps the optimizer; its step() reaches the torch optimizer once per update.
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)
        # fp16: Accelerate's GradScaler multiplies the loss before backward; its scale is divided out and
        # the updates it skips are marked (the Trainer still counts them as global steps).
        accelerator = getattr(self.trainer, "accelerator", None) if self.trainer is not None else None
        options = dict(self.recorder_options)
        options.setdefault("scaler", getattr(accelerator, "scaler", None))
        if "trackers" not in options and self.trainer is not None and state.is_world_process_zero:
            options["trackers"] = report_to_trackers(self.trainer)
        run_id = self.run_id or trainer_run_id(getattr(args, "run_name", None))  # never another launch's name
        self.recorder = Recorder(self.log_dir, run_id=run_id, model=ddp, optimizer=torch_optimizer, **options)
        self.recorder.provenance.update(trainer="transformers", trainer_version=version_of("transformers"))
        self.recorder.start_capture()
        if trl is not None and model is not None:  # SFTTrainer: the loss comes from its fused LM head
            self.recorder.provenance.update(trl=version_of("trl"))
            self.hooks.append(watch_fused_head(self.recorder, model))
        smoother = getattr(self.trainer, "label_smoother", None) if self.trainer is not None else None
        if smoother is not None and not isinstance(smoother, RecordedSmoother):
            self.trainer.label_smoother = RecordedSmoother(smoother, self.recorder)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.begin_step(state.global_step)  # a resumed run keeps its step numbers

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # The logged loss averages the updates since the last log; it is one step's loss only
        # when logging every step.
        if self.recorder is not None and logs and "loss" in logs and args.logging_steps == 1:
            self.recorder.report_loss(float(logs["loss"]), step=state.global_step - 1)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.close()  # also ends the capture
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        smoother = getattr(self.trainer, "label_smoother", None) if self.trainer is not None else None
        if isinstance(smoother, RecordedSmoother):
            self.trainer.label_smoother = smoother.smoother


class RecordedSmoother:
    """The Trainer's LabelSmoother, recorded: it returns exactly what the smoother returns. The smoother's loss
    is Σᵢ ℓᵢ / D over the labels that are not ignore_index, with ℓᵢ = (1 − ε)·nllᵢ + (ε/V)·Σ_v −log pᵢᵥ and D
    num_items_in_batch (else those labels' count), so S = loss·D, n = the labels counted, and every counted
    token gets ∂b/∂loss / D (`capture.record_mean`)."""

    def __init__(self, smoother: Any, recorder: Recorder) -> None:
        self.smoother = smoother
        self.recorder = recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.smoother, name)  # epsilon, ignore_index: as the Trainer's own

    def __call__(
        self, model_output: Any, labels: torch.Tensor, shift_labels: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        out = self.smoother(model_output, labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
        if not (torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad):
            return out
        try:
            target = labels[..., 1:] if shift_labels else labels
            valid = target != self.smoother.ignore_index
            valid_count = valid.sum()
            if num_items_in_batch is None:
                denominator = valid_count.to(out.dtype)
            else:
                denominator = torch.as_tensor(num_items_in_batch, device=out.device).to(out.dtype)
            return record_mean(self.recorder, out, valid, valid_count, target, denominator)
        except Exception as error:
            reraise_control(error)
            self.recorder.warn_once("smoother", f"tokaudit: a label-smoothed loss was not recorded ({error!r})")
            return out


def report_to_trackers(trainer: Any) -> list[Any]:
    """The trackers the Trainer's `report_to` callbacks opened (read after their on_train_begin, on
    the world's process zero): TensorBoardCallback's writer, WandbCallback's run, MLflowCallback's run."""
    try:
        from transformers.integrations.integration_utils import MLflowCallback, TensorBoardCallback, WandbCallback

        found: list[Any] = []
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
                found.append(callback.tb_writer)  # closed at train end: the audit reopens and closes it
            elif isinstance(callback, WandbCallback) and getattr(callback._wandb, "run", None) is not None:
                found.append(callback._wandb.run)
            elif isinstance(callback, MLflowCallback) and callback._initialized:
                run = callback._ml_flow.active_run()  # ended at train end: logged to by its id
                if run is not None:
                    found.append(run)
        return found
    except Exception as error:
        warnings.warn(
            f"tokaudit: cannot find the Trainer's trackers ({error!r}); pass trackers=[...]",
            RuntimeWarning,
            stacklevel=2,
        )
        return []
