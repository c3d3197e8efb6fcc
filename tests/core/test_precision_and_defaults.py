"""``model.dtype`` and the defaults a job resolves to, without launching: a checkpoint stored in
bf16 loads into fp32 unless pure low precision is asked for, the plan counts what the model is
held in, and a job naming a pretrained model gets fine-tuning defaults for what it leaves unset.
Launched runs (run.json's measured dtypes against the plan) are in tests/cli/test_plan_matches_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acc_train.config import load_job
from acc_train.config.schema import DEMO_EVAL_FRACTION, FINE_TUNE_DEFAULTS
from acc_train.errors import UserError
from acc_train.memory.state import dtype_name
from tests.conftest import run_cli


def _job(*sets: str):  # noqa: ANN202 - a ResolvedJob
    return load_job(sets=list(sets))


def test_the_bf16_checkpoint_is_stored_in_bf16(tiny_bf16_model_dir: Path) -> None:
    from safetensors import safe_open

    assert json.loads((tiny_bf16_model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tiny_bf16_model_dir / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}


@pytest.mark.parametrize(("dtype", "held"), [("auto", "float32"), ("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")])
def test_parameters_are_held_in_model_dtype_whatever_the_storage(tiny_bf16_model_dir: Path, tiny_model_dir: Path, dtype: str, held: str) -> None:
    from acc_train.model.build import build_model

    for stored in (tiny_bf16_model_dir, tiny_model_dir):
        model = build_model(_job(f"model.name_or_path={stored}", f"model.dtype={dtype}").config)
        assert dtype_name(model.parameters()) == held, stored


def test_the_demo_model_follows_model_dtype_too() -> None:
    from acc_train.model.build import build_model

    small = "model.config={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2}"
    assert dtype_name(build_model(_job(small).config).parameters()) == "float32"
    assert dtype_name(build_model(_job(small, "model.dtype=bf16").config).parameters()) == "bfloat16"


def test_dtype_name_names_one_dtype_or_the_mix() -> None:
    import torch

    assert dtype_name([torch.zeros(1), torch.zeros(2)]) == "float32"
    assert dtype_name([torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)]) == "bfloat16+float32"
    assert dtype_name([]) is None


def test_pure_low_precision_computes_in_its_dtype_and_refuses_mixed_precision_on_top() -> None:
    assert _job("model.dtype=bf16").config.training.mixed_precision == "no"
    assert _job("model.dtype=bf16", "training.mixed_precision=no").config.training.mixed_precision == "no"
    assert _job("model.dtype=auto").config.training.mixed_precision == "auto"
    with pytest.raises(UserError) as caught:
        _job("model.dtype=bf16", "training.mixed_precision=bf16")
    message = str(caught.value)
    assert "model.dtype: bf16" in message and "mixed_precision: bf16" in message and "model.dtype: auto" in message


def test_every_strategy_words_the_low_precision_warning() -> None:
    from acc_train.config import resolve_strategy

    assert "no fp32 master copy" in resolve_strategy("ddp").planner().low_precision_warning("bf16")
    assert "no fp32 master copy" in resolve_strategy("fsdp").planner().low_precision_warning("bf16")
    zero2, zero3 = resolve_strategy("zero2").planner().low_precision_warning("bf16"), resolve_strategy("zero3").planner().low_precision_warning("bf16")
    assert "not pure bf16" in zero2 and "fp32 master partitions" in zero2
    assert "not pure bf16" in zero3 and "partitions the parameters in fp32" in zero3


def test_a_pretrained_model_gets_fine_tuning_defaults_for_what_is_unset(tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    cfg = _job(f"model.name_or_path={tiny_model_dir}", f"data.train_files=[{tiny_data['train']}]").config
    assert cfg.optimizer.lr == FINE_TUNE_DEFAULTS[("optimizer", "lr")] == 2e-5
    assert (cfg.optimizer.weight_decay, cfg.optimizer.betas) == (0.0, [0.9, 0.999])
    assert cfg.data.eval_fraction == 0.0  # the user's training data is never held out silently
    assert cfg.scheduler.warmup_ratio > 0  # a warmup


def test_what_the_user_sets_wins_over_either_default(tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    cfg = _job(
        f"model.name_or_path={tiny_model_dir}", f"data.train_files=[{tiny_data['train']}]",
        "optimizer.lr=1e-3", "optimizer.weight_decay=0.01", "optimizer.betas=[0.9, 0.95]", "data.eval_fraction=0.05",
    ).config  # fmt: skip
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.betas, cfg.data.eval_fraction) == (1e-3, 0.01, [0.9, 0.95], 0.05)


def test_the_demo_job_keeps_its_own_defaults(tiny_data: dict[str, Path]) -> None:
    demo = _job().config
    assert (demo.optimizer.lr, demo.optimizer.weight_decay, demo.optimizer.betas) == (1e-3, 0.01, [0.9, 0.95])
    assert demo.data.eval_fraction == DEMO_EVAL_FRACTION
    own_files = _job(f"data.train_files=[{tiny_data['train']}]").config  # the demo model on the user's data
    assert own_files.optimizer.lr == 1e-3 and own_files.data.eval_fraction == 0.0


def test_print_config_shows_the_resolved_defaults(tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    import yaml

    proc = run_cli("--set", f"model.name_or_path={tiny_model_dir}", "--set", f"data.train_files=[{tiny_data['train']}]", "--print-config")
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["optimizer"]["lr"] == 2e-5 and resolved["data"]["eval_fraction"] == 0.0
    assert resolved["model"]["dtype"] == "auto"
    again = load_job(base=resolved).config  # what the workers read back resolves to the same
    assert (again.optimizer.lr, again.data.eval_fraction) == (2e-5, 0.0)


def _plan(*sets: str) -> dict:
    from acc_train_cli.plan import build_plan

    job = load_job(sets=["launch.num_processes=2", "training.mixed_precision=no", *sets])
    data = build_plan(job)
    return {"psi": data["parameters"], **{r["label"]: r for r in data["rows"]}}


def test_the_plan_counts_a_bf16_checkpoint_as_fp32_under_auto(tiny_bf16_model_dir: Path, tiny_model_dir: Path) -> None:
    stored_bf16, stored_fp32 = _plan(f"model.name_or_path={tiny_bf16_model_dir}"), _plan(f"model.name_or_path={tiny_model_dir}")
    psi = stored_bf16["psi"]
    for label in ("ddp", "fsdp2", "zero3"):
        assert stored_bf16[label]["model_state"] == stored_fp32[label]["model_state"], label
    assert stored_bf16["ddp"]["params"] == 4 * psi and stored_bf16["ddp"]["optimizer"] == 8 * psi


def test_the_plan_shows_two_byte_parameters_and_moments_under_model_dtype_bf16(tiny_bf16_model_dir: Path) -> None:
    plan = _plan(f"model.name_or_path={tiny_bf16_model_dir}", "training.mixed_precision=auto", "model.dtype=bf16")
    psi = plan["psi"]
    assert (plan["ddp"]["params"], plan["ddp"]["grads"], plan["ddp"]["optimizer"]) == (2 * psi, 2 * psi, 4 * psi)
    assert (plan["fsdp2"]["params"], plan["fsdp2"]["optimizer"]) == (2 * psi // 2, 4 * psi // 2)
    assert "no fp32 master copy" in plan["ddp"]["note"]
    # measured under DeepSpeed (see its strategy): ZeRO-2 bf16 parameters with fp32 masters, ZeRO-3 all fp32
    assert (plan["zero2"]["params"], plan["zero2"]["optimizer"]) == (2 * psi, 12 * psi // 2)
    assert plan["zero3"]["params"] == 4 * psi // 2
