"""TRL's trainers, which run on the Hugging Face Trainer: what their loss is made of, and how it is recorded.

`SFTTrainer` (trl ≥ 1.0) patches the model with a fused LM head (`add_fused_lm_head`): the forward called with
`fused_lm_head=True` returns each label's log-probability, computed in chunks without the logits, and
`compute_loss` takes ℓᵢ = −log pᵢ, Σℓᵢ / num_items_in_batch (× W under average_tokens_across_devices): a
token mean that no cross-entropy call ever sees. A forward hook on the model puts the probe there: the
log-probs go on as −probe(−log p), the same values and gradients to the bit, and the call is recorded as a
captured call with S = Σℓᵢ and n the fused head's label mask (its labels after the causal shift, so
completion-only, assistant-only, packed and padding-free set-ups count what the loss counts).

The other trainers (DPO, KTO, ORPO, GRPO, ...) optimize objectives per pair or per sequence, not a token
mean, and SFTTrainer's `loss_type="dft"` weighs each token by its own probability: they are not recorded, and a
warning says what tokaudit can and cannot judge there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tokaudit.hooks._capture import probe_into, reraise_control
from tokaudit.hooks._terms import Footprint

if TYPE_CHECKING:
    from tokaudit.hooks._recorder import Recorder

NOT_A_TOKEN_MEAN = (
    "tokaudit: {name} optimizes an objective per pair or per sequence (summed log-probability "
    "ratios, rewards, advantages), not a mean over tokens, so tokaudit records nothing here and "
    "gives no verdict: it judges token-mean objectives (SFTTrainer, the Trainer's causal LM loss). "
    "What it can check for you: the SFT stage before it"
)


NOT_THE_NLL = (
    "tokaudit: SFTTrainer with loss_type={loss_type!r} weighs each token by its own probability (DFT), on purpose: "
    "not a mean over tokens, so tokaudit records nothing here and gives no verdict: it judges the token mean, "
    "SFTTrainer's loss_type='nll'"
)


def trl_trainer(trainer: Any, args: Any = None) -> str | None:
    """The TRL trainer class `trainer` is or derives from ("SFTTrainer", "DPOTrainer", ...), else the one whose
    config `args` is (SFTConfig: "SFTTrainer"; a callback given as `callbacks=[...]` sees the arguments, never the
    trainer); None for another."""
    trainer_class = _trl_class(trainer, "Trainer")
    if trainer_class is not None:
        return trainer_class
    config = _trl_class(args, "Config")
    return None if config is None else config.removesuffix("Config") + "Trainer"


def _trl_class(value: Any, suffix: str) -> str | None:
    """The name of the TRL class ending in `suffix` that `value` is an instance of or derives from (not a private one,
    nor one named the suffix alone)."""
    for cls in type(value).__mro__:
        name = cls.__name__
        if cls.__module__.startswith("trl.") and name.endswith(suffix) and name != suffix and not name.startswith("_"):
            return name
    return None


def refused(name: str | None, args: Any) -> str | None:
    """Why tokaudit records nothing under the TRL trainer `name` (`trl_trainer`) run with `args`, as a warning's text;
    None where it records: SFTTrainer with its token-mean loss, or no TRL trainer."""
    if name is not None and name != "SFTTrainer":
        return NOT_A_TOKEN_MEAN.format(name=name)
    loss_type = getattr(args, "loss_type", "nll")
    if name == "SFTTrainer" and loss_type != "nll":
        return NOT_THE_NLL.format(loss_type=loss_type)
    return None


def watch_fused_head(recorder: Recorder, model: torch.nn.Module) -> Any:
    """Record every training forward of `model` through TRL's fused LM head (a removable hook handle)."""

    def forward_hook(module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        if not kwargs.get("fused_lm_head"):
            return None
        log_probs, mask = getattr(output, "log_probs", None), getattr(output, "label_mask", None)
        if not (
            isinstance(log_probs, torch.Tensor)
            and isinstance(mask, torch.Tensor)
            and torch.is_grad_enabled()
            and log_probs.requires_grad
        ):
            return None  # an evaluation, or the metrics' forward beside a compute_loss_func
        try:
            nll = -log_probs  # ℓᵢ, 0 where the label is ignored
            result = recorder.captured_call(
                Footprint.of(mask), nll.detach().sum(dtype=torch.float64), mask.sum(), mask.numel()
            )
            output["log_probs"] = -probe_into(recorder, nll, mask, result)  # -(-x) is x, to the bit
        except Exception as error:
            reraise_control(error)
            recorder.warn_once("trl", f"tokaudit: a forward of TRL's fused LM head was not recorded ({error!r})")
        return output

    return model.register_forward_hook(forward_hook, with_kwargs=True)
