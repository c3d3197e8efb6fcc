"""FSDP options, wrap policies and accelerate-config mapping: strict, with errors that say what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from acc_train import Machine, UserError, resolve_strategy
from acc_train.config import load_job
from acc_train_fsdp import FSDPStrategy
from acc_train_fsdp.accelerate_config import strategy_from_accelerate_config
from acc_train_fsdp.policies import layer_class_names


def test_presets_and_defaults() -> None:
    job = load_job(flags={"strategy.name": ("fsdp1", "--strategy")})
    assert job.strategy.options.version == 1
    assert load_job(flags={"strategy.name": ("fsdp", "--strategy")}).strategy.options.version == 2
    assert load_job(flags={"strategy.name": ("fsdp-offload", "--strategy")}).strategy.options.cpu_offload is True


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"version": 2, "backward_prefetch": "backward_pre"}, "backward_prefetch is an FSDP1 option"),
        ({"version": 2, "sharding_strategy": "full_shard"}, "use reshard_after_forward under FSDP2"),
        ({"version": 1, "reshard_after_forward": False}, "reshard_after_forward .*is an FSDP2 option"),
        ({"auto_wrap_policy": "size", "transformer_layer_cls_to_wrap": ["X"]}, "used by the transformer wrap policy only"),
        ({"sharding": "full"}, "Extra inputs"),
    ],
)
def test_options_that_belong_elsewhere_are_errors(options: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        FSDPStrategy().parse_options(options)


def test_conflicts_with_the_machine_are_errors_with_hints() -> None:
    with pytest.raises(UserError, match="would do nothing"):
        resolve_strategy("fsdp", {"cpu_offload": True}).bind(Machine("cpu", 2)).check_environment()
    with pytest.raises(UserError, match="this run has one machine"):
        resolve_strategy("fsdp", {"version": 1, "sharding_strategy": "hybrid_shard"}).bind(Machine("cuda", 8, 1)).check_environment()
    resolve_strategy("fsdp", {"version": 1, "sharding_strategy": "hybrid_shard"}).bind(Machine("cuda", 16, 2)).check_environment()


def test_layer_class_that_the_model_lacks_names_the_closest_one(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert layer_class_names(model, None) == ["LlamaDecoderLayer"]  # from _no_split_modules
    with pytest.raises(UserError, match='did you mean "LlamaDecoderLayer"'):
        layer_class_names(model, ["LlamaDecoderLayr"])


def test_accelerate_fsdp_section_maps_onto_options() -> None:
    section = strategy_from_accelerate_config(
        {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer,MLP",
            "fsdp_reshard_after_forward": False,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_offload_params": False,
            "fsdp_activation_checkpointing": True,
            "fsdp_cpu_ram_efficient_loading": True,
        }
    )
    assert section == {
        "name": "fsdp",
        "version": 2,
        "reshard_after_forward": False,
        "auto_wrap_policy": "transformer",
        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer", "MLP"],
        "cpu_offload": False,
        "activation_checkpointing": True,
        "cpu_ram_efficient_loading": True,
        "state_dict_type": "full",
    }
    assert strategy_from_accelerate_config({})["version"] == 1  # accelerate's default


def test_unknown_accelerate_fsdp_key_suggests_the_known_one() -> None:
    with pytest.raises(UserError, match='did you mean "fsdp_offload_params"'):
        strategy_from_accelerate_config({"fsdp_ofload_params": True})


def test_registry_names_of_the_fsdp_plugin() -> None:
    from acc_train import plugins

    assert {"fsdp", "fsdp1", "fsdp2", "fsdp-offload", "fully-sharded"} <= set(plugins.strategies().names())
    assert plugins.wrap_policies().names() == ["none", "size", "transformer"]
    assert {"dcp", "fsdp-full"} <= set(plugins.checkpoint_formats().names())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"version": 1, "use_orig_params": False}, "needs use_orig_params: true"),
        ({"mixed_precision_policy": {"buffer_dtype": "bf16"}}, "buffer_dtype is an FSDP1 option"),
        ({"activation_checkpointing": True, "auto_wrap_policy": "none"}, "needs a wrap policy that selects layers"),
        ({"min_num_params": 1000}, "used by the size wrap policy only"),
    ],
)
def test_options_that_would_do_nothing_or_crash_are_refused(options: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        FSDPStrategy().parse_options(options)


def test_accelerate_fsdp1_sharding_strategy_written_as_reshard_after_forward() -> None:
    section = strategy_from_accelerate_config({"fsdp_version": 1, "fsdp_reshard_after_forward": "HYBRID_SHARD"})
    assert section["sharding_strategy"] == "hybrid_shard"


@pytest.mark.parametrize(
    ("options", "machine", "shards"),
    [
        ({}, Machine("cpu", 4), 4),
        ({"version": 2, "reshard_after_forward": False}, Machine("cpu", 4), 4),  # sharded at rest, gathered in between
        ({"version": 1, "sharding_strategy": "no_shard"}, Machine("cpu", 4), 1),
        ({"version": 1, "sharding_strategy": "hybrid_shard"}, Machine("cuda", 16, num_machines=2), 8),
        ({"dp_replicate": 2}, Machine("cpu", 4), 2),  # HSDP: each replica shards over dp_shard
        ({"dp_shard": 4}, Machine("cuda", 16, num_machines=2), 4),
    ],
)
def test_parameter_shards_follow_the_sharding_strategy(options: dict, machine: Machine, shards: int) -> None:
    assert resolve_strategy("fsdp", options).planner().parameter_shards(machine) == shards


def test_the_reported_version_is_the_wrapped_modules_not_the_option() -> None:
    """run.json's fsdp_version comes from what prepare made of the model: a model nothing
    wrapped reports None, whatever the options asked for."""
    import torch

    class Prepared:
        _models = [torch.nn.Sequential(torch.nn.Linear(2, 2))]

    assert resolve_strategy("fsdp", {"version": 2}).summary(Prepared()) == {"fsdp_version": None, "mesh": None}
    assert resolve_strategy("fsdp1").summary(Prepared()) == {"fsdp_version": None, "mesh": None}


def test_accelerate_parallelism_config_maps_onto_the_mesh_options_as_written() -> None:
    fsdp2 = {"fsdp_version": 2}
    sizes = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2, "parallelism_config_cp_size": 1}
    section = strategy_from_accelerate_config(fsdp2, sizes)
    assert section == {"name": "fsdp", "version": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2}
    # a size the file leaves out is 1, as in Accelerate (not "the rest of the world")
    assert strategy_from_accelerate_config(fsdp2, {"parallelism_config_tp_size": 2}) == {"name": "fsdp", "version": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 2}
    assert strategy_from_accelerate_config(fsdp2, {}) == strategy_from_accelerate_config(fsdp2, None) == {"name": "fsdp", "version": 2}
    assert strategy_from_accelerate_config(fsdp2, {"parallelism_config_cp_backend": "torch"}) == {"name": "fsdp", "version": 2}  # no size: no mesh
    cp = {"parallelism_config_dp_shard_size": 2, "parallelism_config_cp_size": 2, "parallelism_config_cp_comm_strategy": "alltoall"}
    assert strategy_from_accelerate_config(fsdp2, cp) == {"name": "fsdp", "version": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "cp_comm_strategy": "alltoall"}


@pytest.mark.parametrize(
    ("fsdp", "parallelism", "where", "message"),
    [
        ({}, {"parallelism_config_dp_shard_size": 2}, "parallelism_config", "needs FSDP2"),
        ({"fsdp_version": 2}, {"parallelism_config_tp_sise": 2}, "parallelism_config.parallelism_config_tp_sise", 'did you mean "parallelism_config_tp_size"'),
        ({"fsdp_version": 2}, {"parallelism_config_dp_shard_size": 0}, "parallelism_config.parallelism_config_dp_shard_size", "greater than or equal to 1"),
        ({"fsdp_version": 2}, {"parallelism_config_sp_size": 2}, "parallelism_config.parallelism_config_sp_size", "sequence parallelism"),
        ({"fsdp_version": 2}, {"parallelism_config_cp_comm_strategy": "alltoall"}, "parallelism_config.parallelism_config_cp_comm_strategy", "context parallelism only"),
        ({"fsdp_version": 2}, {"parallelism_config_cp_size": 2, "parallelism_config_cp_comm_strategy": "ring"}, "parallelism_config.parallelism_config_cp_comm_strategy", "allgather"),
    ],
)
def test_accelerate_parallelism_config_that_acc_train_cannot_run_is_refused(fsdp: dict, parallelism: dict, where: str, message: str) -> None:
    with pytest.raises(UserError, match=message) as caught:
        strategy_from_accelerate_config(fsdp, parallelism)
    assert caught.value.where == where


def _meta_llama(layers: int = 4, vocab: int = 256) -> object:
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("options", "refused"),
    [
        ({"auto_wrap_policy": "transformer"}, None),
        ({"auto_wrap_policy": "none"}, None),  # one unit, asked for by name
        ({"auto_wrap_policy": "size", "min_num_params": 1_000}, None),  # each layer (and its parts) a unit
        # the default 1e8 wraps none of a small model's layers: every one gathered at once
        ({"auto_wrap_policy": "size"}, "puts 4 of the model's 4 LlamaDecoderLayer layers into the root unit, 100.0% of the parameters"),
        # above one layer, below the stack: the layers' ModuleList is one unit around all of them
        ({"auto_wrap_policy": "size", "min_num_params": 100_000}, "puts 4 of the model's 4 LlamaDecoderLayer layers into one ModuleList unit"),
    ],
)
def test_a_wrap_policy_that_leaves_the_layers_in_the_root_unit_is_refused(options: dict, refused: str | None) -> None:
    strategy = resolve_strategy("fsdp", options)
    model = _meta_llama()
    if refused is None:
        strategy.check_model(model)
        return
    with pytest.raises(UserError, match=refused) as caught:
        strategy.check_model(model)
    assert caught.value.where == "strategy.auto_wrap_policy"
    assert "set strategy.min_num_params below 41,088" in caught.value.hint  # one layer: 4*64*64 + 3*64*128 + 2*64


def test_a_plugin_wrap_policy_that_wraps_the_wrong_modules_is_refused() -> None:
    from acc_train.api import WrapPolicy
    from acc_train_fsdp.policies import check_units

    class NormsOnly(WrapPolicy):
        name = "norms"
        description = "each RMSNorm a unit"

        def build(self, model: object, options: dict) -> object:
            return lambda module: type(module).__name__ == "LlamaRMSNorm"

    with pytest.raises(UserError, match=r"puts 2 of the model's 2 LlamaDecoderLayer layers into the root unit, 99.7%") as caught:
        check_units(_meta_llama(layers=2), NormsOnly(), {})
    assert "auto_wrap_policy: transformer" in caught.value.hint


def test_compile_under_fsdp1_is_refused_before_launch() -> None:
    """FSDP1 compiled trains but saves its root unit's parameters as flat pieces, which no
    resume can load (tests/matrix found it): refused, pointing at FSDP2, which compiles."""
    with pytest.raises(UserError) as err:
        load_job(flags={"strategy.name": ("fsdp1", "--strategy")}, sets=["training.compile=true"])
    message = str(err.value)
    assert 'training.compile cannot run under strategy "fsdp": compiled under FSDP1' in message and "cannot be resumed" in message
    assert "--strategy fsdp" in message
    load_job(flags={"strategy.name": ("fsdp", "--strategy")}, sets=["training.compile=true"])  # FSDP2 compiles
