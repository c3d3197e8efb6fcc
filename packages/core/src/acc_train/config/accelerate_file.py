"""Config files written by ``accelerate config``, read as acc-train configs.

Core maps the top level (processes, machines, precision). Which strategy a
``distributed_type`` selects is declared by the strategies themselves
(``Strategy.accelerate_distributed_types``), and the plugin answering the
``acc_train_accelerate_config`` hook maps its own section of the file.
"""

from __future__ import annotations

from typing import Any

from acc_train.config.sources import deep_merge
from acc_train.errors import UserError, closest
from acc_train.plugins import KNOWN_STRATEGY_PACKAGES, accelerate_config_section, strategies

__all__ = ["is_accelerate_config", "from_accelerate_config", "check_accelerate_section"]

#: top-level keys of an accelerate config file that carry nothing acc-train needs to act on
ACCELERATE_PASSIVE_KEYS = {
    "compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity", "gpu_ids",
    "main_training_function", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
    "use_cpu", "dynamo_config", "megatron_lm_config",
}  # fmt: skip
ACCELERATE_MAPPED_KEYS = {
    "distributed_type", "mixed_precision", "num_processes", "num_machines", "machine_rank",
    "main_process_ip", "main_process_port", "rdzv_backend",
}  # fmt: skip


def check_accelerate_section(section: dict[str, Any], known: Any, name: str) -> None:
    """Refuse keys of an ``accelerate config`` section (``fsdp_config``...) that a plugin does
    not map, suggesting the closest one it does."""
    for key in section:
        if key not in known:
            near = closest(key, known)
            raise UserError(
                f"unknown or unsupported key {key!r}" + (f'; did you mean "{near}"?' if near else ""),
                where=f"{name}.{key}",
                hint=f"acc-train maps these {name} keys: " + ", ".join(sorted(known)),
            )


def is_accelerate_config(data: dict[str, Any]) -> bool:
    return "distributed_type" in data or "compute_environment" in data


def from_accelerate_config(data: dict[str, Any], file: str) -> dict[str, Any]:
    """An ``accelerate config`` YAML as an acc-train config. Core maps the top level; the
    strategy plugin that answers ``acc_train_accelerate_config`` maps its own section."""
    installed = [strategy for strategy, _owner in strategies().primary()]
    kind = str(data.get("distributed_type", "NO"))
    declared = [strategy for strategy in installed if kind in strategy.accelerate_distributed_types]
    if not declared and kind.lower() in KNOWN_STRATEGY_PACKAGES:  # one of acc-train's own, not installed here
        raise strategies().not_found(kind.lower())
    sections = {key for strategy in installed for key in strategy.accelerate_config_sections}
    known = ACCELERATE_PASSIVE_KEYS | ACCELERATE_MAPPED_KEYS | sections
    for key in data:
        if key.endswith("_config") and key not in known and not data[key]:
            continue  # an empty section of a strategy that is not installed
        if key not in known:
            near = closest(key, known)
            raise UserError(
                f"unknown accelerate config key {key!r}" + (f'; did you mean "{near}"?' if near else ""),
                where=file,
                hint="this file was read as an `accelerate config` file because it has distributed_type",
            )
    if str(data.get("compute_environment", "LOCAL_MACHINE")) != "LOCAL_MACHINE":
        raise UserError(f"compute_environment {data['compute_environment']!r} is not supported", where=file, hint="use LOCAL_MACHINE")
    out: dict[str, Any] = {"launch": {}}
    machines = int(data.get("num_machines", 1))
    if "num_processes" in data:  # accelerate counts processes over all machines
        total = int(data["num_processes"])
        if total % machines:
            raise UserError(f"num_processes {total} does not divide over num_machines {machines}", where=file)
        out["launch"]["num_processes"] = total // machines
    out["launch"]["num_machines"] = machines
    for key in ("machine_rank", "main_process_ip", "main_process_port", "rdzv_backend"):
        if data.get(key) not in (None, ""):
            out["launch"][key] = data[key]
    if "mixed_precision" in data:
        mp = data["mixed_precision"]
        out["training"] = {"mixed_precision": "no" if mp in (False, None) else str(mp)}
    if out["launch"].get("rdzv_backend") not in (None, "static", "c10d"):
        raise UserError(f"rdzv_backend {out['launch']['rdzv_backend']!r} is not supported", where=file, hint="use static or c10d")
    section = accelerate_config_section(kind, data)
    if section is not None:
        return deep_merge(out, section)
    if not declared:
        answers = sorted({t for strategy in installed for t in strategy.accelerate_distributed_types})
        raise UserError(
            f"distributed_type {kind} is not supported by the installed strategies",
            where=file,
            hint="they answer to: " + (", ".join(answers) or "none"),
        )
    out["strategy"] = {"name": declared[0].name}
    return out
