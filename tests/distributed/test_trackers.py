"""Rank 0 of a real 2-process DDP run (gloo, CPU) logs the audit to TensorBoard, Weights & Biases
(offline) and MLflow (a local file store); each is read back after the run and must say what
`tokaudit.audit` says about the log."""

from __future__ import annotations

import json
import os
import struct
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from scenarios.harness import run_ddp, run_ddp_each
from scenarios.padded import padded_sequences
from tests.needs import needs

pytestmark = [needs("tensorboard", "wandb", "mlflow"), pytest.mark.distributed]

# Valid tokens per step, rank and microbatch: uneven, so a local mean is not the token mean.
COUNTS = (((5, 1), (3, 7)), ((2, 6), (6, 1)), ((8, 4), (2, 8)), ((1, 3), (7, 2)))
AUDIT_EVERY = 2


def offline_trackers(root: str) -> None:
    """No network: W&B offline under `root`, MLflow's file store (kept as an opt-in since MLflow 3)."""
    os.environ.update(
        {
            "WANDB_MODE": "offline",
            "WANDB_DIR": root,
            "WANDB_SILENT": "true",
            "WANDB_CONSOLE": "off",
            "MLFLOW_ALLOW_FILE_STORE": "true",
            "MLFLOW_TRACKING_URI": f"file://{root}/mlruns",
        }
    )


def ddp_job(rank: int, world_size: int, variant: str, root: str) -> dict[str, str]:
    """4 optimizer steps of 2 microbatches, b = W·S/N (token_mean) or S/(n·M) (local_mean); rank 0
    gives the Recorder its TensorBoard writer, W&B run and MLflow run."""
    offline_trackers(root)
    import mlflow
    import torch
    import wandb
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.tensorboard import SummaryWriter

    from scenarios.strategies import make_model, microbatch, per_token_loss
    from tokaudit.hooks import Recorder, global_valid_tokens, token_mean_loss

    found: dict[str, str] = {}
    trackers = None
    if rank == 0:
        writer = SummaryWriter(f"{root}/tensorboard/{variant}")
        wandb_run = wandb.init(
            project="tokaudit",
            name=variant,
            dir=root,
            settings=wandb.Settings(x_disable_stats=True, x_disable_meta=True),
        )
        mlflow_run = mlflow.start_run(run_name=variant)
        trackers = [writer, wandb_run, mlflow_run]
        found = {
            "wandb": str(Path(wandb_run.dir).parent / f"run-{wandb_run.id}.wandb"),
            "mlflow": mlflow_run.info.run_id,
        }
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    rec = Recorder(
        f"{root}/logs", run_id=variant, model=model, optimizer=optimizer, trackers=trackers, audit_every=AUDIT_EVERY
    )  # every rank: all of them flush at the same steps
    for step, per_rank in enumerate(COUNTS):
        batches = [microbatch(step, rank, micro, count) for micro, count in enumerate(per_rank[rank])]
        global_tokens = global_valid_tokens([labels for _, labels, _ in batches])
        for micro, (tokens, labels, valid) in enumerate(batches):
            with model.no_sync() if micro == 0 else nullcontext():
                per_token = rec.probe(per_token_loss(model, tokens, labels), valid)
                loss_sum = (per_token * valid).sum()
                if variant == "token_mean":
                    loss = token_mean_loss(loss_sum, global_tokens)  # W·S/N
                else:
                    loss = loss_sum / valid.sum() / len(batches)  # loss.mean() / accumulation steps
                rec.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=loss)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    rec.close()  # rank 0: the final audit, logged before the trackers close
    if rank == 0:
        writer.close()
        wandb_run.finish()
        mlflow.end_run()
        wandb.teardown()  # the W&B service process: a forked worker runs no atexit
    return found


@pytest.fixture(scope="session")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, str]]]:
    root = tmp_path_factory.mktemp("trackers")
    variants = ["token_mean", "local_mean"]  # in one set of processes
    found = {
        variant: ranks[0]
        for variant, ranks in zip(variants, run_ddp_each(ddp_job, 2, variants, str(root), timeout=180))
    }
    return root, found


def audited(log_dir: Path) -> Any:
    from tokaudit._auditing import audit

    (summary,) = audit([log_dir]).runs
    return summary


@pytest.mark.parametrize("variant, verdict", [("token_mean", "correct"), ("local_mean", "incorrect")])
def test_each_tracker_holds_the_audit_of_the_log(
    ddp_runs: tuple[Path, dict[str, dict[str, str]]], variant: str, verdict: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokaudit._auditing import audit
    from tokaudit.hooks.trackers import audit_metrics

    root, found = ddp_runs
    summary = audited(root / "logs" / variant)
    assert summary.verdict == verdict and summary.steps == len(COUNTS) and summary.ranks == 2
    final = audit_metrics(audit([root / "logs" / variant]))
    last_step = len(COUNTS)  # logged at the step after the last one recorded

    # TensorBoard: the audit started at step 2 (every rank flushed steps 0-1 there) and the final one.
    board = tensorboard_scalars(root / "tensorboard" / variant)
    assert [step for step, _ in board["tokaudit/verdict"]] == [AUDIT_EVERY, last_step]
    assert {key: values[-1][0] for key, values in board.items()} == {key: last_step for key in final.scalars}
    # (TensorBoard keeps float32)
    assert {key: values[-1][1] for key, values in board.items()} == pytest.approx(final.scalars, rel=1e-6)
    # Live: it covers at least steps 0-1, and whatever every rank had flushed when it ran.
    assert AUDIT_EVERY <= board["tokaudit/steps"][0][1] <= len(COUNTS)
    assert tensorboard_text(root / "tensorboard" / variant, "tokaudit/verdict_text") == verdict

    # W&B (offline): the numbers in the history and the summary, the text in the summary.
    history, wandb_summary = wandb_records(Path(found[variant]["wandb"]))
    assert wandb_summary["tokaudit/verdict_text"] == verdict
    assert wandb_summary["tokaudit/findings_text"] == final.text["tokaudit/findings_text"]
    assert {k: wandb_summary[k] for k in final.scalars} == pytest.approx(final.scalars)
    assert history[-1]["tokaudit/max_weight_ratio"] == pytest.approx(summary.max_weight_ratio)

    # MLflow (file store): each audit a metric at its step, the text as tags.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(f"file://{root}/mlruns")
    run_id = found[variant]["mlflow"]
    ratios = client.get_metric_history(run_id, "tokaudit/max_weight_ratio")
    assert [m.step for m in ratios] == [AUDIT_EVERY, last_step]
    assert ratios[-1].value == pytest.approx(summary.max_weight_ratio)
    run = client.get_run(run_id)
    assert run.data.metrics["tokaudit/verdict"] == {"correct": 0, "incorrect": 2}[verdict]
    assert run.data.tags["tokaudit/verdict_text"] == verdict
    assert run.data.tags["tokaudit/findings_text"] == final.text["tokaudit/findings_text"]
    if verdict == "incorrect":
        assert run.data.metrics["tokaudit/code/local_mean"] == 1
        assert summary.max_weight_ratio > 1.5


# ---------------------------------------------------------------- trainers find their own trackers


def trainer_job(rank: int, world_size: int, root: str) -> None:
    """transformers.Trainer with report_to TensorBoard, W&B and MLflow, and the one-line attach:
    without token averaging across devices (a rank-local mean), GA 2, 4 steps."""
    offline_trackers(root)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "TENSORBOARD_LOGGING_DIR": f"{root}/tensorboard",
            "WANDB_PROJECT": "tokaudit",
        }
    )
    import torch
    import wandb
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from tokaudit.hooks.huggingface import TokauditCallback

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    args = TrainingArguments(
        output_dir=f"{root}/out-{rank}",
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=["tensorboard", "wandb", "mlflow"],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        ddp_backend="gloo",
        average_tokens_across_devices=False,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=padded_sequences())
    TokauditCallback.attach(trainer, f"{root}/logs", run_id="hf", audit_every=AUDIT_EVERY)  # the one line
    trainer.train()
    if rank == 0:  # what the end of a script does (a forked worker runs no atexit)
        wandb.finish()
        wandb.teardown()


def lightning_job(rank: int, world_size: int, root: str) -> None:
    """Lightning with TensorBoard, W&B and MLflow loggers: F.cross_entropy's mean per microbatch,
    accumulate_grad_batches=2, 4 steps."""
    offline_trackers(root)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29556",
        }
    )
    import lightning as L
    import torch
    import torch.nn.functional as F
    import wandb
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
    from torch.utils.data import DataLoader

    from tokaudit.hooks.lightning import TokauditLightningCallback

    class TinyLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(64, 16)
            self.head = torch.nn.Linear(16, 64)

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            logits = self.head(self.embed(batch["input_ids"]))
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    loggers = [
        TensorBoardLogger(f"{root}/tensorboard", name="", version=""),
        WandbLogger(project="tokaudit", save_dir=root, offline=True),
        MLFlowLogger(tracking_uri=f"file://{root}/mlruns"),
    ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp",
        max_steps=4,
        accumulate_grad_batches=2,
        logger=loggers,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TokauditLightningCallback(f"{root}/logs", run_id="lightning", audit_every=AUDIT_EVERY)],
    )  # the one line
    trainer.fit(TinyLM(), DataLoader(padded_sequences(), batch_size=2, shuffle=False))
    if rank == 0:
        wandb.finish()
        wandb.teardown()


def accelerate_job(rank: int, world_size: int, root: str) -> None:
    """An Accelerate loop with log_with TensorBoard, W&B and MLflow: Recorder(accelerator=...) logs
    to the trackers of init_trackers by itself; Accelerate's usual per-microbatch mean, GA 2."""
    offline_trackers(root)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29557",
        }
    )
    import torch
    import wandb
    from accelerate import Accelerator

    from scenarios.strategies import make_model, microbatch, per_token_loss
    from tokaudit.hooks import Recorder

    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=2,
        log_with=["tensorboard", "wandb", "mlflow"],
        project_dir=f"{root}/tensorboard",
    )
    accelerator.init_trackers("accelerate")
    model, optimizer = accelerator.prepare(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.5))
    recorder = Recorder(f"{root}/logs", run_id="accelerate", accelerator=accelerator, audit_every=AUDIT_EVERY)
    for step, per_rank in enumerate(COUNTS):
        for micro, count in enumerate(per_rank[rank]):
            tokens, labels, valid = microbatch(step, rank, micro, count)
            with accelerator.accumulate(model):
                per_token = recorder.probe(per_token_loss(model, tokens, labels), valid)
                loss = (per_token * valid).sum() / valid.sum()
                recorder.record(loss_sum=(per_token * valid).sum(), valid_tokens=valid.sum(), backward_scalar=loss)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    recorder.close()  # before the trackers finish
    for tracker in accelerator.trackers:  # end_training() without its destroy_process_group (the harness's)
        tracker.finish()
    if rank == 0:
        wandb.teardown()


@pytest.mark.integration
@pytest.mark.parametrize(
    "job, run, loss_tag",
    [
        (trainer_job, "hf", "train/loss"),
        (lightning_job, "lightning", "train_loss"),
        (accelerate_job, "accelerate", None),
    ],
)
def test_trainer_callbacks_log_to_the_trainers_own_trackers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: Any, run: str, loss_tag: str | None
) -> None:
    pytest.importorskip({"hf": "transformers", "lightning": "lightning", "accelerate": "accelerate"}[run])
    from mlflow.tracking import MlflowClient

    from tokaudit._auditing import audit
    from tokaudit.hooks.trackers import audit_metrics

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    MlflowClient(
        f"file://{tmp_path}/mlruns"
    )  # the store and its default experiment made once: two ranks making it race
    run_ddp(job, 2, str(tmp_path), timeout=240)
    report = audit([tmp_path / "logs" / run])
    (summary,) = report.runs
    assert summary.verdict == "incorrect" and summary.steps == 4 and summary.ranks == 2
    assert "local_mean" in {f.code.value for f in report.findings}
    final = audit_metrics(report)

    board = tensorboard_scalars(next(p.parent for p in (tmp_path / "tensorboard").rglob("events.out.tfevents.*")))
    assert [step for step, _ in board["tokaudit/verdict"]] == [AUDIT_EVERY, 4]
    assert board["tokaudit/max_weight_ratio"][-1][1] == pytest.approx(summary.max_weight_ratio, rel=1e-6)
    assert loss_tag is None or loss_tag in board, "the trainer's own writer"
    assert (
        tensorboard_text(
            next(p.parent for p in (tmp_path / "tensorboard").rglob("events.out.tfevents.*")), "tokaudit/findings_text"
        )
        == final.text["tokaudit/findings_text"]
    )

    (wandb_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    _, wandb_summary = wandb_records(wandb_file)
    assert wandb_summary["tokaudit/verdict_text"] == "incorrect"
    assert wandb_summary["tokaudit/max_weight_ratio"] == pytest.approx(summary.max_weight_ratio)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(f"file://{tmp_path}/mlruns")
    (mlflow_run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "tokaudit/verdict")] == [AUDIT_EVERY, 4]
    assert mlflow_run.data.metrics["tokaudit/max_weight_ratio"] == pytest.approx(summary.max_weight_ratio)
    assert mlflow_run.data.tags["tokaudit/findings_text"] == final.text["tokaudit/findings_text"]


# ---------------------------------------------------------------- reading each tracker back


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_text(folder: Path, tag: str) -> str:
    """The last text logged under `tag`, without the indentation that keeps it literal."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors(f"{tag}/text_summary")[-1].tensor_proto.string_val[0].decode()
    return "\n".join(line.removeprefix("    ") for line in text.splitlines())


def wandb_records(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """History rows and the final summary of an offline run's transaction log (`run-<id>.wandb`):
    a LevelDB-style log of W&B `Record` protobufs (7-byte header ':W&B', 0xBEE1, version; then in
    32 KiB blocks, chunks of crc32 (4), length (2), type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, position, pieces = 32768, 7, []
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pieces.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind not in (1, 4):
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(b"".join(pieces))
        pieces = []
        which = record.WhichOneof("record_type")
        if which == "history":
            history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        elif which == "summary":
            summary.update(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.summary.update}
            )
    return history, summary
