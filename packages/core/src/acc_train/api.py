"""The public API for plugin authors: everything a strategy package imports from acc-train.

A strategy, wrap policy or checkpoint format plugin imports from this module (or the same
names from ``acc_train``) and from nothing else in acc-train; an import-linter contract holds
acc-train's own strategy packages to it. Importing it does not import torch or accelerate;
``Accelerator`` loads them when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from acc_train.accelerate_compat import already_running, run_sharded_on_cpu
from acc_train.checkpoint import (
    CheckpointFormat,
    DCPFormat,
    flatten_optimizer_state,
    load_portable_into,
    read_portable_state,
    read_strategy_state,
    state_dict_options,
    unflatten_optimizer_state,
    write_portable_state,
)
from acc_train.config.accelerate_file import check_accelerate_section, read_accelerate_section
from acc_train.config.strategy import resolve_strategy
from acc_train.contracts.data_kind import DataKind, Tokenized
from acc_train.errors import PluginError, UserError, closest
from acc_train.contracts.evaluator import EvalContext, EvaluatorKind
from acc_train.hookspecs import hookimpl
from acc_train.machine import current_machine, resolve_mixed_precision, warn_once_per_machine
from acc_train.memory.plan import MemoryPlan, PlanInput, replicated
from acc_train.model.build import enable_gradient_checkpointing
from acc_train.model.optimizer import OptimizerKind, OptimizerOptions
from acc_train.memory.state import ModelStateMeter, TorchOptimizerMeter, dtype_name, local_nbytes
from acc_train.plugins import checkpoint_formats, evaluators, optimizers, strategies, wrap_policies
from acc_train.contracts.questions import Question
from acc_train.run import RunContext
from acc_train.strategy import DEFAULT_STRATEGY, Machine, Strategy, StrategyOptions, WrapPolicy
from acc_train.contracts.launch import LaunchProtocol
from acc_train.contracts.replica_groups import ReplicaGroups
from acc_train.memory.planner import StrategyPlanner
from acc_train.outputs.tracker_kinds import TrackerKind
from acc_train.files.user_files import read_user_json

if TYPE_CHECKING:
    from acc_train.accelerator import Accelerator

__all__ = [
    # the strategy contract
    "DEFAULT_STRATEGY", "Machine", "Strategy", "StrategyOptions", "WrapPolicy", "resolve_strategy",
    # what a strategy hands out: its planner (plan, simulation, the kit) and its launch protocol (acc-train launch)
    "StrategyPlanner", "LaunchProtocol", "ReplicaGroups",
    # hooks (the run they are handed), questions for the wizard, errors
    "RunContext", "DataKind", "Tokenized", "packs_rows", "packs_continuous_text", "OptimizerKind", "OptimizerOptions", "TrackerKind", "EvaluatorKind", "EvalContext", "hookimpl", "Question", "PluginError", "UserError", "closest", "read_user_json",
    # registries
    "checkpoint_formats", "evaluators", "optimizers", "strategies", "wrap_policies",
    # checkpoint formats and the portable state
    "CheckpointFormat", "DCPFormat", "flatten_optimizer_state", "load_portable_into", "read_portable_state",
    "read_strategy_state", "state_dict_options", "unflatten_optimizer_state", "write_portable_state",
    # accounting for run.json and acc-train plan
    "MemoryPlan", "ModelStateMeter", "PlanInput", "TorchOptimizerMeter", "dtype_name", "local_nbytes", "replicated",
    # the model
    "enable_gradient_checkpointing",
    # the machine, Accelerate and accelerate config files
    "Accelerator", "check_accelerate_section", "current_machine", "read_accelerate_section", "resolve_mixed_precision",
    "already_running", "run_sharded_on_cpu", "warn_once_per_machine",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name == "Accelerator":  # imports accelerate: only when used
        from acc_train.accelerator import Accelerator

        return Accelerator
    raise AttributeError(f"module 'acc_train.api' has no attribute {name!r}")


def packs_rows(data_config: Any) -> bool:
    """Whether the job's rows are packed: ``data.packing``, or its data kind's own default."""
    if data_config.packing is not None:
        return bool(data_config.packing)
    from acc_train.data.files import data_kind

    return bool(data_kind(data_config).packs_by_default)


def packs_continuous_text(data_config: Any) -> bool:
    """Whether the job's rows are cut from one continuous token stream (``data.kind: text``,
    packed) rather than packed from whole examples."""
    from acc_train.data.files import data_kind

    return packs_rows(data_config) and bool(data_kind(data_config).continuous)
