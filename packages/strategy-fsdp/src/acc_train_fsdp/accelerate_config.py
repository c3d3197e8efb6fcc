"""Map the ``fsdp_config`` section of an ``accelerate config`` YAML onto FSDP options.

Accelerate's own default applies where the file is silent: a file without ``fsdp_version``
means FSDP1, as it does for ``accelerate launch``.
"""

from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from acc_train.api import UserError, read_accelerate_section

__all__ = ["strategy_from_accelerate_config", "mesh_from_parallelism_config"]

SHARDING = {
    "FULL_SHARD": "full_shard", "SHARD_GRAD_OP": "shard_grad_op", "NO_SHARD": "no_shard",
    "HYBRID_SHARD": "hybrid_shard", "HYBRID_SHARD_ZERO2": "hybrid_shard_zero2",
    1: "full_shard", 2: "shard_grad_op", 3: "no_shard", 4: "hybrid_shard", 5: "hybrid_shard_zero2",
}  # fmt: skip
WRAP = {"TRANSFORMER_BASED_WRAP": "transformer", "SIZE_BASED_WRAP": "size", "NO_WRAP": "none"}
PREFETCH = {"BACKWARD_PRE": "backward_pre", "BACKWARD_POST": "backward_post", "NO_PREFETCH": "none"}
STATE_DICT = {"SHARDED_STATE_DICT": "sharded", "FULL_STATE_DICT": "full"}
#: ``parallelism_config`` sizes -> the fsdp strategy's mesh options (Accelerate's ParallelismConfig)
MESH = {"dp_replicate_size": "dp_replicate", "dp_shard_size": "dp_shard", "tp_size": "tp", "cp_size": "cp"}


class FsdpSection(BaseModel):
    """The ``fsdp_config`` keys acc-train maps, typed as ``accelerate config`` writes them
    (booleans also as ``true``/``false`` text, as older accelerate versions wrote them)."""

    model_config = ConfigDict(extra="forbid")
    fsdp_version: Literal[1, 2] = 1
    fsdp_sharding_strategy: str | StrictInt | None = None
    fsdp_reshard_after_forward: bool | str | None = None
    fsdp_auto_wrap_policy: str | None = None
    fsdp_transformer_layer_cls_to_wrap: str | list[str] | None = None
    fsdp_min_num_params: StrictInt | None = Field(None, ge=0)
    fsdp_backward_prefetch: str | None = None
    fsdp_backward_prefetch_policy: str | None = None
    fsdp_forward_prefetch: bool | None = None
    fsdp_offload_params: bool | None = None
    fsdp_activation_checkpointing: bool | None = None
    fsdp_state_dict_type: str | None = None
    fsdp_cpu_ram_efficient_loading: bool | None = None
    fsdp_sync_module_states: bool | None = None
    fsdp_use_orig_params: bool | None = None
    fsdp_activation_checkpointing_offload: bool | None = None
    fsdp_ignored_modules: Any = None


KNOWN = tuple(FsdpSection.model_fields)


class ParallelismSection(BaseModel):
    """The ``parallelism_config`` keys (Accelerate's ``ParallelismConfig``, FSDP2 only), as
    ``accelerate config`` writes them: every key carries the ``parallelism_config_`` prefix."""

    model_config = ConfigDict(extra="forbid")
    parallelism_config_dp_replicate_size: StrictInt = Field(1, ge=1)
    parallelism_config_dp_shard_size: StrictInt = Field(1, ge=1)
    parallelism_config_tp_size: StrictInt = Field(1, ge=1)
    parallelism_config_cp_size: StrictInt = Field(1, ge=1)
    parallelism_config_cp_backend: Literal["torch"] = "torch"
    parallelism_config_cp_comm_strategy: Literal["allgather", "alltoall"] | None = None
    #: DeepSpeed's sequence parallelism (ALST/Ulysses): refused above 1 (not the fsdp strategy's)
    parallelism_config_sp_size: StrictInt = Field(1, ge=1)


def _pick(table: dict[Any, str], value: Any, key: str) -> str:
    normal = value.upper() if isinstance(value, str) else value
    if normal not in table:
        valid = ", ".join(str(k) for k in table if isinstance(k, str))
        raise UserError(f"unsupported value {value!r}", where=f"fsdp_config.{key}", hint=f"use one of {valid}")
    return table[normal]


def _no_effect(key: str) -> None:
    sys.stderr.write(f"warning: fsdp_config.{key} has no effect under FSDP2 (fsdp_version: 2); it is not used\n")


def mesh_from_parallelism_config(section: Any, version: int) -> dict[str, Any]:
    """``parallelism_config`` -> the mesh options (``dp_replicate``, ``dp_shard``, ``tp``, ``cp``).

    The sizes are taken as the file gives them, as Accelerate does (their product must be the
    world size; a size left out is 1), so ``dp_shard_size: 1`` is no sharding, not "the rest"."""
    parsed = read_accelerate_section(section, ParallelismSection, "parallelism_config")
    given = parsed.model_fields_set
    if not given:
        return {}
    if version != 2:
        raise UserError(
            "parallelism_config needs FSDP2 (Accelerate refuses it without fsdp_version: 2)",
            where="parallelism_config",
            hint="set fsdp_config.fsdp_version: 2, or remove parallelism_config",
        )
    if parsed.parallelism_config_sp_size > 1:
        raise UserError(
            "sequence parallelism (sp_size, DeepSpeed's ALST/Ulysses) is not run by acc-train's fsdp strategy",
            where="parallelism_config.parallelism_config_sp_size",
            hint="use parallelism_config_cp_size (context parallelism) or remove sp_size",
        )
    sizes = {option: getattr(parsed, f"parallelism_config_{key}") for key, option in MESH.items()}
    if parsed.parallelism_config_cp_comm_strategy is not None and sizes["cp"] == 1:
        raise UserError(
            "cp_comm_strategy is used by context parallelism only, and parallelism_config_cp_size is 1",
            where="parallelism_config.parallelism_config_cp_comm_strategy",
            hint="set parallelism_config_cp_size above 1, or remove parallelism_config_cp_comm_strategy",
        )
    if not any(f"parallelism_config_{key}" in given for key in MESH):  # no size: no mesh (cp_backend alone changes nothing)
        return {}
    out = {"dp_replicate": sizes["dp_replicate"], "dp_shard": sizes["dp_shard"]}
    out.update({key: sizes[key] for key in ("tp", "cp") if sizes[key] > 1})
    if parsed.parallelism_config_cp_comm_strategy is not None:
        out["cp_comm_strategy"] = parsed.parallelism_config_cp_comm_strategy
    return out


def strategy_from_accelerate_config(section: dict[str, Any], parallelism: Any = None) -> dict[str, Any]:
    """``fsdp_config`` (and ``parallelism_config``, the FSDP2 mesh) -> the ``strategy:``
    section (``name: fsdp`` plus options)."""
    parsed = read_accelerate_section(section, FsdpSection, "fsdp_config")
    section = {key: getattr(parsed, key) for key in parsed.model_fields_set if getattr(parsed, key) is not None}
    version = parsed.fsdp_version
    out: dict[str, Any] = {"name": "fsdp", "version": version}
    if "fsdp_sharding_strategy" in section:
        strategy = _pick(SHARDING, section["fsdp_sharding_strategy"], "fsdp_sharding_strategy")
        if version == 1:
            out["sharding_strategy"] = strategy
        elif strategy in ("full_shard", "shard_grad_op"):
            out["reshard_after_forward"] = strategy == "full_shard"
        else:
            raise UserError(f"{strategy} is an FSDP1 sharding strategy; this file sets fsdp_version: 2", where="fsdp_config.fsdp_sharding_strategy")
    if "fsdp_reshard_after_forward" in section:  # accelerate writes FSDP1's sharding strategy here too
        value = section["fsdp_reshard_after_forward"]
        if version == 1:
            out["sharding_strategy"] = (
                _pick(SHARDING, value, "fsdp_reshard_after_forward") if isinstance(value, str) else ("full_shard" if value else "shard_grad_op")
            )
        else:
            if isinstance(value, str):
                value = _pick(SHARDING, value, "fsdp_reshard_after_forward") == "full_shard"
            out["reshard_after_forward"] = bool(value)
    if "fsdp_auto_wrap_policy" in section:
        out["auto_wrap_policy"] = _pick(WRAP, section["fsdp_auto_wrap_policy"], "fsdp_auto_wrap_policy")
    layers = section.get("fsdp_transformer_layer_cls_to_wrap")
    if layers:
        names = layers.split(",") if isinstance(layers, str) else layers
        out["transformer_layer_cls_to_wrap"] = [s.strip() for s in names if s.strip()]
    if "fsdp_min_num_params" in section:
        out["min_num_params"] = section["fsdp_min_num_params"]
    prefetch = section.get("fsdp_backward_prefetch", section.get("fsdp_backward_prefetch_policy"))
    if prefetch is not None:
        if version == 1:
            out["backward_prefetch"] = _pick(PREFETCH, prefetch, "fsdp_backward_prefetch")
        else:
            _no_effect("fsdp_backward_prefetch")
    if section.get("fsdp_activation_checkpointing_offload") or section.get("fsdp_ignored_modules"):
        key = "fsdp_activation_checkpointing_offload" if section.get("fsdp_activation_checkpointing_offload") else "fsdp_ignored_modules"
        raise UserError(f"{key} is not supported by acc-train's FSDP strategy yet", where=f"fsdp_config.{key}", hint="remove it from the file")
    for src, dst in (
        ("fsdp_offload_params", "cpu_offload"),
        ("fsdp_activation_checkpointing", "activation_checkpointing"),
        ("fsdp_cpu_ram_efficient_loading", "cpu_ram_efficient_loading"),
    ):
        if src in section:
            out[dst] = bool(section[src])
    for src, dst in (
        ("fsdp_forward_prefetch", "forward_prefetch"),
        ("fsdp_sync_module_states", "sync_module_states"),
        ("fsdp_use_orig_params", "use_orig_params"),
    ):
        if src in section:
            if version == 1:
                out[dst] = bool(section[src])
            else:
                _no_effect(src)
    if "fsdp_state_dict_type" in section:
        out["state_dict_type"] = _pick(STATE_DICT, section["fsdp_state_dict_type"], "fsdp_state_dict_type")
    return {**out, **mesh_from_parallelism_config(parallelism, version)}
