"""The job config: one schema, resolved from defaults < YAML file < flags < ``--set``.

Validation is strict at every level: unknown keys are errors that suggest the closest valid
name, and every problem names its key path and where the value came from (file and line,
flag, or ``--set``).
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from acc_train.errors import UserError, closest

__all__ = [
    "JobConfig",
    "ResolvedJob",
    "Sources",
    "load_job",
    "parse_set",
    "format_validation_error",
    "config_problems",
    "check_config_file",
    "default_config_file",
    "ENV_CONFIG_FILE",
    "DEFAULT_MAX_STEPS",
]

DEFAULT_MAX_STEPS = 300

#: Where ``acc-train config`` saves, and ``acc-train`` reads when no ``--config`` is given.
ENV_CONFIG_FILE = "ACC_TRAIN_CONFIG_FILE"

#: Accelerate trackers and the modules that must import for each.
TRACKER_MODULES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "comet_ml": ("comet_ml",),
    "aim": ("aim",),
    "clearml": ("clearml",),
    "dvclive": ("dvclive",),
    "swanlab": ("swanlab",),
    "trackio": ("trackio",),
}

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


class ModelConfig(Section):
    #: A local directory or hub id for ``from_pretrained``; None trains the built-in demo model.
    name_or_path: str | None = None
    #: Tokenizer path or id; defaults to ``name_or_path``. The demo job is byte-level.
    tokenizer: str | None = None
    #: Overrides for the demo model's ``LlamaConfig`` (ignored when ``name_or_path`` is set).
    config: dict[str, Any] = Field(default_factory=dict)
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _config_only_for_demo(self) -> ModelConfig:
        if self.name_or_path and self.config:
            raise ValueError("model.config overrides the demo model only; remove it when model.name_or_path is set")
        return self


class DataConfig(Section):
    #: Data files for ``datasets`` (json, jsonl, text, parquet); empty trains on the demo text.
    train_files: list[str] = Field(default_factory=list)
    eval_files: list[str] = Field(default_factory=list)
    format: Literal["auto", "json", "jsonl", "text", "parquet"] = "auto"
    text_field: str = "text"
    seq_len: int = Field(128, ge=2)
    #: Share of the training blocks held out for eval when no ``eval_files`` are given.
    eval_fraction: float = Field(0.02, ge=0.0, lt=1.0)
    #: How much of the standard library's source the demo job reads.
    demo_max_bytes: int = Field(1_500_000, ge=1024)
    shuffle: bool = True


class OptimizerConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.95], min_length=2, max_length=2)
    eps: float = Field(1e-8, gt=0)


class SchedulerConfig(Section):
    #: A transformers scheduler name (``get_scheduler``).
    name: Literal[SCHEDULERS] = "cosine"  # type: ignore[valid-type]
    warmup_steps: int | None = Field(None, ge=0)
    #: Used when ``warmup_steps`` is not set.
    warmup_ratio: float = Field(0.1, ge=0, le=1)


class TrainingConfig(Section):
    #: Optimizer steps. Default 300 when neither this nor ``epochs`` is set.
    max_steps: int | None = Field(None, ge=1)
    epochs: int | None = Field(None, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    #: Clip the global gradient norm to this; null turns clipping off.
    max_grad_norm: float | None = Field(1.0, gt=0)
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    seed: int = 42
    log_every: int = Field(1, ge=1)
    #: Evaluate every N steps (and after the last); 0 evaluates only after the last step.
    eval_every: int = Field(0, ge=0)
    eval_batches: int = Field(8, ge=1)
    #: Accelerate trackers: tensorboard, wandb, ... (``all`` for every installed one).
    report_to: list[str] = Field(default_factory=list)
    progress_bar: bool = True

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML 1.1 reads a bare `no` as false

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, value: list[str]) -> list[str]:
        import importlib.util

        for name in value:
            module = TRACKER_MODULES.get(name)
            if name != "all" and module is None:
                raise ValueError(f"unknown tracker {name!r}; known: {', '.join(sorted(TRACKER_MODULES))}, all")
            if module and not any(importlib.util.find_spec(m) for m in module):
                raise ValueError(f"tracker {name!r} is not installed (pip install {module[0]})")
        return value

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingConfig:
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("set training.max_steps or training.epochs, not both")
        return self


class CheckpointConfig(Section):
    #: Save every N steps (and after the last); 0 saves only after the last step.
    every: int = Field(100, ge=0)
    #: Keep the N most recent complete checkpoints; null keeps all.
    keep_last: int | None = Field(2, ge=1)
    #: Write the state in a background thread (torch.distributed.checkpoint's async_save): the
    #: loop blocks only while it is copied aside. The checkpoint is committed (manifest,
    #: ``latest``) once written, at the next save or the end of training. ``dcp`` format only.
    async_save: bool = False


class LaunchConfig(Section):
    #: Processes per machine. Null: one per GPU, or 1 on a machine without GPUs.
    num_processes: int | None = Field(None, ge=1)
    num_machines: int = Field(1, ge=1)
    machine_rank: int = Field(0, ge=0)
    #: Address of machine 0; required with several machines.
    main_process_ip: str | None = None
    main_process_port: int = Field(29500, ge=1, le=65535)
    #: ``static`` (fixed machine ranks) or ``c10d`` (elastic rendezvous).
    rdzv_backend: Literal["static", "c10d"] = "static"
    max_restarts: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _rank_in_range(self) -> LaunchConfig:
        if self.num_machines > 1 and not self.main_process_ip:
            raise ValueError("with several machines, launch.main_process_ip (--main-process-ip) must name machine 0")
        if self.machine_rank >= self.num_machines:
            raise ValueError(
                f"launch.machine_rank ({self.machine_rank}) must be below launch.num_machines ({self.num_machines})"
            )
        return self


class JobConfig(Section):
    output_dir: str = "runs/demo"
    #: ``latest`` (or ``auto``: latest if any, else start fresh) or a checkpoint path.
    resume: str | None = None
    overwrite: bool = False
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    #: ``name`` plus the options whose schema the strategy owns.
    strategy: dict[str, Any] = Field(default_factory=lambda: {"name": "ddp"})

    @property
    def max_steps(self) -> int | None:
        if self.training.max_steps is None and self.training.epochs is None:
            return DEFAULT_MAX_STEPS
        return self.training.max_steps


class Loader(yaml.SafeLoader):
    """YAML as people write it: ``1e-4`` is a float (PyYAML's YAML 1.1 rules read it as text)."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


# ----------------------------------------------------------------------------------------
# Sources and error locations
# ----------------------------------------------------------------------------------------


@dataclass
class Sources:
    """Where each dotted key's value came from, for error messages."""

    origins: dict[str, str] = field(default_factory=dict)

    def where(self, dotted: str) -> str | None:
        key = dotted
        while key:
            if key in self.origins:
                return self.origins[key]
            key = key.rpartition(".")[0]
        return None


def _yaml_lines(text: str, file: str) -> dict[str, str]:
    """dotted key -> "file:line" for every mapping key in a YAML document."""
    out: dict[str, str] = {}
    try:
        node = yaml.compose(text, Loader=Loader)
    except yaml.YAMLError:
        return out

    def walk(n: yaml.Node, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                dotted = f"{prefix}{k.value}"
                out[dotted] = f"{file}:{k.start_mark.line + 1}"
                walk(v, dotted + ".")

    if node is not None:
        walk(node, "")
    return out


def read_yaml_file(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"config file {str(p)!r} does not exist" if not p.exists() else f"config file {str(p)!r} is not a file",
            where="--config",
            hint="check the path, or run `acc-train --print-config > job.yaml` to start one",
        )
    text = p.read_text(encoding="utf-8")
    try:
        data = yaml.load(text, Loader=Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        loc = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        problem = getattr(exc, "problem", None) or str(exc)
        raise UserError(f"not valid YAML: {problem}", where=loc, hint="fix the YAML syntax at that line") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"the file must hold a mapping of config keys, not a {type(data).__name__}", where=str(p))
    return data, _yaml_lines(text, str(p))


def parse_set(item: str) -> tuple[str, Any]:
    """``key.path=value`` -> (``key.path``, YAML-parsed value)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set expects key.path=value, got {item!r}", where="--set", hint="e.g. --set training.max_steps=50")
    try:
        value = yaml.load(raw, Loader=Loader) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(tree: dict[str, Any], dotted: str, value: Any, where: str) -> None:
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"{'.'.join(parts[: i + 1])} is not a section, so {dotted} cannot be set", where=where)
        node = child
    node[parts[-1]] = value


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _model_fields_at(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    """Valid keys of the section at ``path`` (for "did you mean")."""
    current: Any = model
    for part in path:
        fld = getattr(current, "model_fields", {}).get(part)
        if fld is None:
            return []
        current = fld.annotation
    return list(getattr(current, "model_fields", {}))


def format_validation_error(
    exc: ValidationError, schema: type[BaseModel], sources: Sources, prefix: str = ""
) -> UserError:
    """One message listing every problem with its key path and origin."""
    lines = problem_lines(exc, schema, sources, prefix)
    head = "invalid config" if len(lines) > 1 else "invalid config: " + lines[0]
    body = "\n  " + "\n  ".join(lines) if len(lines) > 1 else ""
    return UserError(head + body, hint="fix the value(s) above; `acc-train --print-config` shows the resolved config")


def problem_lines(exc: ValidationError, schema: type[BaseModel], sources: Sources, prefix: str = "") -> list[str]:
    """``key.path (file:line): what is wrong``, one per problem pydantic found."""
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        dotted = prefix + ".".join(str(p) for p in loc) if loc else prefix.rstrip(".") or "config"
        origin = sources.where(dotted)
        at = f" ({origin})" if origin else ""
        if err["type"] == "extra_forbidden":
            near = closest(str(loc[-1]), _model_fields_at(schema, loc[:-1]))
            suggestion = f'; did you mean "{prefix}{".".join(str(p) for p in loc[:-1] + (near,))}"?' if near else ""
            valid = ", ".join(_model_fields_at(schema, loc[:-1]))
            lines.append(f"{dotted}{at}: unknown key{suggestion} (valid keys here: {valid})")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            got = ""
            if err["type"] not in {"missing"} and "input" in err and not isinstance(err["input"], dict):
                got = f" (got {err['input']!r})"
            lines.append(f"{dotted}{at}: {msg}{got}")
    return lines


# ----------------------------------------------------------------------------------------
# Resolution
# ----------------------------------------------------------------------------------------


@dataclass
class ResolvedJob:
    """A validated job: the config plus its strategy object and parsed options."""

    config: JobConfig
    strategy: Any  # acc_train.strategy.Strategy
    options: Any  # its StrategyOptions
    sources: Sources
    #: The default config file (``acc-train config``) read because no ``--config`` was given.
    default_file: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        data = self.config.model_dump(mode="json")
        data["strategy"] = {"name": self.config.strategy["name"], **self.options.model_dump(mode="json")}
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def resolve_strategy(config: JobConfig, sources: Sources) -> tuple[Any, Any]:
    from acc_train.plugins import strategies

    section = dict(config.strategy)
    name = section.pop("name", None)
    if not isinstance(name, str) or not name:
        raise UserError("strategy.name must be set to a strategy name", where=sources.where("strategy.name") or "strategy.name")
    registry = strategies()
    strategy = registry.get(name)
    raw = deep_merge(strategy.presets.get(name, {}), section)
    try:
        options = strategy.parse_options(raw)
    except ValidationError as exc:
        raise format_validation_error(exc, strategy.options_schema, sources, prefix="strategy.") from None
    return strategy, options


def default_config_file() -> Path:
    """Where ``acc-train config`` saves: ``$ACC_TRAIN_CONFIG_FILE``, else
    ``$XDG_CONFIG_HOME/acc-train/default_config.yaml`` (``~/.config`` without it)."""
    explicit = os.environ.get(ENV_CONFIG_FILE, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME", "").strip()
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path("~/.config").expanduser()  # XDG: relative is invalid
    return base / "acc-train" / "default_config.yaml"


def _read_config_file(config_file: str | Path, sources: Sources) -> dict[str, Any]:
    data, lines = read_yaml_file(config_file)
    if is_accelerate_config(data):
        data = from_accelerate_config(data, str(config_file))
    if isinstance(data.get("strategy"), str):  # `strategy: ddp` shorthand
        data["strategy"] = {"name": data["strategy"]}
    sources.origins.update(lines)
    return data


def _normalise_strategy(raw: dict[str, Any]) -> None:
    if "strategy" in raw and isinstance(raw["strategy"], str):
        raw["strategy"] = {"name": raw["strategy"]}
    if isinstance(raw.get("strategy"), dict):
        raw["strategy"] = {"name": "ddp", **raw["strategy"]}


def load_job(
    config_file: str | Path | None = None,
    flags: dict[str, Any] | None = None,
    sets: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
    use_default_file: bool = False,
) -> ResolvedJob:
    """Resolve and validate a job: defaults < ``base`` < file < flags < ``--set``.

    ``flags`` maps dotted keys to values and flag names: ``{"training.max_steps": (20, "--max-steps")}``.
    With ``use_default_file`` (the command line), the file ``acc-train config`` saved stands in
    for ``config_file`` when none is given and it exists; library callers stay hermetic.
    """
    sources = Sources()
    raw: dict[str, Any] = copy.deepcopy(base or {})
    default_file = None
    if config_file is None and use_default_file and default_config_file().is_file():
        config_file = default_file = default_config_file()
    if config_file is not None:
        raw = deep_merge(raw, _read_config_file(config_file, sources))
    for dotted, (value, flag) in (flags or {}).items():
        set_dotted(raw, dotted, value, flag)
        sources.origins[dotted] = flag
    for item in sets:
        dotted, value = parse_set(item)
        set_dotted(raw, dotted, value, f"--set {item}")
        sources.origins[dotted] = f"--set {item}"
    _normalise_strategy(raw)
    try:
        config = JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise format_validation_error(exc, JobConfig, sources) from None
    strategy, options = resolve_strategy(config, sources)
    return ResolvedJob(config, strategy, options, sources, default_file)


def config_problems(data: dict[str, Any], sources: Sources | None = None) -> list[str]:
    """Every problem of a config (defaults < ``data``), one line each with its key path and
    origin: the strategy's options are checked even when another section is wrong."""
    sources = sources or Sources()
    raw = copy.deepcopy(data)
    _normalise_strategy(raw)
    problems: list[str] = []
    try:
        JobConfig.model_validate(raw)
    except ValidationError as exc:
        problems += problem_lines(exc, JobConfig, sources)
    section = raw.get("strategy", {"name": "ddp"})
    if isinstance(section, dict):  # else JobConfig reported it
        problems += _strategy_problems(section, sources)
    return problems


def _strategy_problems(section: dict[str, Any], sources: Sources) -> list[str]:
    from acc_train.plugins import strategies

    options = dict(section)
    name = options.pop("name", None)
    origin = sources.where("strategy.name")
    at = f" ({origin})" if origin else ""
    if not isinstance(name, str) or not name:
        return [f"strategy.name{at}: must be set to a strategy name"]
    try:
        strategy = strategies().get(name)
    except UserError as exc:
        return [f"strategy.name{at}: {exc.message}" + (f" ({exc.hint})" if exc.hint else "")]
    try:
        strategy.parse_options(deep_merge(strategy.presets.get(name, {}), options))
    except ValidationError as exc:
        return problem_lines(exc, strategy.options_schema, sources, prefix="strategy.")
    return []


def check_config_file(path: str | Path) -> tuple[ResolvedJob | None, list[str]]:
    """A config file checked on its own (defaults < file): the resolved job, or every problem."""
    sources = Sources()
    try:
        data = _read_config_file(path, sources)
    except UserError as exc:
        return None, [str(exc)]
    problems = config_problems(data, sources)
    if problems:
        return None, problems
    return load_job(path), []


def load_resolved(path: str | Path) -> ResolvedJob:
    """Load a config written by :meth:`ResolvedJob.to_yaml` (what workers read)."""
    return load_job(path)


# ----------------------------------------------------------------------------------------
# Config files written by `accelerate config`
# ----------------------------------------------------------------------------------------

#: top-level keys of an accelerate config file that carry nothing acc-train needs to act on
ACCELERATE_PASSIVE_KEYS = {
    "compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity", "gpu_ids",
    "main_training_function", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
    "use_cpu", "dynamo_config", "fsdp_config", "deepspeed_config", "megatron_lm_config",
}  # fmt: skip
ACCELERATE_MAPPED_KEYS = {
    "distributed_type", "mixed_precision", "num_processes", "num_machines", "machine_rank",
    "main_process_ip", "main_process_port", "rdzv_backend",
}  # fmt: skip
DATA_PARALLEL_TYPES = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU"}


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
    from acc_train.plugins import accelerate_config_section

    for key in data:
        if key not in ACCELERATE_PASSIVE_KEYS | ACCELERATE_MAPPED_KEYS:
            near = closest(key, ACCELERATE_PASSIVE_KEYS | ACCELERATE_MAPPED_KEYS)
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
    kind = str(data.get("distributed_type", "NO"))
    if kind in DATA_PARALLEL_TYPES:
        out["strategy"] = {"name": "ddp"}
        return out
    section = accelerate_config_section(kind, data)
    if section is None:
        from acc_train.plugins import KNOWN_STRATEGY_PACKAGES, strategies

        name = {"FSDP": "fsdp", "DEEPSPEED": "deepspeed"}.get(kind)
        if name is None:
            raise UserError(f"distributed_type {kind} is not supported", where=file)
        if name not in strategies().names():
            raise strategies().not_found(name)
        raise UserError(f"no installed plugin maps distributed_type {kind}", where=file, hint=f"update {KNOWN_STRATEGY_PACKAGES.get(name)}")
    return deep_merge(out, section)
