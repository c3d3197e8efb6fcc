"""acc-train plugin: the ``deepspeed`` strategy and its checkpoint format. No deepspeed, torch or
accelerate import at module level: listing strategies stays fast."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from acc_train import Strategy, hookimpl
from acc_train.checkpoint import CheckpointFormat
from acc_train_deepspeed.config import from_accelerate_section
from acc_train_deepspeed.strategy import DeepSpeedCheckpointFormat, DeepSpeedStrategy


@hookimpl
def acc_train_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(DeepSpeedStrategy())


@hookimpl
def acc_train_accelerate_config(distributed_type: str, config: dict[str, Any]) -> dict[str, Any] | None:
    if distributed_type != "DEEPSPEED":
        return None
    return from_accelerate_section(config.get("deepspeed_config") or {})


@hookimpl
def acc_train_register_checkpoint_formats(register: Callable[[CheckpointFormat], None]) -> None:
    register(DeepSpeedCheckpointFormat())
