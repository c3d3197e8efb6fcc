"""Plugins: the pluggy manager (:mod:`~acc_train.plugins.manager`) and the registries of what
plugins register by name (:mod:`~acc_train.plugins.registry`)."""

from __future__ import annotations

from acc_train.plugins.manager import (
    BUILTIN,
    ENV_BLOCK,
    ENV_DISABLE_AUTOLOAD,
    ENV_TRACE,
    PluginFailure,
    PluginInfo,
    accelerate_config_section,
    call_lifecycle,
    get_plugin_manager,
    library_versions,
    plugin_infos,
    register_temporarily,
)
from acc_train.plugins.registry import (
    KNOWN_STRATEGY_PACKAGES,
    NameConflictError,
    Registry,
    StrategyRegistry,
    checkpoint_formats,
    commands,
    data_kinds,
    evaluators,
    optimizers,
    plugin_failures,
    reset,
    strategies,
    trackers,
    wrap_policies,
)

__all__ = [
    "BUILTIN", "ENV_BLOCK", "ENV_DISABLE_AUTOLOAD", "ENV_TRACE", "KNOWN_STRATEGY_PACKAGES", "NameConflictError",
    "PluginFailure", "PluginInfo", "Registry", "StrategyRegistry", "accelerate_config_section", "call_lifecycle",
    "checkpoint_formats", "commands", "data_kinds", "evaluators", "get_plugin_manager", "library_versions", "optimizers", "plugin_failures", "plugin_infos", "register_temporarily", "reset",
    "strategies", "trackers", "wrap_policies",
]  # fmt: skip
