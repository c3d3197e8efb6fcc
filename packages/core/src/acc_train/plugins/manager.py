"""The plugin manager: lazy, loaded once, tolerant of broken plugins.

Plugins are modules registered under the ``acc_train`` entry-point group. Core's own
defaults are the plugin ``builtin``, registered through the same hooks.

Environment variables:

- ``ACC_TRAIN_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points (only ``builtin``).
- ``ACC_TRAIN_BLOCK_PLUGINS=name1,name2``: skip these plugins by entry-point name.
- ``ACC_TRAIN_TRACE_HOOKS=1``: print every hook call to stderr.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from acc_train import hookspecs
from acc_train.errors import PluginError, closest

__all__ = [
    "ENV_DISABLE_AUTOLOAD", "ENV_BLOCK", "ENV_TRACE", "PluginFailure", "PluginInfo", "get_plugin_manager",
    "plugin_infos", "forget_plugins", "accelerate_config_section", "library_versions", "call_lifecycle", "register_temporarily",
]  # fmt: skip

ENV_DISABLE_AUTOLOAD = "ACC_TRAIN_DISABLE_PLUGIN_AUTOLOAD"
ENV_BLOCK = "ACC_TRAIN_BLOCK_PLUGINS"
ENV_TRACE = "ACC_TRAIN_TRACE_HOOKS"

BUILTIN = "builtin"
BUILTIN_MODULE = "acc_train.builtin"


@dataclass
class PluginFailure:
    """A plugin that could not be used (or one of its hooks whose result was rejected), and why."""

    name: str
    distribution: str | None
    reason: str
    traceback: str = ""
    #: what became of the plugin: skipped altogether, or one hook's registrations rejected
    outcome: str = "was skipped"

    def __str__(self) -> str:
        dist = f" (distribution {self.distribution})" if self.distribution else ""
        return f'plugin "{self.name}"{dist} {self.outcome}: {self.reason}'


@dataclass
class PluginInfo:
    name: str
    distribution: str | None
    version: str | None
    module: str
    hooks: list[str] = field(default_factory=list)


_pm: pluggy.PluginManager | None = None
_infos: dict[str, PluginInfo] = {}
_failures: list[PluginFailure] = []


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _blocked() -> set[str]:
    return {n.strip() for n in os.environ.get(ENV_BLOCK, "").split(",") if n.strip()}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created and loaded on first use."""
    global _pm
    if _pm is not None:
        return _pm
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    blocked = _blocked()
    if BUILTIN not in blocked:
        # core's own plugin sits above the manager (it registers the dcp format and draws
        # reports), so it is loaded by name, as entry points are
        builtin = importlib.import_module(BUILTIN_MODULE)
        pm.register(builtin, name=BUILTIN)
        _infos[BUILTIN] = PluginInfo(BUILTIN, "acc-train-core", _version("acc-train-core"), builtin.__name__)
    if not _flag(ENV_DISABLE_AUTOLOAD):
        for ep in _entry_points():
            if ep.name in blocked or pm.has_plugin(ep.name):
                continue
            dist = ep.dist.name if ep.dist else None
            try:
                module = ep.load()
            except Exception as exc:  # a broken plugin must not take the others down
                _failures.append(
                    PluginFailure(ep.name, dist, f"import of {ep.value} failed: {exc!r}", traceback.format_exc())
                )
                continue
            problem = _contract_problem(pm, module, ep.name)
            if problem is not None:
                if pm.is_registered(module):
                    pm.unregister(module)
                _failures.append(PluginFailure(ep.name, dist, problem))
                continue
            _infos[ep.name] = PluginInfo(
                ep.name, dist, ep.dist.version if ep.dist else None, getattr(module, "__name__", ep.value)
            )
    if _flag(ENV_TRACE):
        pm.trace.root.setwriter(lambda msg: sys.stderr.write(f"[acc_train hook] {msg}"))
        pm.enable_tracing()
    _pm = pm
    return pm


def _hook_names() -> list[str]:
    return [n for n in vars(hookspecs) if n.startswith(f"{hookspecs.PROJECT_NAME}_")]


def _contract_problem(pm: pluggy.PluginManager, module: object, name: str) -> str | None:
    """Register ``module``; return why it breaks the hook contract (it is then not usable), or None.

    pluggy rejects an implementation whose arguments the spec lacks; an implementation of a hook
    that does not exist, or a hook-named function without ``@hookimpl`` (which pluggy would
    silently ignore), is rejected here, so a typo never passes unnoticed.
    """
    specs = _hook_names()
    for attr in dir(module):
        if attr in specs and callable(getattr(module, attr, None)):
            if pm.parse_hookimpl_opts(module, attr) is None:
                return f"{attr} is defined without @acc_train.hookimpl, so it would never be called"
    try:
        pm.register(module, name=name)
    except pluggy.PluginValidationError as exc:
        return f"a hook implementation does not match its spec: {exc}"
    except ValueError as exc:  # pluggy: the same module object under another name
        return str(exc)
    for impl_caller in pm.get_hookcallers(module) or []:
        if not impl_caller.has_spec():
            near = closest(impl_caller.name, specs)
            return f'implements unknown hook "{impl_caller.name}"' + (f'; did you mean "{near}"?' if near else "")
    return None


def _entry_points() -> list[metadata.EntryPoint]:
    seen: set[str] = set()
    eps = []
    for ep in sorted(metadata.entry_points(group=hookspecs.PROJECT_NAME), key=lambda e: e.name):
        if ep.name not in seen:  # the same distribution on the path twice
            seen.add(ep.name)
            eps.append(ep)
    return eps


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def forget_plugins() -> None:
    """Drop the plugin manager and what it recorded; the next use loads the plugins again."""
    global _pm
    _pm = None
    _infos.clear()
    _failures.clear()


def plugin_infos() -> list[PluginInfo]:
    pm = get_plugin_manager()
    out = []
    for name, info in _infos.items():
        plugin = pm.get_plugin(name)
        if plugin is None:
            continue
        info.hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        out.append(info)
    return out


def accelerate_config_section(distributed_type: str, config: dict[str, Any]) -> dict[str, Any] | None:
    """``acc_train_accelerate_config``'s first non-None answer, checked: a plugin that answers
    with anything but ``{"strategy": {"name": ..., ...}, ...}`` is named in the error."""
    pm = get_plugin_manager()
    for impl in reversed(pm.hook.acc_train_accelerate_config.get_hookimpls()):  # pluggy's call order
        if _flag(ENV_TRACE):
            sys.stderr.write(f"[acc_train hook] acc_train_accelerate_config [plugin {impl.plugin_name}]\n")
        answer = impl.function(distributed_type=distributed_type, config=config)
        if answer is None:
            continue
        strategy = answer.get("strategy") if isinstance(answer, dict) else None
        if not (isinstance(strategy, dict) and isinstance(strategy.get("name"), str)):
            raise PluginError(
                f'plugin "{impl.plugin_name}" answered acc_train_accelerate_config for {distributed_type} with '
                f"{type(answer).__name__} {answer!r:.200}, not config sections with strategy.name",
                hint=f"report it to the plugin's authors, or block it with {ENV_BLOCK}={impl.plugin_name}",
            )
        return answer
    return None


def library_versions() -> dict[str, str]:
    """A manifest's ``versions``: what every plugin's ``acc_train_library_versions`` reports,
    core's own first; a later plugin does not replace a version an earlier one reported."""
    out: dict[str, str] = {}
    for reported in reversed(get_plugin_manager().hook.acc_train_library_versions()):  # pluggy calls the last registered first
        if isinstance(reported, dict):
            for dist, version in reported.items():
                out.setdefault(str(dist), str(version))
    return out


def call_lifecycle(name: str, **kwargs: Any) -> None:
    """Fire a lifecycle hook on all plugins (nothing to do, and no call, where none implements it:
    the loop fires some every step)."""
    hook = getattr(get_plugin_manager().hook, name)
    if hook.get_hookimpls():
        hook(**kwargs)


def register_temporarily(plugin: object, name: str) -> Callable[[], None]:
    """Register an in-process plugin object; returns the function that unregisters it."""
    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    return lambda: pm.unregister(plugin)
