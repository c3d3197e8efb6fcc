"""acc-train plugin: the ``fsdp`` strategy, its wrap policies and checkpoint formats, and the
mapping of an ``accelerate config`` FSDP section. Imports no torch at module level."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from acc_train import Strategy, WrapPolicy, hookimpl
from acc_train.checkpoint import CheckpointFormat
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
    return {"strategy": strategy_from_accelerate_config(config.get("fsdp_config") or {})}
