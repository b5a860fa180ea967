"""Which Hugging Face Trainer set-ups train the token mean: one cell a set-up, a tiny real Trainer run on
2 gloo ranks with gradient accumulation 2, recorded by `TokauditCallback.attach`, and each update's
gradient set beside a float64 reference of the token-mean objective on the same tokens.

The truth is the gradient, never tokaudit's algebra: on each update the Trainer's gradient g (after
DDP's average, before the optimizer) is compared with ∇L, L = Σᵢ ℓᵢ / N over every valid label of the
update's microbatches on every rank, ℓᵢ each label's cross-entropy (with label smoothing ε:
(1 − ε)·nllᵢ + ε·mean_v(−log pᵢᵥ)), N their count, computed again in float64 from the same weights and
inputs. `scripts/trainer_matrix.py` runs the cells and writes docs/trainer-matrix.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from scenarios.harness import run_ddp, run_ddp_each

MAX_STEPS = 4
GRADIENT_ACCUMULATION = 2
TOLERANCE = 1e-4
"""Largest |g − ∇L| / max|∇L| of a correct update: float32 training against float64 (measured ≤ 1e-6)."""

CAUSAL = ("llama", "qwen2", "mistral", "gemma", "gpt2")


@dataclass(frozen=True)
class Cell:
    """One set-up of the matrix."""

    name: str
    family: str
    """The tiny model: llama, qwen2, mistral, gemma, gpt2, t5, bart or bert."""
    average_tokens: bool
    """TrainingArguments.average_tokens_across_devices."""
    loss: str = "model"
    """model: the model's own loss; mean or sum: a compute_loss_func returning its own mean, or Σℓ /
    num_items_in_batch; no_kwargs: the model behind a forward that takes no **kwargs."""
    smoothing: float = 0.0
    """label_smoothing_factor."""
    loss_type: str | None = None
    """The model's loss_type attribute, where set (the Trainer reads it to count labels after the shift)."""
    trainer: str = "transformers"
    """transformers (the Trainer), trl (TRL's SFTTrainer), lightning or accelerate: each with its users' usual
    loop. For trl, `loss` is the data set-up: model (language modelling), completion (prompt-completion
    data, completion-only loss), packing (bfd packing, padding-free) or padding_free."""
    checkpointing: bool = False
    """TrainingArguments.gradient_checkpointing (activation checkpointing)."""
    callbacks: bool = False
    """Recorded by the callback given to the trainer as `callbacks=[TokauditCallback(...)]`, not by `attach`: it sees
    the trainer's arguments and model, never the trainer."""

    @property
    def setup(self) -> str:
        """The set-up in words, for the table."""
        if self.trainer == "lightning" and self.loss == "sum":
            return (
                "Lightning: manual optimization, each batch one update's microbatches, `manual_backward(W·S/N)` "
                "with N counted over them first (the recipe `tokaudit explain local_mean` prints)"
            )
        if self.trainer == "lightning":
            return (
                f"Lightning: `training_step` returns the `{self.family}` model's own loss (its mean), "
                f"`accumulate_grad_batches={GRADIENT_ACCUMULATION}`"
            )
        if self.trainer == "trl":
            data = {
                "model": "language-modelling data",
                "completion": "prompt-completion data (`completion_only_loss`)",
                "assistant": "conversations (`assistant_only_loss`, a chat template with generation marks)",
                "packing": "`packing=True` (bfd, padding-free)",
                "padding_free": "`padding_free=True`",
            }[self.loss]
            given = ", recorded by `callbacks=[TokauditCallback(...)]`" if self.callbacks else ""
            return (
                f"TRL `SFTTrainer` (its fused LM head) on the `{self.family}` model, {data}, "
                f"`average_tokens_across_devices={self.average_tokens}`{given}"
            )
        if self.trainer == "torchtune":
            if self.loss == "before_shift":
                return (
                    "torchtune's recipe as 0.6 writes it: each microbatch's mean cross-entropy over the shifted "
                    'labels times its count of `batch["labels"]` taken before the shift, `backward()`, then '
                    "`training.scale_grads(model, W/N)` with N the sum of those counts, told with `rec.scale_grads`"
                )
            scale = {
                "sum": "`training.scale_grads(model, W/N)`",
                "missing_w": "`training.scale_grads(model, 1/N)` (the W left out)",
            }[self.loss]
            return (
                f"torchtune's recipe: the chunked cross-entropy summed, `backward()`, then {scale} after the "
                "update's last microbatch, told to the recorder with `rec.scale_grads`"
            )
        if self.trainer == "accelerate" and self.loss == "sum":
            return (
                f"Accelerate: `accelerator.backward(M·W·S/N)` (S the summed cross-entropy, N all-reduced over the "
                f"update's microbatches first) under `accumulate`, `gradient_accumulation_steps={GRADIENT_ACCUMULATION}`"
            )
        if self.trainer == "accelerate":
            return (
                f"Accelerate: `accelerator.backward(loss)` of the `{self.family}` model's own loss (its mean) "
                f"under `accumulate`, `gradient_accumulation_steps={GRADIENT_ACCUMULATION}`"
            )
        model = {
            "model": f"`{self.family}`",
            "mean": f"`{self.family}`, `compute_loss_func` returning its own mean",
            "sum": f"`{self.family}`, `compute_loss_func` summing and dividing by `num_items_in_batch`",
            "no_kwargs": f"`{self.family}` behind a `forward` without `**kwargs`",
        }[self.loss]
        smoothing = f", `label_smoothing_factor={self.smoothing}`" if self.smoothing else ""
        loss_type = f' with `model.loss_type = "{self.loss_type}"`' if self.loss_type else ""
        checkpointing = ", `gradient_checkpointing=True`" if self.checkpointing else ""
        return f"{model}{loss_type}{smoothing}{checkpointing}, `average_tokens_across_devices={self.average_tokens}`"


CELLS = (
    Cell("llama", "llama", True),
    Cell("llama-no-average", "llama", False),
    Cell("llama-smoothing", "llama", True, smoothing=0.1),
    Cell("llama-checkpointing", "llama", True, checkpointing=True),
    Cell("qwen2", "qwen2", True),
    Cell("mistral", "mistral", True),
    Cell("gemma", "gemma", True),
    Cell("gpt2", "gpt2", True),
    Cell("gpt2-no-average", "gpt2", False),
    Cell("gpt2-loss-type", "gpt2", True, loss_type="ForCausalLM"),
    Cell("gpt2-smoothing", "gpt2", True, smoothing=0.1),
    Cell("t5", "t5", True),
    Cell("bart", "bart", True),
    Cell("bert", "bert", True),
    Cell("bert-no-average", "bert", False),
    Cell("custom-mean", "llama", True, loss="mean"),
    Cell("custom-sum", "llama", True, loss="sum"),
    Cell("custom-sum-gpt2", "gpt2", True, loss="sum", loss_type="ForCausalLM"),
    Cell("no-kwargs", "llama", True, loss="no_kwargs"),
    Cell("lightning", "llama", False, trainer="lightning"),
    Cell("lightning-token-mean", "llama", False, loss="sum", trainer="lightning"),
    Cell("accelerate", "llama", False, trainer="accelerate"),
    Cell("accelerate-sum", "llama", False, loss="sum", trainer="accelerate"),
    Cell("torchtune", "llama", False, loss="sum", trainer="torchtune"),
    Cell("torchtune-missing-w", "llama", False, loss="missing_w", trainer="torchtune"),
    Cell("torchtune-before-shift", "llama", False, loss="before_shift", trainer="torchtune"),
    Cell("trl-sft", "llama", True, trainer="trl"),
    Cell("trl-sft-no-average", "llama", False, trainer="trl"),
    Cell("trl-sft-completion", "llama", True, loss="completion", trainer="trl"),
    Cell("trl-sft-assistant-only", "llama", True, loss="assistant", trainer="trl"),
    Cell("trl-sft-packing", "llama", True, loss="packing", trainer="trl"),
    Cell("trl-sft-padding-free", "llama", True, loss="padding_free", trainer="trl"),
    Cell("trl-sft-callbacks", "llama", True, trainer="trl", callbacks=True),
)
CELLS_BY_NAME = {cell.name: cell for cell in CELLS}


class NoKwargs(torch.nn.Module):
    """A model whose forward takes no **kwargs: the Trainer passes it no num_items_in_batch."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> Any:
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def tiny_model(cell: Cell) -> torch.nn.Module:
    """The cell's model, seeded, without dropout (a reference must see the same function)."""
    import transformers as hf

    torch.manual_seed(0)
    decoder = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
    }
    configs = {
        "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**decoder)),
        "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**decoder)),
        "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(**decoder)),
        "gemma": lambda: hf.GemmaForCausalLM(hf.GemmaConfig(**decoder, head_dim=8)),
        "gpt2": lambda: hf.GPT2LMHeadModel(
            hf.GPT2Config(
                vocab_size=64,
                n_positions=32,
                n_embd=16,
                n_layer=1,
                n_head=2,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=1,
                eos_token_id=2,
            )
        ),
        "t5": lambda: hf.T5ForConditionalGeneration(
            hf.T5Config(
                vocab_size=64,
                d_model=16,
                d_kv=8,
                d_ff=32,
                num_layers=1,
                num_heads=2,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        ),
        "bart": lambda: hf.BartForConditionalGeneration(
            hf.BartConfig(
                vocab_size=64,
                d_model=16,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=32,
                decoder_ffn_dim=32,
                max_position_embeddings=32,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=2,
                forced_eos_token_id=None,
            )
        ),
        "bert": lambda: hf.BertForMaskedLM(
            hf.BertConfig(
                vocab_size=64,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                max_position_embeddings=32,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        ),
    }
    model = configs[cell.family]()
    if cell.loss_type is not None:
        model.loss_type = cell.loss_type
    return NoKwargs(model) if cell.loss == "no_kwargs" else model


def token_losses(cell: Cell, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ℓᵢ of every position, which positions are valid labels): a causal LM predicts the next token."""
    if cell.family in CAUSAL:
        logits, labels = logits[:, :-1], labels[:, 1:]
    valid = labels != -100
    log_probs = F.log_softmax(logits, dim=-1)
    nll = -log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = (1 - cell.smoothing) * nll + cell.smoothing * -log_probs.mean(dim=-1)
    return per_token * valid, valid


def loss_function(cell: Cell) -> Any:
    """The compute_loss_func of a `mean` or `sum` cell (None for the others)."""
    if cell.loss not in ("mean", "sum"):
        return None

    def compute_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        logits, target = outputs.logits[:, :-1], labels[:, 1:]
        if cell.loss == "mean":
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")
        return summed / num_items_in_batch

    return compute_loss


def matrix_job(rank: int, world_size: int, cell: Cell, root: str) -> None:
    """One rank of a cell's run, recorded by its trainer's one line; saves each microbatch's inputs and, on
    rank 0, each update's weights and gradient (after DDP's average, before the optimizer) to
    root/<cell>/rank-<r>.pt."""
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29561",
        }
    )
    saved: dict[str, list[Any]] = {"inputs": [], "weights": [], "gradients": []}
    runs = {
        "transformers": _trainer_run,
        "lightning": _lightning_run,
        "accelerate": _accelerate_run,
        "trl": _trl_run,
        "torchtune": _torchtune_run,
    }
    runs[cell.trainer](rank, root, cell, saved)
    Path(root, cell.name).mkdir(parents=True, exist_ok=True)
    torch.save(saved, Path(root, cell.name, f"rank-{rank}.pt"))


def _keep_update(saved: dict[str, list[Any]], model: torch.nn.Module) -> None:
    """The weights and gradient of the update about to be taken."""
    named = list(model.named_parameters())
    saved["weights"].append({name: p.detach().double().clone() for name, p in named})
    saved["gradients"].append(
        {name: (torch.zeros_like(p) if p.grad is None else p.grad).double().clone() for name, p in named}
    )


def _trainer_run(rank: int, root: str, cell: Cell, saved: dict[str, list[Any]]) -> None:
    from transformers import Trainer, TrainingArguments

    from scenarios.padded import padded_sequences

    args = TrainingArguments(
        output_dir=f"{root}/out-{cell.name}-{rank}",
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=GRADIENT_ACCUMULATION,
        max_steps=MAX_STEPS,
        learning_rate=1e-2,
        max_grad_norm=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        average_tokens_across_devices=cell.average_tokens,
        dataloader_num_workers=0,
        label_smoothing_factor=cell.smoothing,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        gradient_checkpointing=cell.checkpointing,
    )
    trainer = Trainer(
        model=tiny_model(cell), args=args, train_dataset=padded_sequences(), compute_loss_func=loss_function(cell)
    )
    _train_recorded(trainer, rank, root, cell, saved)


def _train_recorded(trainer: Any, rank: int, root: str, cell: Cell, saved: dict[str, list[Any]]) -> None:
    """A Hugging Face (or TRL) trainer run with the one-line attach, keeping each microbatch's inputs and, on rank 0,
    each update's weights and gradient (before the optimizer)."""
    from transformers import TrainerCallback

    from tokaudit.hooks.huggingface import TokauditCallback

    class Gradients(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if rank == 0:
                _keep_update(saved, model)

    step = trainer.training_step

    def training_step(model: Any, inputs: dict[str, Any], *rest: Any, **options: Any) -> Any:
        saved["inputs"].append(
            {key: value.detach().clone() for key, value in inputs.items() if isinstance(value, torch.Tensor)}
        )
        return step(model, inputs, *rest, **options)

    trainer.add_callback(Gradients())
    trainer.training_step = training_step
    if cell.callbacks:  # as `callbacks=[...]` gives it: no trainer, its arguments and model at train begin
        trainer.add_callback(TokauditCallback(f"{root}/logs", run_id=cell.name))
    else:
        TokauditCallback.attach(trainer, f"{root}/logs", run_id=cell.name)  # the one line
    trainer.train()


def _trl_run(rank: int, root: str, cell: Cell, saved: dict[str, list[Any]]) -> None:
    """TRL's SFTTrainer on pre-tokenized data: its collator builds the labels (completion-only, packed)."""
    import datasets
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import SFTConfig, SFTTrainer

    # word i is token i; a conversation's marks take the last ids of the tiny model's 64
    vocabulary = {f"t{i}": i for i in range(60)} | {"<user>": 60, "<assistant>": 61, "<end>": 62}
    words = Tokenizer(models.WordLevel(vocabulary, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<user> {{ m['content'] }} <end> {% else %}<assistant> "
        "{% generation %}{{ m['content'] }} <end>{% endgeneration %} {% endif %}{% endfor %}"
    )
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(200 if cell.loss == "packing" else 48):  # packed rows: enough for every update's microbatches
        length = int(torch.randint(3, 14, (), generator=generator))
        ids = torch.randint(4, 60, (length,), generator=generator).tolist()
        prompt = int(torch.randint(1, length - 1, (), generator=generator))
        if cell.loss == "assistant":
            said = [" ".join(f"t{i}" for i in part) for part in (ids[:prompt], ids[prompt:])]
            rows.append({"messages": [{"role": "user", "content": said[0]}, {"role": "assistant", "content": said[1]}]})
        else:
            rows.append(
                {"input_ids": ids, "completion_mask": [0] * prompt + [1] * (length - prompt)}
                if cell.loss == "completion"
                else {"input_ids": ids}
            )
    args = SFTConfig(
        output_dir=f"{root}/out-{cell.name}-{rank}",
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=GRADIENT_ACCUMULATION,
        max_steps=MAX_STEPS,
        learning_rate=1e-2,
        max_grad_norm=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        average_tokens_across_devices=cell.average_tokens,
        dataloader_num_workers=0,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        packing=cell.loss == "packing",
        max_length=None if cell.loss == "padding_free" else 24,
        padding_free=cell.loss == "padding_free",
        completion_only_loss=cell.loss == "completion" or None,
        assistant_only_loss=cell.loss == "assistant",
        bf16=False,
    )  # float32 like every other cell (TRL's default is bf16 where supported)
    trainer = SFTTrainer(
        model=tiny_model(cell), args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
    )
    _train_recorded(trainer, rank, root, cell, saved)


def _lightning_run(rank: int, root: str, cell: Cell, saved: dict[str, list[Any]]) -> None:
    """Lightning joins the process group the harness made (the environment torchrun would set)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from scenarios.padded import padded_sequences
    from tokaudit.hooks.lightning import TokauditLightningCallback

    if cell.loss == "sum":
        _lightning_token_mean(rank, root, cell, saved)
        return

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_model(cell)

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            saved["inputs"].append({key: value.detach().clone() for key, value in batch.items()})
            return self.model(**batch).loss  # the model's own mean over this microbatch's labels

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if rank == 0:
                _keep_update(saved, self.model)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy="ddp",
        max_steps=MAX_STEPS,
        accumulate_grad_batches=GRADIENT_ACCUMULATION,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TokauditLightningCallback(f"{root}/logs", run_id=cell.name)],
    )  # the one line
    trainer.fit(Module(), DataLoader(padded_sequences(), batch_size=2, shuffle=False))


def _lightning_token_mean(rank: int, root: str, cell: Cell, saved: dict[str, list[Any]]) -> None:
    """`tokaudit._recipes.LIGHTNING` as written there: each DataLoader item is one update's microbatches."""
    import lightning as L
    from torch.utils.data import DataLoader, Dataset
    from torch.utils.data import default_collate

    from scenarios.padded import padded_sequences
    from tokaudit.hooks import global_valid_tokens, token_mean_loss
    from tokaudit.hooks.lightning import TokauditLightningCallback

    sequences = padded_sequences()

    class Updates(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return len(sequences) // (2 * GRADIENT_ACCUMULATION)

        def __getitem__(self, index: int) -> list[dict[str, torch.Tensor]]:
            first = index * 2 * GRADIENT_ACCUMULATION
            return [
                default_collate([sequences[first + 2 * m], sequences[first + 2 * m + 1]])
                for m in range(GRADIENT_ACCUMULATION)
            ]

    class TokenMean(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.automatic_optimization = tiny_model(cell), False

        def training_step(self, batches: list[dict[str, torch.Tensor]], index: int) -> None:
            saved["inputs"].extend({key: value.detach().clone() for key, value in b.items()} for b in batches)
            N = global_valid_tokens([b["labels"][:, 1:] for b in batches])
            for b in batches:
                logits = self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                loss_sum = F.cross_entropy(
                    logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(), ignore_index=-100, reduction="sum"
                )
                self.manual_backward(token_mean_loss(loss_sum, N))
            if rank == 0:
                _keep_update(saved, self.model)
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy="ddp",
        max_steps=MAX_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TokauditLightningCallback(f"{root}/logs", run_id=cell.name)],
    )
    trainer.fit(TokenMean(), DataLoader(Updates(), batch_size=None, shuffle=False))


def _accelerate_run(rank: int, root: str, cell: Cell, saved: dict[str, list[Any]]) -> None:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from scenarios.padded import padded_sequences
    from tokaudit.hooks import Recorder

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=GRADIENT_ACCUMULATION)
    model = tiny_model(cell)
    model, optimizer, batches = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=1e-2), DataLoader(padded_sequences(), batch_size=2, shuffle=False)
    )
    recorder = Recorder(f"{root}/logs", run_id=cell.name, accelerator=accelerator)  # the one line
    recorder.start_capture()  # and every cross-entropy of the model's loss is recorded
    listed = [batch for _, batch in zip(range(MAX_STEPS * GRADIENT_ACCUMULATION), batches)]
    for start in range(0, len(listed), GRADIENT_ACCUMULATION):
        update = listed[start : start + GRADIENT_ACCUMULATION]
        # N: the update's labels after the causal shift, on every rank, counted before the first backward
        tokens = torch.stack([(batch["labels"][:, 1:] != -100).sum() for batch in update]).sum().double()
        torch.distributed.all_reduce(tokens)
        for batch in update:
            saved["inputs"].append({key: value.detach().clone() for key, value in batch.items()})
            with accelerator.accumulate(model):
                if cell.loss == "sum":  # M·W·S/N: Accelerate divides by M, DDP averages over W
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    summed = F.cross_entropy(
                        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), reduction="sum"
                    )
                    loss = GRADIENT_ACCUMULATION * accelerator.num_processes * summed / tokens
                else:
                    loss = model(**batch).loss  # Accelerate divides it by the accumulation steps
                accelerator.backward(loss)
                if accelerator.sync_gradients and rank == 0:
                    _keep_update(saved, accelerator.unwrap_model(model))
                optimizer.step()
                optimizer.zero_grad()
    recorder.close()


def _torchtune_run(rank: int, root: str, cell: Cell, saved: dict[str, list[Any]]) -> None:
    """torchtune's full_finetune_distributed loop as it writes it (`scenarios.torchtune_recipe` on a real DDP LM):
    a summed, chunked cross-entropy over the shifted labels, backward per microbatch, then after the update's last
    one N all-reduced and every gradient multiplied by W/N (`training.scale_grads`), told with rec.scale_grads."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from scenarios.padded import padded_sequences
    from scenarios.torchtune_recipe import scale_grads
    from tokaudit.hooks import Recorder

    world = torch.distributed.get_world_size()
    model = DDP(tiny_model(cell))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    batches = DataLoader(
        padded_sequences(),
        batch_size=2,
        shuffle=False,
        sampler=torch.utils.data.distributed.DistributedSampler(padded_sequences(), shuffle=False),
    )
    listed = [batch for _, batch in zip(range(MAX_STEPS * GRADIENT_ACCUMULATION), batches)]
    with (
        Recorder(f"{root}/logs", run_id=cell.name, model=model, optimizer=optimizer, announce=False) as rec,
        rec.capture_cross_entropy(),
    ):
        for start in range(0, len(listed), GRADIENT_ACCUMULATION):
            tokens = torch.zeros((), dtype=torch.int64)
            for batch in listed[start : start + GRADIENT_ACCUMULATION]:
                saved["inputs"].append({key: value.detach().clone() for key, value in batch.items()})
                labels = batch["labels"][:, 1:]
                shifted = (labels != -100).sum()
                # torchtune 0.6 counts batch["labels"] before _loss_step shifts them: a label more per row
                counted = (batch["labels"] != -100).sum() if cell.loss == "before_shift" else shifted
                tokens += counted
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
                total = sum(
                    F.cross_entropy(lg.flatten(0, 1), lb.flatten(), ignore_index=-100, reduction="sum")
                    for lg, lb in zip(logits.chunk(2, dim=1), labels.chunk(2, dim=1))
                )
                (total / shifted * counted).backward()  # type: ignore[operator, union-attr]
            torch.distributed.all_reduce(tokens)
            factor = (1 if cell.loss == "missing_w" else world) / tokens.to(torch.float32)
            scale_grads(model, factor)
            rec.scale_grads(factor)
            if rank == 0:
                _keep_update(saved, model.module)
            optimizer.step()
            optimizer.zero_grad()


def deviations(cell: Cell, root: str, world_size: int = 2) -> list[tuple[float, float]]:
    """Per update: (|g − ∇L|max / |∇L|max, the scale ⟨g, ∇L⟩ / ⟨∇L, ∇L⟩), ∇L the float64 token-mean
    gradient of the same weights on the same microbatches of every rank."""
    ranks = [torch.load(Path(root, cell.name, f"rank-{rank}.pt")) for rank in range(world_size)]
    model = tiny_model(cell).double()
    found = []
    for update, (weights, gradient) in enumerate(zip(ranks[0]["weights"], ranks[0]["gradients"])):
        model.load_state_dict(weights, strict=False)
        model.zero_grad()
        total, count = torch.zeros((), dtype=torch.float64), 0
        for saved in ranks:
            for inputs in saved["inputs"][update * GRADIENT_ACCUMULATION : (update + 1) * GRADIENT_ACCUMULATION]:
                losses, valid = _reference_losses(cell, model, inputs)
                total = total + losses.sum()
                count += int(valid.sum())
        (total / count).backward()
        reference = torch.cat(
            [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for _, p in model.named_parameters()]
        )
        trained = torch.cat([gradient[name].reshape(-1) for name, _ in model.named_parameters()])
        found.append(
            (
                float((trained - reference).abs().max() / reference.abs().max()),
                float(trained @ reference / (reference @ reference)),
            )
        )
    return found


def _reference_losses(
    cell: Cell, model: torch.nn.Module, inputs: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓᵢ and the valid labels of one microbatch as the trainer computed them. A padding-free row (TRL's packing:
    position_ids and no attention mask) is its sequences one after another, each attending only to itself."""
    labels = inputs["labels"]
    if "position_ids" in inputs and "attention_mask" not in inputs:
        starts = (inputs["position_ids"][0] == 0).nonzero().flatten().tolist() + [labels.shape[1]]
        parts = [
            token_losses(cell, model(input_ids=inputs["input_ids"][:, a:b]).logits, labels[:, a:b])
            for a, b in zip(starts[:-1], starts[1:])
            if b > a
        ]
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
    logits = model(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        labels=labels if cell.family in ("t5", "bart") else None,
    ).logits
    return token_losses(cell, logits, labels)


@dataclass
class Row:
    """A cell measured: the truth, and what tokaudit said of its log."""

    cell: Cell
    correct: bool
    truth: str
    verdict: str
    exit_code: int
    codes: list[str]
    fix: str
    report: dict[str, Any]
    """`tokaudit check --format json` of the cell's log."""


def truth(measured: list[tuple[float, float]]) -> tuple[bool, str]:
    """Whether every update's gradient is the token mean's, and in words."""
    worst = max(deviation for deviation, _ in measured)
    if worst <= TOLERANCE:
        return True, f"correct (every update within {worst:.0e} of the token mean)"
    scales = [scale for _, scale in measured]
    return False, (
        f"wrong: the gradient is off the token mean's by up to {worst:.0%} of its largest entry, "
        f"scaled {min(scales):.2f}–{max(scales):.2f}×"
    )


def measure(cells: list[Cell], root: Path, together: bool = False) -> list[Row]:
    """Run the cells (`together`: in one set of processes, which saves a start and a rendezvous each; else
    each in its own), compare each with the reference, and audit its log with `tokaudit check`."""
    if together:
        run_ddp_each(matrix_job, 2, cells, str(root), timeout=300)
    else:
        for cell in cells:
            run_ddp(matrix_job, 2, cell, str(root), timeout=300)
    return [_judged(cell, root) for cell in cells]


def _judged(cell: Cell, root: Path) -> Row:
    correct, said = truth(deviations(cell, str(root)))
    done = subprocess.run(
        [sys.executable, "-m", "tokaudit", "check", str(root / "logs" / cell.name), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(done.stdout)
    (run,) = report["runs"]
    findings = report["findings"]
    return Row(
        cell,
        correct,
        said,
        run["verdict"],
        done.returncode,
        [f["code"] for f in findings],
        findings[0]["fix"] if findings else "",
        report,
    )
