"""The trainer integrations tokaudit knows, in one table (`INTEGRATIONS`), and the token mean as code to paste for
each set-up a log can show: the raw loop, the Hugging Face Trainer, Lightning and Accelerate. A weighting finding
carries the one its run's trainer needs (`Finding.fix_code`); `tokaudit explain` shows them all. Each is the
construction a real run of the suite trains against a float64 reference (the README's loop, the trainer matrix's
`custom-sum`, `lightning-token-mean` and `accelerate-sum`).

A light module (no torch, no trainer imported): the checks, the suite's preload list and its skip markers read
the table; a test holds pyproject's extras and the Makefile's to it."""

from __future__ import annotations

from dataclasses import dataclass

LOOP = """\
from tokaudit.hooks import global_valid_tokens, token_mean_loss

# the update's M microbatches, drawn before any backward; N over all of them, every rank
batches = list(itertools.islice(loader_iter, M))
N = global_valid_tokens([y for _, y in batches])
for i, (x, y) in enumerate(batches):
    with model.no_sync() if i < len(batches) - 1 else nullcontext():
        loss_sum = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                                   reduction="sum")
        token_mean_loss(loss_sum, N).backward()  # W·S/N (reduction="sum": S/N, for a summing hook)
optimizer.step(); optimizer.zero_grad()"""

TRANSFORMERS = """\
def token_mean(outputs, labels, num_items_in_batch):  # num_items_in_batch: the update's N
    logits, labels = outputs.logits[:, :-1], labels[:, 1:]  # a causal LM predicts the next token
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum") / num_items_in_batch

model.loss_type = "ForCausalLM"  # the Trainer then counts num_items_in_batch over labels[..., 1:], as this loss
args = TrainingArguments(..., average_tokens_across_devices=True)  # the Trainer multiplies by W
trainer = Trainer(model=model, args=args, train_dataset=train_dataset, compute_loss_func=token_mean)"""

LIGHTNING = """\
from tokaudit.hooks import global_valid_tokens, token_mean_loss

class TokenMean(L.LightningModule):  # each DataLoader item: one update's list of microbatches
    def __init__(self, model):
        super().__init__()
        self.model, self.automatic_optimization = model, False  # N comes before any backward

    def training_step(self, batches, index):
        N = global_valid_tokens([b["labels"][:, 1:] for b in batches])
        for b in batches:
            logits = self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(),
                                       ignore_index=-100, reduction="sum")
            self.manual_backward(token_mean_loss(loss_sum, N))  # W·S/N
        optimizer = self.optimizers()
        optimizer.step(); optimizer.zero_grad()"""

ACCELERATE = """\
from tokaudit.hooks import global_valid_tokens, token_mean_loss

# one update's microbatches, drawn first (the last update may hold fewer): no_sync() by hand, as accumulate()
# cannot see the loader's end once its batches are drawn ahead
batches = list(itertools.islice(loader_iter, M))  # M = gradient_accumulation_steps
N = global_valid_tokens([b["labels"][:, 1:] for b in batches])
for i, b in enumerate(batches):
    with accelerator.no_sync(model) if i < len(batches) - 1 else contextlib.nullcontext():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum")
        accelerator.backward(M * token_mean_loss(loss_sum, N))  # Accelerate divides by M
optimizer.step(); optimizer.zero_grad()"""


@dataclass(frozen=True)
class Integration:
    """A trainer whose runs tokaudit records with one line."""

    name: str
    """What the recorder's provenance calls the trainer (`Provenance.trainer`)."""
    words: str
    extra: str
    """The pip extra that installs it beside tokaudit: `pip install '.[EXTRA]'` in a checkout."""
    modules: tuple[str, ...]
    """What its integration imports: the suite preloads them and skips its tests without them."""
    recipe: str = ""
    """The token mean in its code (none where another integration's is the one: TRL's is the Trainer's)."""
    advice: tuple[tuple[str, str], ...] = ()
    """What a finding says of this trainer in a situation it names (`advice`): (situation, words)."""


INTEGRATIONS = (
    Integration(
        "transformers",
        "the Hugging Face Trainer",
        "hf",
        ("transformers", "transformers.trainer"),
        TRANSFORMERS,
        advice=(
            (
                "token_mean_settings",
                "in the Hugging Face Trainer: average_tokens_across_devices=True with a "
                "model whose loss takes num_items_in_batch, or a compute_loss_func that "
                "sums the per-token losses and divides by num_items_in_batch",
            ),
            (
                "overcounted",
                "the Hugging Face Trainer counts num_items_in_batch over every label when the "
                "model's loss_type is not set, as for GPT-2",
            ),
            (
                "overcounted_fix",
                "count N over the labels the loss is computed on, after the causal shift: "
                'in the Hugging Face Trainer, set model.loss_type = "ForCausalLM" before '
                "building the Trainer (it then counts labels[..., 1:]), or give the batches "
                "shift_labels",
            ),
            (
                "mean_times_w",
                "The Hugging Face Trainer does this with average_tokens_across_devices=True "
                "when the model returns its own mean instead of dividing by num_items_in_batch "
                "(T5, Bart, BERT do).",
            ),
        ),
    ),
    Integration("trl", "TRL's SFTTrainer", "trl", ("trl",)),
    Integration("lightning", "Lightning", "lightning", ("lightning",), LIGHTNING),
    Integration("accelerate", "Accelerate", "accelerate", ("accelerate",), ACCELERATE),
)
INTEGRATION_BY_NAME = {integration.name: integration for integration in INTEGRATIONS}

RECIPES = {"loop": LOOP, **{i.name: i.recipe for i in INTEGRATIONS if i.recipe}}
"""Set-up → the token mean in its code; "loop" for a log no integration recorded."""

NAMES = {"loop": "a training loop", **{i.name: i.words for i in INTEGRATIONS}}


def recipe_for(trainer: str | None) -> str:
    """The token mean as code for the trainer whose integration recorded a run (the raw loop otherwise)."""
    return RECIPES.get(trainer or "loop", LOOP)


def advice(trainer: str | None, situation: str) -> str:
    """What a finding says of the recording trainer in `situation` ("token_mean_settings": the token mean in its
    own settings, one line; "overcounted": why N counted more labels than the loss; "overcounted_fix": its fix;
    "mean_times_w": where a microbatch's own mean came out ×W); empty where the trainer has nothing of its own to
    say there."""
    integration = INTEGRATION_BY_NAME.get(trainer or "")
    return dict(integration.advice).get(situation, "") if integration is not None else ""
