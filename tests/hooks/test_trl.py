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
