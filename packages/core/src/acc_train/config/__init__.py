"""The job config: one schema, resolved from defaults < YAML file < flags < ``--set``.

Validation is strict at every level: unknown keys are errors that suggest the closest valid
name, and every problem names its key path and where the value came from (file and line,
flag, or ``--set``).

- :mod:`~acc_train.config.schema`: the sections and their fields;
- :mod:`~acc_train.config.sources`: YAML with file:line, ``--set``, merging;
- :mod:`~acc_train.config.problems`: validation errors as messages;
- :mod:`~acc_train.config.strategy`: a strategy name and options -> a configured strategy;
- :mod:`~acc_train.config.accelerate_file`: files written by ``accelerate config``;
- :mod:`~acc_train.config.resolve`: the whole job, and ``config validate``'s problem list;
- :mod:`~acc_train.config.json_schema`: a JSON Schema for editors.
"""

from __future__ import annotations

from acc_train.config.accelerate_file import check_accelerate_section, from_accelerate_config, is_accelerate_config
from acc_train.config.problems import format_validation_error, problem_lines
from acc_train.config.resolve import (
    ENV_CONFIG_FILE,
    ResolvedJob,
    check_config_file,
    config_problems,
    default_config_file,
    existing_default_config_file,
    load_job,
    load_resolved,
    read_config_file,
)
from acc_train.config.schema import (
    DEFAULT_MAX_STEPS,
    CheckpointConfig,
    DataConfig,
    JobConfig,
    LaunchConfig,
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainingConfig,
)
from acc_train.config.sources import Loader, Sources, deep_merge, parse_set, read_yaml_file, set_dotted
from acc_train.config.strategy import resolve_strategy, strategy_problems

__all__ = [
    "DEFAULT_MAX_STEPS", "ENV_CONFIG_FILE", "CheckpointConfig", "DataConfig", "JobConfig", "LaunchConfig", "Loader",
    "ModelConfig", "OptimizerConfig", "ResolvedJob", "SchedulerConfig", "Sources", "TrainingConfig",
    "check_accelerate_section", "check_config_file", "config_problems", "deep_merge", "default_config_file", "existing_default_config_file",
    "format_validation_error", "from_accelerate_config", "is_accelerate_config", "load_job", "load_resolved",
    "parse_set", "problem_lines", "read_config_file", "read_yaml_file", "resolve_strategy", "set_dotted",
    "strategy_problems",
]  # fmt: skip
