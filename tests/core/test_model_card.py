"""The model card's base model: a hub id as given, or the one a local directory's config records."""

from __future__ import annotations

import json
from pathlib import Path

from acc_train.model_card import base_model_id


def test_the_base_model_is_a_hub_id_or_none(tmp_path: Path) -> None:
    assert base_model_id("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert base_model_id(None) is None and base_model_id("") is None
    downloaded = tmp_path / "llama"
    downloaded.mkdir()
    (downloaded / "config.json").write_text(json.dumps({"_name_or_path": "meta-llama/Llama-3.1-8B"}))
    assert base_model_id(str(downloaded)) == "meta-llama/Llama-3.1-8B"  # a save_pretrained copy of a hub model
    (downloaded / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path / "elsewhere")}))
    assert base_model_id(str(downloaded)) is None  # a local model of unknown origin
    assert base_model_id(str(tmp_path / "missing" / "dir")) is None
