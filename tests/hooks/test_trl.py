"""TRL trainers whose objective is not a token mean are refused plainly, with no recorder and no shard."""

from __future__ import annotations

import warnings
from pathlib import Path


from tests.needs import needs_integration

pytestmark = needs_integration("trl", "transformers")


def test_dpo_is_said_not_to_be_a_token_mean_and_nothing_is_recorded(tmp_path: Path) -> None:
    from trl import DPOTrainer, SFTTrainer

    from tokaudit.hooks.huggingface import TokauditCallback
    from tokaudit.hooks._trl_trainers import trl_trainer

    dpo = DPOTrainer.__new__(DPOTrainer)  # the real class; what attach reads of it is its type
    assert trl_trainer(dpo) == "DPOTrainer" and trl_trainer(SFTTrainer.__new__(SFTTrainer)) == "SFTTrainer"
    callback = TokauditCallback(tmp_path, trainer=dpo)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.on_train_begin(args=None, state=None, control=None)
    (warning,) = [w for w in caught if "tokaudit" in str(w.message)]
    assert "DPOTrainer optimizes an objective per pair" in str(warning.message)
    assert "no verdict" in str(warning.message)
    assert callback.recorder is None and list(tmp_path.iterdir()) == []


def test_the_trainer_a_callback_given_as_callbacks_serves_is_known_by_its_config(tmp_path: Path) -> None:
    """`callbacks=[TokauditCallback(...)]` sees the arguments, never the trainer: DPOConfig's trainer is refused as
    DPOTrainer is, SFTConfig's is SFTTrainer (whose fused LM head is then recorded), and SFTTrainer's DFT loss,
    which weighs each token by its own probability on purpose, is refused with what tokaudit does judge."""
    from trl import DPOConfig, SFTConfig

    from tokaudit.hooks.huggingface import TokauditCallback
    from tokaudit.hooks._trl_trainers import trl_trainer

    options = {"output_dir": str(tmp_path / "out"), "report_to": [], "use_cpu": True}
    assert trl_trainer(None, SFTConfig(**options)) == "SFTTrainer"
    for args, said in (
        (DPOConfig(**options), "DPOTrainer optimizes an objective per pair"),
        (SFTConfig(**options, loss_type="dft"), "SFTTrainer with loss_type='dft' weighs each token by its own"),
    ):
        callback = TokauditCallback(tmp_path / "logs")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            callback.on_train_begin(args=args, state=None, control=None)
        (warning,) = [w for w in caught if "tokaudit" in str(w.message)]
        assert said in str(warning.message) and "no verdict" in str(warning.message)
        assert callback.recorder is None and not (tmp_path / "logs").exists()
