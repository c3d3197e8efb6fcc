"""acc-train plugin: the ``deepspeed`` strategy and its checkpoint format. No deepspeed, torch or
accelerate import at module level: listing strategies stays fast."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from acc_train.api import CheckpointFormat, Question, Strategy, hookimpl
from acc_train_deepspeed.checkpoint import DeepSpeedCheckpointFormat
from acc_train_deepspeed.config import from_accelerate_section
from acc_train_deepspeed.strategy import DeepSpeedStrategy


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


@hookimpl
def acc_train_library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"deepspeed": version("deepspeed")}
    except PackageNotFoundError:
        return {}


@hookimpl
def acc_train_config_questions(strategy_name: str) -> list[Question] | None:
    if strategy_name != DeepSpeedStrategy.name:
        return None
    offload = ("none", "cpu", "nvme")
    return [
        Question("stage", "ZeRO stage", default=3, choices=(0, 1, 2, 3), help="1 shards optimizer state, 2 also gradients, 3 also parameters"),
        Question("offload_optimizer", "Offload optimizer state to", default="none", choices=offload, when=lambda a: a.get("stage") != 0),
        Question("offload_param", "Offload parameters to", default="none", choices=offload, when=lambda a: a.get("stage") == 3),
        Question(
            "nvme_path",
            "NVMe offload directory",
            default="/local_nvme",
            when=lambda a: "nvme" in (a.get("offload_optimizer"), a.get("offload_param")),
        ),
        Question("zero3_init_flag", "Build the model already partitioned (very large models)?", default=False, choices=(False, True), when=lambda a: a.get("stage") == 3),
    ]
