"""DeepSpeed JSON configs and ``accelerate config`` DeepSpeed sections.

A DeepSpeed JSON given as ``strategy.config_file`` is used as given, except that ``"auto"``
values are filled from the job (as the transformers Trainer does). Batch size, accumulation and
clipping have one source of truth, the job's ``training`` section: a JSON value that
contradicts it is an error showing both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from acc_train.api import UserError, check_accelerate_section

__all__ = ["load_ds_config", "from_accelerate_section"]

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


def load_ds_config(path: str, micro_batch_size: int, accumulation: int, clipping: float, mixed_precision: str) -> dict[str, Any]:
    """Read a DeepSpeed JSON and fill or check what the job decides."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"DeepSpeed config {path!r} does not exist", where="strategy.config_file")
    try:
        config = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"not valid JSON: {exc.msg}", where=f"{path}:{exc.lineno}:{exc.colno}") from None
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


ACCELERATE_KEYS = {
    "zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
    "offload_param_nvme_path", "zero3_init_flag", "zero3_save_16bit_model", "gradient_accumulation_steps",
    "gradient_clipping", "deepspeed_multinode_launcher", "deepspeed_config_file", "deepspeed_hostfile",
}  # fmt: skip


def from_accelerate_section(section: dict[str, Any]) -> dict[str, Any]:
    """``deepspeed_config`` of an ``accelerate config`` YAML -> acc-train config sections."""
    check_accelerate_section(section, ACCELERATE_KEYS, "deepspeed_config")
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
    strategy["stage"] = int(section.get("zero_stage", 2))  # accelerate's default when the file is silent
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
        training["gradient_accumulation_steps"] = int(section["gradient_accumulation_steps"])
    if "gradient_clipping" in section:
        clip = float(section["gradient_clipping"])
        training["max_grad_norm"] = clip if clip > 0 else None
    out: dict[str, Any] = {"strategy": strategy}
    if training:
        out["training"] = training
    return out
