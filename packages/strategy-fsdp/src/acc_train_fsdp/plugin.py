"""acc-train plugin: the ``fsdp`` strategy, its wrap policies and checkpoint formats, and the
mapping of an ``accelerate config`` FSDP section. Imports no torch at module level."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from acc_train.api import CheckpointFormat, Question, Strategy, WrapPolicy, hookimpl
from acc_train_fsdp.accelerate_config import strategy_from_accelerate_config
from acc_train_fsdp.checkpoint import FullFormat
from acc_train_fsdp.policies import NoWrapPolicy, SizePolicy, TransformerLayerPolicy
from acc_train_fsdp.strategy import FSDPStrategy


@hookimpl
def acc_train_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(FSDPStrategy())


@hookimpl
def acc_train_register_wrap_policies(register: Callable[[WrapPolicy], None]) -> None:
    register(TransformerLayerPolicy())
    register(SizePolicy())
    register(NoWrapPolicy())


@hookimpl
def acc_train_register_checkpoint_formats(register: Callable[[CheckpointFormat], None]) -> None:
    register(FullFormat())


@hookimpl
def acc_train_accelerate_config(distributed_type: str, config: dict[str, Any]) -> dict[str, Any] | None:
    if distributed_type != "FSDP":
        return None
    return {"strategy": strategy_from_accelerate_config(config.get("fsdp_config") or {}, config.get("parallelism_config"))}


@hookimpl
def acc_train_config_questions(strategy_name: str) -> list[Question] | None:
    if strategy_name != FSDPStrategy.name:
        return None
    from acc_train.api import wrap_policies

    return [
        Question("version", "FSDP version", default=2, choices=(2, 1), help="2: fully_shard (per-parameter DTensors); 1: FullyShardedDataParallel"),
        Question(
            "sharding_strategy",
            "Sharding strategy",
            default="full_shard",
            choices=("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"),
            when=lambda a: a.get("version") == 1,
        ),
        Question(
            "reshard_after_forward",
            "Free gathered parameters after forward (full shard)?",
            default=True,
            choices=(True, False),
            when=lambda a: a.get("version") == 2,
        ),
        Question("auto_wrap_policy", "Wrap policy", default="transformer", choices=tuple(wrap_policies().names())),
        Question("min_num_params", "Minimum parameters per unit", default=100_000_000, when=lambda a: a.get("auto_wrap_policy") == "size"),
        Question("activation_checkpointing", "Recompute activations in backward?", default=False, choices=(False, True)),
        Question(
            "state_dict_type",
            "Checkpoint state",
            default="sharded",
            choices=("sharded", "full"),
            help="sharded: each rank writes its shards (portable); full: gathered on rank 0",
        ),
        Question("cpu_offload", "Offload parameters to CPU memory (GPU runs only)?", default=False, choices=(False, True)),
    ]
