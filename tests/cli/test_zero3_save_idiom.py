"""Accelerate's documented save (``accelerator.get_state_dict(model)``, then
``unwrap_model(model).save_pretrained(..., state_dict=state_dict)``) keeps the trained model under
``acc-train --strategy zero3 launch`` and its offload preset: stage 3 gathers the 16-bit weights
at a save by default (``zero3_save_16bit_model``), as the seed's own DeepSpeed config did, where
``accelerate config``'s default left them partitioned and DeepSpeed refused the save at the end
of training. The saved model is reloaded here, in another process than the one that trained it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_unchanged_programs import PROGRAMS, launch, results

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("unchanged-scripts")]


@pytest.mark.parametrize(
    ("strategy", "nproc"),
    [
        ("zero3", 2),
        # offload is refused on a machine without an accelerator (it would move nothing)
        pytest.param("zero3-offload", 1, marks=pytest.mark.gpu),
    ],
)
def test_the_canonical_save_under_zero3_keeps_the_trained_model(strategy: str, nproc: int, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "saved"
    (result,) = results(launch(strategy, str(PROGRAMS / "save_pretrained.py"), str(out), nproc=nproc))
    assert result["type"] == "DEEPSPEED"
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = reloaded.state_dict()
    saved = result["sums"]
    assert set(saved) <= set(state) and len(saved) >= 8
    for name, total in saved.items():
        assert float(state[name].sum()) == pytest.approx(total, rel=1e-5, abs=1e-5), name
    # trained, not the initial weights
    config = json.loads((out / "config.json").read_text())
    torch.manual_seed(0)
    initial = AutoModelForCausalLM.from_config(reloaded.config.__class__(**config)).state_dict()
    assert any(not torch.equal(initial[name], state[name]) for name in saved)
