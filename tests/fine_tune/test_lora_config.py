"""LoRA without a launch: ``model.lora``'s schema and defaults, PEFT applied to the model (only
the adapters train), bad target modules refused before launch, the plan's frozen-base rows, and
a resume that would mix adapters and full weights refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acc_train.model.adapters import adapter_manifest, apply_lora, check_adapters_match
from acc_train.config import load_job
from acc_train.errors import UserError
from tests.conftest import cli_in_process, tiny_job_args


def _job(model: Path, *sets: str):
    return load_job(sets=[f"model.name_or_path={model}", *sets]).config


def test_lora_defaults_and_strict_schema(tiny_model_dir: Path) -> None:
    cfg = _job(tiny_model_dir, "model.lora={}")
    assert cfg.model.lora is not None
    assert (cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.dropout, cfg.model.lora.target_modules) == (16, 32.0, 0.05, "all-linear")
    assert _job(tiny_model_dir).model.lora is None  # full fine-tuning unless asked
    for bad in ("model.lora.r=0", "model.lora.rank=8", "model.lora.dropout=1.5"):
        with pytest.raises(UserError) as err:
            _job(tiny_model_dir, bad)
        assert "model.lora" in str(err.value)


def test_only_the_adapters_train(tiny_model_dir: Path) -> None:
    import transformers

    cfg = _job(tiny_model_dir, "model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj]")
    model = apply_lora(transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir), cfg)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert any("embed_tokens" in n for n in frozen) and any("base_layer" in n for n in frozen)


def test_unknown_target_modules_are_refused_before_launch(tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli_in_process(*tiny_job_args(tiny_model_dir, tiny_data, out, "--set", "model.lora.target_modules=[qkv_proj]", "--max-steps", "1"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.lora.target_modules" in proc.stderr and "q_proj" in proc.stderr  # names the model's own linear layers
    assert not out.exists()  # refused before anything was made


def test_adapters_must_match_to_resume(tiny_model_dir: Path) -> None:
    lora = adapter_manifest(_job(tiny_model_dir, "model.lora.r=4"))
    assert lora is not None and lora["base_model"] == str(tiny_model_dir.resolve())
    check_adapters_match(lora, dict(lora), "--resume x")
    check_adapters_match(None, None, "--resume x")
    with pytest.raises(UserError, match="r: 4 -> 8"):
        check_adapters_match(lora, adapter_manifest(_job(tiny_model_dir, "model.lora.r=8")), "--resume x")
    with pytest.raises(UserError, match="holds LoRA adapters, and this run trains full fine-tuning"):
        check_adapters_match(lora, None, "--resume x")
    with pytest.raises(UserError, match="holds the full model"):
        check_adapters_match(None, lora, "--resume x")


def test_plan_counts_the_adapters_and_the_frozen_base(tiny_model_dir: Path) -> None:
    def plan(*extra: str) -> dict:
        proc = cli_in_process("plan", "--json", "--model", str(tiny_model_dir), "--num-processes", "2", "--mixed-precision", "no", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    full, lora = plan(), plan("--set", "model.lora.r=4")
    assert full["frozen_parameters"] == 0 and full["lora"] is None
    # r=4 on every linear layer of the one block: (in + out) * r per layer
    adapters = 4 * ((32 + 32) * 4 + (32 + 64) * 2 + (64 + 32))
    assert lora["parameters"] == adapters
    assert lora["frozen_parameters"] == full["parameters"]
    rows = {r["label"]: r for r in lora["rows"]}
    ddp, fsdp2, zero3 = rows["ddp"], rows["fsdp2"], rows["zero3"]
    assert (ddp["params"], ddp["grads"], ddp["optimizer"], ddp["frozen"]) == (4 * adapters, 4 * adapters, 8 * adapters, 4 * full["parameters"])
    assert fsdp2["frozen"] == 2 * full["parameters"]  # fp32, sharded over 2
    assert zero3["frozen"] < ddp["frozen"]
    text = cli_in_process("plan", "--model", str(tiny_model_dir), "--num-processes", "2", "--set", "model.lora.r=4").stdout
    assert "frozen base" in text and "LoRA" in text


def test_the_guides_fine_tuning_example_resolves_and_plans(tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    """The "Fine-tune a model" config of docs/guides/chat-and-lora.md, pointed at the tiny model
    and data, is a job acc-train resolves (LoRA, fine-tuning defaults, the tracker) and plans."""
    import re

    import yaml

    from tests.conftest import ROOT

    guide = (ROOT / "docs" / "guides" / "chat-and-lora.md").read_text()
    block = re.search(r"```yaml\n(# finetune\.yaml:.*?)```", guide, re.S)
    assert block, "docs/guides/chat-and-lora.md: the finetune.yaml example is gone"
    config = yaml.safe_load(block.group(1))
    config["model"]["name_or_path"] = str(tiny_model_dir)
    config["data"].update(train_files=[str(tiny_data["train"])], eval_files=[str(tiny_data["eval"])], kind="text")
    config["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "finetune.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = cli_in_process("--config", str(path), "--print-config")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["model"]["lora"]["r"] == 16 and resolved["optimizer"]["lr"] == 2e-5
    assert resolved["training"]["tracker"]["project"] == "llama-ft"
    plan = cli_in_process("plan", "--config", str(path), "--json", "--num-processes", "2")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert json.loads(plan.stdout)["frozen_parameters"] > 0
