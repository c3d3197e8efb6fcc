"""Config files written by ``accelerate config``, read as acc-train configs.

Core maps the top level (processes, machines, precision) and ``dynamo_config``
(``training.compile``, :mod:`acc_train.config.compile`). Which strategy a
``distributed_type`` selects is declared by the strategies themselves
(``Strategy.accelerate_distributed_types``), and the plugin answering the
``acc_train_accelerate_config`` hook maps its own section of the file.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from acc_train.config.compile import DynamoSection, compile_from_dynamo, dynamo_keys
from acc_train.config.problems import short_repr
from acc_train.config.sources import deep_merge
from acc_train.errors import PluginError, UserError, closest
from acc_train.plugins import KNOWN_STRATEGY_PACKAGES, accelerate_config_section, strategies

__all__ = ["is_accelerate_config", "from_accelerate_config", "check_accelerate_section", "read_accelerate_section"]

SectionModel = TypeVar("SectionModel", bound=BaseModel)

#: top-level keys of an accelerate config file that carry nothing acc-train needs to act on
ACCELERATE_PASSIVE_KEYS = {
    "compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity", "gpu_ids",
    "main_training_function", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
    "use_cpu", "megatron_lm_config",
}  # fmt: skip
ACCELERATE_MAPPED_KEYS = {
    "distributed_type", "mixed_precision", "num_processes", "num_machines", "machine_rank",
    "main_process_ip", "main_process_port", "rdzv_backend", "dynamo_config", "dynamo_backend",
}  # fmt: skip


class AccelerateTopLevel(BaseModel):
    """The top-level keys acc-train maps, as ``accelerate config`` writes them (null: not set)."""

    model_config = ConfigDict(extra="ignore", strict=True)  # unknown keys are refused by name before
    distributed_type: str = "NO"
    compute_environment: Literal["LOCAL_MACHINE"] = "LOCAL_MACHINE"
    #: over all machines, as accelerate counts them
    num_processes: Annotated[StrictInt, Field(ge=1)] | None = None
    num_machines: Annotated[StrictInt, Field(ge=1)] | None = None
    machine_rank: Annotated[StrictInt, Field(ge=0)] | None = None
    main_process_ip: str | None = None
    main_process_port: Annotated[StrictInt, Field(ge=1, le=65535)] | None = None
    rdzv_backend: Literal["static", "c10d"] | None = None
    mixed_precision: Literal["no", "fp16", "bf16"] | None = None

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML 1.1 reads a bare `no` as false


def _section_error(exc: ValidationError, model: type[BaseModel], name: str) -> UserError:
    """pydantic's first complaint about an accelerate config section, naming ``name.key``."""
    err = exc.errors()[0]
    loc = str(err["loc"][0]) if err["loc"] else ""  # the key; deeper parts name union members (`str`)
    where = f"{name}.{loc}" if name else loc
    if err["type"] == "extra_forbidden":
        known = list(model.model_fields)
        near = closest(str(err["loc"][-1]), known)
        return UserError(
            f"unknown or unsupported key {err['loc'][-1]!r}" + (f'; did you mean "{near}"?' if near else ""),
            where=where,
            hint=f"acc-train maps these {name or 'top-level'} keys: " + ", ".join(sorted(known)),
        )
    return UserError(f"{err['msg']} (got {short_repr(err.get('input'))})", where=where)


def read_accelerate_section(section: Any, model: type[SectionModel], name: str) -> SectionModel:
    """An ``accelerate config`` section (``fsdp_config``...) validated by a plugin's pydantic
    ``model`` (``extra="forbid"`` refuses keys it does not map): a value of the wrong type, out
    of range or unknown is a :class:`UserError` naming ``name.key``."""
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise UserError(f"must be a mapping of keys, not {type(section).__name__} {short_repr(section)}", where=name)
    try:
        return model.model_validate(section)
    except ValidationError as exc:
        raise _section_error(exc, model, name) from None


def check_accelerate_section(section: dict[str, Any], known: Any, name: str) -> None:
    """Refuse keys of an ``accelerate config`` section (``fsdp_config``...) that a plugin does
    not map, suggesting the closest one it does (:func:`read_accelerate_section` checks values too)."""
    if not isinstance(section, dict):
        raise UserError(f"must be a mapping of keys, not {type(section).__name__} {short_repr(section)}", where=name)
    for key in section:
        if key not in known:
            near = closest(str(key), known)
            raise UserError(
                f"unknown or unsupported key {key!r}" + (f'; did you mean "{near}"?' if near else ""),
                where=f"{name}.{key}",
                hint=f"acc-train maps these {name} keys: " + ", ".join(sorted(known)),
            )


def is_accelerate_config(data: dict[str, Any]) -> bool:
    return "distributed_type" in data or "compute_environment" in data


def _at(lines: dict[str, str], key: str, file: str) -> str:
    """``file:line: key`` for an error about ``key`` of the file."""
    return f"{lines.get(key, file)}: {key}"


def from_accelerate_config(data: dict[str, Any], file: str, lines: dict[str, str] | None = None) -> dict[str, Any]:
    """An ``accelerate config`` YAML as an acc-train config. Core maps the top level; the
    strategy plugin that answers ``acc_train_accelerate_config`` maps its own section. Every
    problem names the file, the line (given ``lines``, dotted key -> file:line) and the key."""
    lines = lines or {}
    try:
        top = AccelerateTopLevel.model_validate(data)
    except ValidationError as exc:
        error = _section_error(exc, AccelerateTopLevel, "")
        raise UserError(error.message, where=_at(lines, str(error.where), file), hint=error.hint) from None
    installed = [strategy for strategy, _owner in strategies().primary()]
    kind = top.distributed_type
    declared = [strategy for strategy in installed if kind in strategy.accelerate_distributed_types]
    if not declared and kind.lower() in KNOWN_STRATEGY_PACKAGES:  # one of acc-train's own, not installed here
        raise strategies().not_found(kind.lower())
    sections = {key for strategy in installed for key in strategy.accelerate_config_sections}
    known = ACCELERATE_PASSIVE_KEYS | ACCELERATE_MAPPED_KEYS | sections
    for key in data:
        if str(key).endswith("_config") and key not in known and not data[key]:
            continue  # an empty section of a strategy that is not installed
        if key not in known:
            near = closest(str(key), known)
            raise UserError(
                f"unknown accelerate config key {key!r}" + (f'; did you mean "{near}"?' if near else ""),
                where=_at(lines, str(key), file),
                hint="this file was read as an `accelerate config` file because it has distributed_type",
            )
        if key in sections and data[key] is not None and not isinstance(data[key], dict):
            raise UserError(f"must be a mapping of keys, not {type(data[key]).__name__} {short_repr(data[key])}", where=_at(lines, key, file))
    out: dict[str, Any] = {"launch": {}}
    machines = top.num_machines or 1
    if top.num_processes is not None:  # accelerate counts processes over all machines
        if top.num_processes % machines:
            raise UserError(f"{top.num_processes} processes do not divide over num_machines {machines}", where=_at(lines, "num_processes", file))
        out["launch"]["num_processes"] = top.num_processes // machines
    out["launch"]["num_machines"] = machines
    for key in ("machine_rank", "main_process_ip", "main_process_port", "rdzv_backend"):
        if getattr(top, key) not in (None, ""):
            out["launch"][key] = getattr(top, key)
    if top.mixed_precision is not None or "mixed_precision" in data:
        out["training"] = {"mixed_precision": top.mixed_precision or "no"}
    try:  # dynamo_config: training.compile
        compiled = compile_from_dynamo(read_accelerate_section(dynamo_keys(data), DynamoSection, "dynamo_config"))
    except UserError as exc:
        raise UserError(exc.message, where=_at(lines, str(exc.where), file), hint=exc.hint) from None
    if compiled is not None:
        out.setdefault("training", {})["compile"] = compiled
    try:
        section = accelerate_config_section(kind, data)
    except PluginError:
        raise
    except UserError as exc:  # a plugin's mapper names the key within its section: add the file and line
        raise UserError(exc.message, where=_at(lines, str(exc.where), file) if exc.where else file, hint=exc.hint) from None
    if section is not None:
        _refuse_unread_sections(data, sections, section["strategy"]["name"], installed, lines, file)
        return deep_merge(out, section)
    if not declared:
        answers = sorted({t for strategy in installed for t in strategy.accelerate_distributed_types})
        raise UserError(
            f"distributed_type {kind} is not supported by the installed strategies",
            where=_at(lines, "distributed_type", file),
            hint="they answer to: " + (", ".join(answers) or "none"),
        )
    _refuse_unread_sections(data, sections, declared[0].name, installed, lines, file)
    out["strategy"] = {"name": declared[0].name}
    return out


def _refuse_unread_sections(data: dict[str, Any], sections: set[str], chosen: str, installed: list[Any], lines: dict[str, str], file: str) -> None:
    """A filled-in section that the chosen strategy does not read (``parallelism_config`` under
    ``distributed_type: MULTI_GPU``...) is an error naming it, not dropped."""
    mine = {key for strategy in installed if strategy.name == chosen for key in strategy.accelerate_config_sections}
    for key in sorted(sections - mine):
        if data.get(key):
            readers = sorted({s.name for s in installed if key in s.accelerate_config_sections})
            raise UserError(
                f"{key} is filled in, and the {chosen} strategy (distributed_type {data.get('distributed_type')}) does not read it",
                where=_at(lines, key, file),
                hint=f"it is read by the {', '.join(readers)} strategy; set the distributed_type that selects it, or empty {key}",
            )
