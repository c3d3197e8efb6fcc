"""DeepSpeed JSON configs and ``accelerate config`` DeepSpeed sections.

A DeepSpeed JSON given as ``strategy.config_file`` is used as given, except that ``"auto"``
values are filled from the job (as the transformers Trainer does). Batch size, accumulation and
clipping have one source of truth, the job's ``training`` section: a JSON value that
contradicts it is an error showing both.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from acc_train.api import UserError, read_accelerate_section, read_user_json

__all__ = ["load_ds_config", "read_ds_config", "ds_zero_stage", "from_accelerate_section", "AccelerateDeepSpeedSection"]

AUTO = "auto"


def _check(config: dict[str, Any], key: str, job_value: Any, job_key: str, file: str) -> None:
    value = config.get(key, AUTO)
    if value == AUTO:
        config[key] = job_value
    elif value != job_value:
        raise UserError(
            f"{key} is {value!r} in the DeepSpeed config but the job's {job_key} is {job_value!r}",
            where=f"{file}: {key}",
            hint=f'set it to "auto" (the job\'s value is used) or change {job_key}',
        )


def read_ds_config(path: str) -> dict[str, Any]:
    """A DeepSpeed JSON as a mapping: a file that is missing, not UTF-8, not JSON or not an
    object is a :class:`UserError` naming ``strategy.config_file`` and the file."""
    return read_user_json(path, what="DeepSpeed config", where="strategy.config_file", kind=dict)


def ds_zero_stage(config: dict[str, Any], path: str) -> int:
    """The ZeRO stage a DeepSpeed JSON sets (0 when silent), checked."""
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if not (isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3):
        shown = zero if not isinstance(zero, dict) else stage
        raise UserError(f"zero_optimization.stage must be 0, 1, 2 or 3, not {shown!r:.80}", where=f"{path}: zero_optimization")
    return stage


def load_ds_config(path: str, micro_batch_size: int, accumulation: int, clipping: float, mixed_precision: str) -> dict[str, Any]:
    """Read a DeepSpeed JSON and fill or check what the job decides."""
    config = read_ds_config(path)
    ds_zero_stage(config, path)
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise UserError(
                f"the DeepSpeed config has an {section!r} section; acc-train's own optimizer and scheduler sections configure them",
                where=f"{path}: {section}",
                hint=f"remove {section!r} from the JSON and set the job's {section} instead",
            )
    _check(config, "train_micro_batch_size_per_gpu", micro_batch_size, "training.micro_batch_size", path)
    _check(config, "gradient_accumulation_steps", accumulation, "training.gradient_accumulation_steps", path)
    _check(config, "gradient_clipping", clipping, "training.max_grad_norm", path)
    if config.get("train_batch_size") not in (None, AUTO):
        raise UserError(
            "train_batch_size is derived (micro-batch x accumulation x processes)",
            where=f"{path}: train_batch_size",
            hint='set it to "auto" or remove it',
        )
    config["train_batch_size"] = AUTO  # Accelerate fills it once the number of processes is known
    for dtype, enabled in (("fp16", mixed_precision == "fp16"), ("bf16", mixed_precision == "bf16")):
        section = config.get(dtype)
        if isinstance(section, dict):
            if section.get("enabled") == AUTO:
                section["enabled"] = enabled
            elif bool(section.get("enabled")) != enabled:
                raise UserError(
                    f"{dtype}.enabled is {section.get('enabled')!r} in the DeepSpeed config but the job's mixed precision is {mixed_precision!r}",
                    where=f"{path}: {dtype}.enabled",
                    hint='set it to "auto" or change training.mixed_precision',
                )
    return config


class AccelerateDeepSpeedSection(BaseModel):
    """The ``deepspeed_config`` keys acc-train maps, typed as ``accelerate config`` writes them."""

    model_config = ConfigDict(extra="forbid")
    zero_stage: Literal[0, 1, 2, 3] = 2  # accelerate's default when the file is silent
    offload_optimizer_device: Literal["none", "cpu", "nvme"] | None = None
    offload_param_device: Literal["none", "cpu", "nvme"] | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    gradient_accumulation_steps: StrictInt | None = Field(None, ge=1)
    #: 0 or less turns clipping off
    gradient_clipping: float | None = Field(None, allow_inf_nan=False)
    deepspeed_multinode_launcher: str | None = None
    deepspeed_config_file: str | None = None
    deepspeed_hostfile: str | None = None


def from_accelerate_section(section: dict[str, Any]) -> dict[str, Any]:
    """``deepspeed_config`` of an ``accelerate config`` YAML -> acc-train config sections."""
    parsed = read_accelerate_section(section, AccelerateDeepSpeedSection, "deepspeed_config")
    section = {key: getattr(parsed, key) for key in parsed.model_fields_set if getattr(parsed, key) is not None}
    launcher = section.get("deepspeed_multinode_launcher")
    if launcher not in (None, "standard") or section.get("deepspeed_hostfile") not in (None, "", "none"):
        sys.stderr.write(
            "warning: deepspeed_config.deepspeed_multinode_launcher/deepspeed_hostfile are not used: acc-train starts "
            "workers with PyTorch's elastic launcher (--num-machines, --machine-rank, --main-process-ip)\n"
        )
    strategy: dict[str, Any] = {"name": "deepspeed"}
    training: dict[str, Any] = {}
    if section.get("deepspeed_config_file"):  # the JSON decides ZeRO; accelerate ignores the rest too
        strategy["config_file"] = section["deepspeed_config_file"]
        return {"strategy": strategy}
    strategy["stage"] = parsed.zero_stage
    for src, dst in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
        if section.get(src) not in (None, "none"):
            strategy[dst] = str(section[src])
    nvme = section.get("offload_optimizer_nvme_path") or section.get("offload_param_nvme_path")
    if nvme not in (None, "none") and "nvme" in (strategy.get("offload_optimizer"), strategy.get("offload_param")):
        strategy["nvme_path"] = nvme
    if strategy["stage"] == 3:
        for key in ("zero3_init_flag", "zero3_save_16bit_model"):
            if key in section:
                strategy[key] = bool(section[key])
    if "gradient_accumulation_steps" in section:
        training["gradient_accumulation_steps"] = section["gradient_accumulation_steps"]
    if "gradient_clipping" in section:
        clip = section["gradient_clipping"]
        training["max_grad_norm"] = clip if clip > 0 else None
    out: dict[str, Any] = {"strategy": strategy}
    if training:
        out["training"] = training
    return out
