"""Accelerate's launch protocol (``acc-train launch``): the variables each strategy exports make
Accelerate build the strategy's own plugin, field by field; options no variable carries are
carried another way or refused by name; the shell's stale variables give way. No launch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from acc_train import UserError, resolve_strategy
from acc_train.launch.protocol import protocol_env, protocol_variables, shell_leftovers
from acc_train.strategy import Machine

from tests.conftest import run_cli

CPU2 = Machine("cpu", 2)


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """``set(strategy)``: the process environment as a launched worker sees it (the shell's
    launch variables cleared, the strategy's exported)."""
    import os

    for name in list(os.environ):
        if any(name == v or (v.endswith("_") and name.startswith(v)) for v in protocol_variables()):
            monkeypatch.delenv(name)

    def set_for(strategy: Any, machine: Machine = CPU2) -> dict[str, str]:
        env = protocol_env(strategy.bind(machine), "no", tmp_path)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return env

    return set_for


#: FSDP plugin fields the strategy resolves against the model in before_prepare (its own plugin
#: says "no_wrap" until then); Accelerate resolves the variables' policy against the model in
#: prepare. Checked apart below.
WRAP_FIELDS = {"auto_wrap_policy", "transformer_cls_names_to_wrap", "min_num_params"}

FSDP_VARIANTS = [
    ("fsdp", {}),
    ("fsdp1", {}),
    ("fsdp2", {}),
    ("fsdp-offload", {}),
    ("fsdp", {"reshard_after_forward": False, "activation_checkpointing": True, "state_dict_type": "full", "cpu_ram_efficient_loading": True}),
    ("fsdp", {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}),
    ("fsdp", {"auto_wrap_policy": "size", "min_num_params": 1000}),
    ("fsdp", {"auto_wrap_policy": "none"}),
    ("fsdp1", {"sharding_strategy": "shard_grad_op", "backward_prefetch": "none", "forward_prefetch": True}),
    ("fsdp1", {"sharding_strategy": "no_shard", "backward_prefetch": "backward_post", "use_orig_params": True}),
]


@pytest.mark.parametrize(("name", "options"), FSDP_VARIANTS, ids=[f"{n}-{'-'.join(o) or 'defaults'}" for n, o in FSDP_VARIANTS])
def test_fsdp_variables_build_the_strategys_own_plugin(name: str, options: dict, launch_env) -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    strategy = resolve_strategy(name, options).bind(CPU2)
    own = strategy.accelerator_kwargs(None)["fsdp_plugin"]
    env = launch_env(strategy)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    from_env = FullyShardedDataParallelPlugin()  # as Accelerator() builds it in a launched worker
    for field in dataclasses.fields(FullyShardedDataParallelPlugin):
        if field.name not in WRAP_FIELDS:
            assert getattr(from_env, field.name) == getattr(own, field.name), field.name
    policy = strategy.options.auto_wrap_policy
    expected = {"transformer": transformer_auto_wrap_policy, "size": size_based_auto_wrap_policy, "none": None}[policy]
    assert from_env.auto_wrap_policy is expected
    if policy == "transformer":  # unset: Accelerate takes the model's _no_split_modules, as the strategy does
        assert from_env.transformer_cls_names_to_wrap == strategy.options.transformer_layer_cls_to_wrap
    if policy == "size":
        assert from_env.min_num_params == strategy.options.min_num_params


DS_VARIANTS = [
    ("zero1", {}),
    ("zero2", {}),
    ("zero3", {}),
    ("zero2-offload", {}),
    ("zero3-offload", {}),
    ("zero3", {"zero3_init_flag": True, "zero3_save_16bit_model": True}),
    # no variable carries these: a DeepSpeed JSON written for the launch does
    ("zero2", {"overlap_comm": True, "contiguous_gradients": False, "reduce_bucket_size": 1000, "allgather_bucket_size": 2000}),
    ("zero3", {"offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": "/local_nvme"}),
]

#: DeepSpeedPlugin fields compared directly; the config's zero_optimization is compared below
DS_FIELDS = ("zero_stage", "offload_optimizer_device", "offload_param_device", "zero3_init_flag", "zero3_save_16bit_model")


def _zero_section(config: dict) -> dict:
    """zero_optimization without the entries that say "nothing" (an offload to device none, a
    stage-3 setting below stage 3, where Accelerate's plugin writes it and DeepSpeed ignores it)."""
    zero = dict(config["zero_optimization"])
    if zero["stage"] < 3:
        zero.pop("stage3_gather_16bit_weights_on_model_save", None)
    for key in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(key), dict) and zero[key].get("device") in (None, "none"):
            del zero[key]
        elif isinstance(zero.get(key), dict):
            zero[key] = {k: v for k, v in zero[key].items() if v is not None}
    return zero


@pytest.mark.parametrize(("name", "options"), DS_VARIANTS, ids=[f"{n}-{'-'.join(o) or 'defaults'}" for n, o in DS_VARIANTS])
def test_deepspeed_variables_build_the_strategys_own_plugin(name: str, options: dict, launch_env) -> None:
    from accelerate.utils import DeepSpeedPlugin

    strategy = resolve_strategy(name, options).bind(CPU2)
    own = strategy.accelerator_kwargs(None)["deepspeed_plugin"]
    env = launch_env(strategy)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    from_env = DeepSpeedPlugin()  # as Accelerator() and TrainingArguments build it in a launched worker
    for field in DS_FIELDS:
        assert getattr(from_env, field) == getattr(own, field), field
    assert _zero_section(from_env.deepspeed_config) == _zero_section(own.deepspeed_config)
    # what the job decides in acc-train's loop stays "auto" for the program (or its Trainer) to fill
    assert from_env.deepspeed_config["gradient_accumulation_steps"] == "auto"
    assert from_env.deepspeed_config["gradient_clipping"] == "auto"
    carried_by_json = any(k in options for k in ("overlap_comm", "nvme_path"))
    assert ("ACCELERATE_DEEPSPEED_CONFIG_FILE" in env) == carried_by_json
    assert ("ACCELERATE_DEEPSPEED_ZERO_STAGE" in env) == (not carried_by_json)  # Accelerate refuses both


def test_a_deepspeed_config_file_is_named_as_given(launch_env, tmp_path: Path) -> None:
    from accelerate.utils import DeepSpeedPlugin

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "gradient_clipping": 0.5}))
    env = launch_env(resolve_strategy("deepspeed", {"config_file": str(path)}))
    assert env == {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "true", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == 2 and plugin.deepspeed_config["gradient_clipping"] == 0.5


def test_ddp_needs_no_variable(launch_env) -> None:
    assert launch_env(resolve_strategy("ddp")) == {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "true"}
    assert launch_env(resolve_strategy("ddp"), Machine("cuda", 8)) == {"ACCELERATE_MIXED_PRECISION": "no"}


@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({"tp": 2}, "strategy.tp"),
        ({"dp_shard": 2}, "strategy.dp_shard"),
        ({"mixed_precision_policy": {"param_dtype": "bf16"}}, "strategy.mixed_precision_policy"),
    ],
)
def test_fsdp_options_no_variable_carries_are_refused_by_name(options: dict, where: str, tmp_path: Path) -> None:
    with pytest.raises(UserError) as err:
        resolve_strategy("fsdp", options).bind(CPU2).launch_protocol().launch_env(tmp_path)
    assert err.value.where == where
    assert "Accelerator(" in err.value.hint  # what to do in the program instead


def test_a_strategy_declaring_another_accelerate_type_without_a_mapping_is_refused(tmp_path: Path) -> None:
    from acc_train import Strategy, StrategyOptions

    class Sharded(Strategy[StrategyOptions]):
        name = "sharded-elsewhere"
        accelerate_distributed_types = ("FSDP",)

        def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
            return {}

    strategy = Sharded().configure(StrategyOptions()).bind(CPU2)
    assert strategy.launch_protocol() is None
    with pytest.raises(UserError, match="declares no `acc-train launch` mapping"):
        protocol_env(strategy, "no", tmp_path)


def test_stale_shell_variables_give_way_and_the_same_values_stay_quiet() -> None:
    env = {"ACCELERATE_USE_CPU": "true", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_MIXED_PRECISION": "no"}
    shell = {
        "ACCELERATE_USE_CPU": "1",  # the same, spelt otherwise
        "FSDP_VERSION": "1",  # contradicts
        "ACCELERATE_USE_DEEPSPEED": "true",  # another strategy's
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_LOG_LEVEL": "info",  # not a launch variable
        "HOME": "/root",
    }
    assert shell_leftovers(env, shell, protocol_variables()) == {
        "FSDP_VERSION": "1", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "equivalent"),
    [
        ("--use_fsdp", "--strategy fsdp"),
        ("--use-deepspeed", "--strategy deepspeed"),
        ("--mixed_precision=bf16", "--mixed-precision"),
        ("--fsdp_sharding_strategy", "--set strategy.OPTION=VALUE"),
        ("--num_processes", "--num-processes"),
    ],
)
def test_an_accelerate_launch_flag_names_the_acc_train_equivalent(flag: str, equivalent: str, tmp_path: Path) -> None:
    proc = run_cli("launch", flag, "train.py", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "is an `accelerate launch` flag" in proc.stderr and equivalent in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_missing_script_or_module_is_refused_before_launch(tmp_path: Path) -> None:
    proc = run_cli("launch", "nope.py", cwd=tmp_path)
    assert proc.returncode == 2 and "script 'nope.py' does not exist" in proc.stderr
    proc = run_cli("launch", "-m", "no_such_module_here.sub", cwd=tmp_path)
    assert proc.returncode == 2 and "no module named 'no_such_module_here.sub'" in proc.stderr
    assert list(tmp_path.iterdir()) == []
