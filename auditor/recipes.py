"""The token mean as code to paste, for each set-up a log can show: the raw loop, the Hugging Face Trainer,
Lightning and Accelerate. A weighting finding carries the one its run's trainer needs (`Finding.fix_code`);
`tokaudit explain` shows them all. Each is the construction a real run of the suite trains against a float64
reference (the README's loop, the trainer matrix's `custom-sum`, `lightning-token-mean` and `accelerate-sum`)."""

from __future__ import annotations

LOOP = '''\
from tokaudit.hooks import global_valid_tokens, token_mean_loss

# the update's M microbatches, drawn before any backward; N over all of them, every rank
batches = list(itertools.islice(loader_iter, M))
N = global_valid_tokens([y for _, y in batches])
for i, (x, y) in enumerate(batches):
    with model.no_sync() if i < len(batches) - 1 else nullcontext():
        loss_sum = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                                   reduction="sum")
        token_mean_loss(loss_sum, N).backward()  # W·S/N (reduction="sum": S/N, for a summing hook)
optimizer.step(); optimizer.zero_grad()'''

TRANSFORMERS = '''\
def token_mean(outputs, labels, num_items_in_batch):  # num_items_in_batch: the update's N
    logits, labels = outputs.logits[:, :-1], labels[:, 1:]  # a causal LM predicts the next token
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum") / num_items_in_batch

args = TrainingArguments(..., average_tokens_across_devices=True)  # the Trainer multiplies by W
trainer = Trainer(model=model, args=args, train_dataset=train_dataset, compute_loss_func=token_mean)'''

LIGHTNING = '''\
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
        optimizer.step(); optimizer.zero_grad()'''

ACCELERATE = '''\
from tokaudit.hooks import global_valid_tokens, token_mean_loss

batches = list(itertools.islice(loader_iter, M))  # M = gradient_accumulation_steps, drawn first
N = global_valid_tokens([b["labels"][:, 1:] for b in batches])
for b in batches:
    with accelerator.accumulate(model):
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(),
                                   ignore_index=-100, reduction="sum")
        accelerator.backward(M * token_mean_loss(loss_sum, N))  # Accelerate divides by M
        optimizer.step(); optimizer.zero_grad()'''

RECIPES = {"loop": LOOP, "transformers": TRANSFORMERS, "lightning": LIGHTNING, "accelerate": ACCELERATE}
"""Set-up → the token mean in its code; "loop" for a log no integration recorded."""

NAMES = {"loop": "a training loop", "transformers": "the Hugging Face Trainer", "lightning": "Lightning",
         "accelerate": "Accelerate"}


def recipe_for(trainer: str | None) -> str:
    """The token mean as code for the trainer whose integration recorded a run (the raw loop otherwise)."""
    return RECIPES.get(trainer or "loop", LOOP)
