"""The model card's base model: a hub id as given, or the one a local directory's config records."""

from __future__ import annotations

import json
from pathlib import Path

from acc_train.outputs.model_card import base_model_id


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


def test_a_bare_hub_id_is_a_base_model_and_a_path_is_not(tmp_path: Path) -> None:
    """The Hub's own rule (``validate_repo_id``): ``gpt2`` is a repository, as transformers loads it."""
    assert base_model_id("gpt2") == "gpt2" and base_model_id("openai-community/gpt2") == "openai-community/gpt2"
    for not_an_id in ("./gpt2", "~/models/gpt2", "org/name/sub", "a model", "org--name/x"):
        assert base_model_id(not_an_id) is None, not_an_id
    downloaded = tmp_path / "gpt2-copy"
    downloaded.mkdir()
    (downloaded / "config.json").write_text(json.dumps({"_name_or_path": "gpt2"}))
    assert base_model_id(str(downloaded)) == "gpt2"


def test_harness_scores_are_the_cards_model_index(tmp_path: Path) -> None:
    """The evaluators' last scores shaped ``{dataset: {metric: value}}`` (lm-evaluation-harness's)
    are ``model-index`` results the Hub reads (``huggingface_hub``'s ``EvalResult``), one per task
    and metric, standard errors left out; every evaluator's metrics are a fact of the card."""
    from huggingface_hub import ModelCard

    from acc_train.config import JobConfig
    from acc_train.outputs.model_card import model_card

    config = JobConfig.model_validate({"model": {"name_or_path": "gpt2"}, "output_dir": str(tmp_path / "my-run")})
    harness = {"hellaswag": {"acc": 0.25, "acc_stderr": 0.01}, "gsm8k": {"exact_match/strict-match": 0.5}}
    summary = {"strategy": "ddp", "steps": 4, "final_loss": 2.0, "evaluations": {"harness_tasks": {"step": 4, "metrics": {"harness": harness}}}}
    (tmp_path / "README.md").write_text(model_card("strategy: ddp\n", config, summary, adapter=False))
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model == "gpt2" and card.data.model_name == "my-run"
    got = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert got == {("hellaswag", "acc"): 0.25, ("gsm8k", "exact_match/strict-match"): 0.5}
    assert all(r.task_type == "text-generation" for r in card.data.eval_results)
    assert "| evaluation harness_tasks | after step 4: harness hellaswag acc 0.2500; harness gsm8k exact_match/strict-match 0.5000 |" in card.text
    no_scores = model_card("strategy: ddp\n", config, {**summary, "evaluations": {}}, adapter=False)
    assert "model-index" not in no_scores
    flat = model_card("strategy: ddp\n", config, {**summary, "evaluations": {"eval_loss": {"step": 4, "metrics": {"eval_loss": 2.5}}}}, adapter=False)
    assert "model-index" not in flat and "| evaluation eval_loss | after step 4: eval_loss 2.5000 |" in flat  # one path: a number is a fact, not a dataset
