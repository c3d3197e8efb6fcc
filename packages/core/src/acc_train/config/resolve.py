"""Resolution: defaults < config file < flags < ``--set`` -> a validated job with a configured
strategy (:class:`ResolvedJob`), and every problem of a config at once for ``config validate``."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from acc_train.config.accelerate_file import from_accelerate_config, is_accelerate_config
from acc_train.config.compile import check_compile
from acc_train.config.problems import format_validation_error, problem_lines
from acc_train.config.schema import JobConfig
from acc_train.config.sources import Sources, deep_merge, parse_set, read_yaml_file, set_dotted
from acc_train.config.strategy import resolve_strategy, split_strategy_section, strategy_problems
from acc_train.errors import UserError
from acc_train.strategy import DEFAULT_STRATEGY, Strategy

__all__ = [
    "ENV_CONFIG_FILE", "ResolvedJob", "load_job", "load_resolved", "config_problems", "check_config_file",
    "default_config_file", "existing_default_config_file", "read_config_file",
]  # fmt: skip

#: Where ``acc-train config`` saves, and ``acc-train`` reads when no ``--config`` is given.
ENV_CONFIG_FILE = "ACC_TRAIN_CONFIG_FILE"


@dataclass
class ResolvedJob:
    """A validated job: the config plus its strategy, configured with its validated options."""

    config: JobConfig
    strategy: Strategy[Any]
    sources: Sources
    #: The default config file (``acc-train config``) read because no ``--config`` was given.
    default_file: Path | None = None

    @property
    def strategy_name(self) -> str:
        """The name the job selected the strategy by (its name, an alias or a preset)."""
        return str(self.config.strategy["name"])

    def to_dict(self) -> dict[str, Any]:
        data = self.config.model_dump(mode="json")
        data["strategy"] = {"name": self.strategy_name, **self.strategy.options.model_dump(mode="json")}
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def default_config_file() -> Path:
    """Where ``acc-train config`` saves: ``$ACC_TRAIN_CONFIG_FILE``, else
    ``$XDG_CONFIG_HOME/acc-train/default_config.yaml`` (``~/.config`` without it)."""
    explicit = os.environ.get(ENV_CONFIG_FILE, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME", "").strip()
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path("~/.config").expanduser()  # XDG: relative is invalid
    return base / "acc-train" / "default_config.yaml"


def existing_default_config_file() -> Path | None:
    """The default config file when there is one; something else in its place (a directory) is
    refused, where it used to be skipped without a word."""
    path = default_config_file()
    if path.is_file() or not path.exists():
        return path if path.is_file() else None
    named = f"${ENV_CONFIG_FILE}" if os.environ.get(ENV_CONFIG_FILE, "").strip() else "the default config file"
    kind = "a directory" if path.is_dir() else "not a regular file"
    raise UserError(
        f"{named} names {str(path)!r}, which is {kind}",
        where=ENV_CONFIG_FILE if named.startswith("$") else str(path),
        hint=f"point {ENV_CONFIG_FILE} at a YAML file (it need not exist yet), or remove what is at that path",
    )


def _file_where(config_file: str | Path) -> str:
    """The flag or variable that named ``config_file``, for its errors."""
    return ENV_CONFIG_FILE if os.environ.get(ENV_CONFIG_FILE, "").strip() and Path(config_file) == default_config_file() else "--config"


def read_config_file(config_file: str | Path, sources: Sources, where: str | None = None) -> dict[str, Any]:
    """A config file (acc-train's own, or one written by ``accelerate config``) as raw sections,
    recording where each key came from; ``where`` names the flag that gave it (default
    ``--config``, or ``$ACC_TRAIN_CONFIG_FILE`` for the default file)."""
    data, lines = read_yaml_file(config_file, where=where or _file_where(config_file))
    if is_accelerate_config(data):
        data = from_accelerate_config(data, str(config_file), lines)
        lines = {**{section: f"{config_file}, accelerate config" for section in data}, **lines}
    sources.origins.update(lines)
    _normalise_strategy(data)
    return data


def _normalise_strategy(raw: dict[str, Any]) -> None:
    if "strategy" in raw and isinstance(raw["strategy"], str):  # `strategy: ddp` shorthand
        raw["strategy"] = {"name": raw["strategy"]}
    if isinstance(raw.get("strategy"), dict):
        raw["strategy"] = {"name": DEFAULT_STRATEGY, **raw["strategy"]}


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
    if config_file is None and use_default_file:
        config_file = default_file = existing_default_config_file()
    if config_file is not None:
        raw = deep_merge(raw, read_config_file(config_file, sources))
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
    name, options = split_strategy_section(config.strategy, sources)
    strategy = resolve_strategy(name, options, sources)
    check_compile(config.training.compile, strategy, sources.where("training.compile"))
    return ResolvedJob(config, strategy, sources, default_file)


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
    section = raw.get("strategy", {"name": DEFAULT_STRATEGY})
    if isinstance(section, dict):  # else JobConfig reported it
        problems += strategy_problems(section, sources)
    if not problems:  # what needs the config and its strategy together
        config = JobConfig.model_validate(raw)
        try:
            check_compile(config.training.compile, resolve_strategy(*split_strategy_section(config.strategy, sources), sources), sources.where("training.compile"))
        except UserError as exc:
            problems.append(str(exc))
    return problems


def check_config_file(path: str | Path, where: str | None = None) -> tuple[ResolvedJob | None, list[str]]:
    """A config file checked on its own (defaults < file): the resolved job, or every problem."""
    sources = Sources()
    try:
        data = read_config_file(path, sources, where or str(path))
    except UserError as exc:
        return None, [str(exc)]
    problems = config_problems(data, sources)
    if problems:
        return None, problems
    return load_job(path), []


def load_resolved(path: str | Path) -> ResolvedJob:
    """Load a config written by :meth:`ResolvedJob.to_yaml` (what workers read)."""
    return load_job(path)
