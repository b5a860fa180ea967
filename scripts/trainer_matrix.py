"""Which Hugging Face Trainer set-ups train the token mean, measured: `docs/trainer-matrix.md`.

Usage: python scripts/trainer_matrix.py [--cells NAME,NAME...] [--out PATH|-]

Each cell (`scenarios/trainer_matrix.py`) is a tiny real Trainer run on 2 gloo ranks with gradient
accumulation 2, recorded by the one-line attach; its truth comes from a float64 reference gradient of
the same weights and tokens, never from tokaudit; then `tokaudit check` audits its log.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scenarios.trainer_matrix import CELLS, CELLS_BY_NAME, Row, measure  # noqa: E402


WHY_THEY_DIFFER = [
    "",
    "Why they differ (transformers' `Trainer.compute_loss` and `training_step`):",
    "",
    "- With `average_tokens_across_devices=True` and a model whose loss takes `num_items_in_batch` (the "
    "causal LMs here), the Trainer passes the update's global label count N, multiplies the loss by W, and "
    "skips the division by the accumulation steps: each rank backpropagates W·S_r/N, the token mean.",
    "- With `False`, N is this rank's count: a rank-local mean that DDP then averages.",
    "- GPT-2 has no `loss_type` the Trainer recognizes, so it counts N over every label, before the causal "
    "shift its loss makes: every token is a little light, by the share of rows' first labels. Setting "
    '`model.loss_type = "ForCausalLM"` before building the Trainer makes it count after the shift.',
    "- T5, Bart and BERT take `**kwargs` but return each microbatch's own mean; the Trainer still "
    "multiplies by W (with `True`) and skips the division by accumulation steps.",
    "- A `compute_loss_func` is trusted to divide by `num_items_in_batch`: one returning its own mean is a "
    "per-microbatch mean, ×W; one that sums and divides by `num_items_in_batch` is the token mean.",
    "- A model whose forward takes no `**kwargs` gets no `num_items_in_batch`: its own mean, divided by "
    "the accumulation steps.",
    "- Lightning divides what `training_step` returns by `accumulate_grad_batches`, and Accelerate's "
    "`accelerator.backward` by `gradient_accumulation_steps`: a model's own mean becomes each microbatch's "
    "mean ÷ M. Backpropagating M·W·S/N, with N all-reduced over the update's microbatches before the first "
    "backward, is the token mean.",
    "- Lightning's `training_step` sees one microbatch: the token mean needs manual optimization over "
    "the update's microbatches, N counted first (the recipe `tokaudit explain local_mean` prints).",
    "- torchtune sums the loss and multiplies every gradient by W/N after backward (`training.scale_grads`): "
    "invisible to the probe, so the recipe tells the recorder (`rec.scale_grads(factor)`); 1/N instead "
    'leaves the gradient W× too small. A count of `batch["labels"]` taken before the shift, times each '
    "microbatch's mean, gives its tokens (n + rows)/n of their weight: tokaudit names the count.",
    "- TRL's `SFTTrainer` computes each label's log-probability in its own fused LM head (no cross-entropy "
    "call; the attach records it there) and divides Σℓ by `num_items_in_batch`, ×W: the token mean over "
    "the labels its collator keeps (completion-only, packed). With `average_tokens_across_devices=False` "
    "it is a rank-local mean. TRL's preference and RL trainers (DPO, KTO, GRPO, ...) optimize per-pair or "
    "per-sequence objectives: the attach says so and records nothing.",
    "",
    "The fix for every wrong row: the token mean is Σℓ / N with N the update's valid labels on every rank. "
    "In the Trainer, pass `compute_loss_func` that sums the per-token losses and divides by "
    "`num_items_in_batch`, with `average_tokens_across_devices=True` (or use a model whose loss takes "
    "`num_items_in_batch`). In a Lightning or Accelerate loop, see [fixing.md](fixing.md) for the helpers "
    "that count N and build the loss.",
    "",
]
"""The paragraphs under the table: why the set-ups differ, and the fix for every wrong row."""


def markdown(rows: list[Row]) -> str:
    lines = [
        "# Trainers: which set-ups train the token mean",
        "",
        "Measured by `python scripts/trainer_matrix.py` (transformers "
        f"{__import__('transformers').__version__}, torch {__import__('torch').__version__}): each row is a tiny "
        "real `Trainer` run (then Lightning and Accelerate loops, torchtune's recipe and TRL's `SFTTrainer`), DDP on 2 gloo ranks, gradient "
        "accumulation 2, 4 updates, recorded by the trainer's one line (`TokauditCallback.attach(trainer, ...)`, "
        "`TokauditLightningCallback`, `Recorder(accelerator=...)`). **Truth** compares each update's gradient (after DDP's average, "
        "before the optimizer) with a float64 reference: the gradient of Σℓᵢ/N over every valid label of the "
        "update on both ranks, computed again from the same weights and inputs. **tokaudit** is `tokaudit check` "
        "on the run's log (its verdict, exit code, finding codes and first fix).",
        "",
        "| set-up | truth (float64 reference) | tokaudit | exit | codes | tokaudit's fix |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        agrees = "" if row.correct == (row.verdict == "correct") else " ⚠"
        lines.append(
            f"| {row.cell.setup} | {row.truth} | {row.verdict}{agrees} | {row.exit_code} | "
            f"{', '.join(f'`{c}`' for c in row.codes) or '—'} | {row.fix.replace('|', '/') or '—'} |"
        )
    lines += WHY_THEY_DIFFER
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cells",
        default=",".join(c.name for c in CELLS),
        help=f"comma-separated, of: {', '.join(c.name for c in CELLS)}",
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "trainer-matrix.md"), help="a file, or - for stdout")
    args = parser.parse_args()
    cells = [CELLS_BY_NAME[name] for name in args.cells.split(",")]
    with tempfile.TemporaryDirectory(prefix="tokaudit-matrix-") as root:
        rows = []
        for cell in cells:
            print(f"{cell.name} ...", file=sys.stderr, flush=True)
            rows.extend(measure([cell], Path(root)))
    text = markdown(rows)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
