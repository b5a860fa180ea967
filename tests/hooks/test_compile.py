"""torch.compile: a compiled model and loss are recorded without breaking the graph at every step."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.logs import read_rows
from tokaudit.hooks import Recorder


@pytest.mark.slow
def test_a_compiled_loss_is_probed_outside_and_a_captured_one_is_said(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(13, 8), torch.nn.Linear(8, 13))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def per_token_loss(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)

    # aot_eager: Dynamo and AOTAutograd, what the probe and the capture meet; inductor only adds code generation
    compiled = torch.compile(per_token_loss, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="probed", optimizer=optimizer) as rec, rec.capture_cross_entropy():
            for _ in range(3):
                tokens, labels = torch.randint(0, 13, (2, 6)), torch.randint(0, 13, (2, 6))
                labels[0, 4:] = -100
                valid = labels.flatten() != -100
                per_token = rec.probe(compiled(tokens, labels), valid)  # the probe outside the compiled code
                loss_sum = (per_token * valid).sum()
                scalar = loss_sum / valid.sum()
                rec.record(loss_sum=loss_sum, valid_tokens=valid.sum(), backward_scalar=scalar)
                scalar.backward()
                optimizer.step()
                optimizer.zero_grad()
    messages = [str(w.message) for w in caught]
    assert not any("graph break" in m.lower() for m in messages)
    said = [m for m in messages if m.startswith("tokaudit:")]
    assert len(said) == 1 and "inside torch.compile is not captured" in said[0], said  # once, not per step
    rows = read_rows(tmp_path / "probed")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:  # every valid token weighs 1/n: b = S/n with W = 1
        assert row["token_weight_sum"] == pytest.approx(1.0) and row["masked_weight_abs_sum"] == 0.0


@pytest.mark.slow
def test_a_probe_inside_the_compiled_function_measures_without_a_warning(tmp_path: Path) -> None:
    """rec.probe inside the compiled code: Dynamo traces it (no graph break, no warning of tokaudit's making,
    no word of a cache wrapper) and each record's tokens weigh 1/n."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(13, 8), torch.nn.Linear(8, 13))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run_id="inside", optimizer=optimizer, announce=False) as rec:

            def loss_sum_of(tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                valid = labels.flatten() != -100
                per_token = F.cross_entropy(
                    model(tokens).flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100
                )
                return rec.probe(per_token, valid).sum(), valid.sum()

            compiled = torch.compile(loss_sum_of, backend="aot_eager")
            for _ in range(3):
                tokens, labels = torch.randint(0, 13, (2, 6)), torch.randint(0, 13, (2, 6))
                labels[1, 3:] = -100
                loss_sum, count = compiled(tokens, labels)
                scalar = loss_sum / count
                rec.record(loss_sum=loss_sum, valid_tokens=count, backward_scalar=scalar)
                scalar.backward()
                optimizer.step()
                optimizer.zero_grad()
    assert [str(w.message) for w in caught] == []
    for row in read_rows(tmp_path / "inside"):
        assert row["token_weight_sum"] == pytest.approx(1.0) and row["token_weight_max"] == pytest.approx(1 / 9)
