"""The plugin manager: lazy, loaded once, tolerant of broken plugins.

Plugins are modules registered under the ``acc_train`` entry-point group. Core's own
defaults are the plugin ``builtin``, registered through the same hooks.

Environment variables:

- ``ACC_TRAIN_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry points (only ``builtin``).
- ``ACC_TRAIN_BLOCK_PLUGINS=name1,name2``: skip these plugins by entry-point name.
- ``ACC_TRAIN_TRACE_HOOKS=1``: print every hook call to stderr.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Generic, TypeVar

import pluggy

from acc_train import hookspecs
from acc_train.errors import PluginError, UserError, closest

__all__ = [
    "ENV_DISABLE_AUTOLOAD",
    "ENV_BLOCK",
    "ENV_TRACE",
    "PluginFailure",
    "PluginInfo",
    "Registry",
    "accelerate_config_section",
    "get_plugin_manager",
    "plugin_failures",
    "plugin_infos",
    "strategies",
    "wrap_policies",
    "checkpoint_formats",
    "reset",
]

ENV_DISABLE_AUTOLOAD = "ACC_TRAIN_DISABLE_PLUGIN_AUTOLOAD"
ENV_BLOCK = "ACC_TRAIN_BLOCK_PLUGINS"
ENV_TRACE = "ACC_TRAIN_TRACE_HOOKS"

BUILTIN = "builtin"


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
    from acc_train import builtin

    if BUILTIN not in blocked:
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


def plugin_failures() -> list[PluginFailure]:
    """Plugins that failed to import or register, after loading."""
    get_plugin_manager()
    strategies(), wrap_policies(), checkpoint_formats()
    return list(_failures)


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


def reset() -> None:
    """Forget the loaded plugins and registries (tests use this)."""
    global _pm
    _pm = None
    _infos.clear()
    _failures.clear()
    for reg in _REGISTRIES.values():
        reg._entries = None
        reg._conflicts = {}


T = TypeVar("T")


class NameConflictError(PluginError):
    """Two plugins claim one name: not resolvable by picking one silently."""


class _Rejected(Exception):
    """A registration that breaks the hook's contract; the plugin's call is dropped."""


class Registry(Generic[T]):
    """Objects registered by name through one registration hook, with their owners.

    A plugin whose registration breaks the contract (an object of the wrong type, a name
    another plugin already holds, a return value from a hook whose value is ignored, an
    exception) has that hook's registrations dropped and is reported by
    :func:`plugin_failures`; every other plugin's registrations stand. A name two plugins
    claim belongs to neither: selecting it is an error naming both.
    """

    def __init__(self, kind: str, hook_name: str, base: Callable[[], type] | None = None) -> None:
        self.kind = kind
        self.hook_name = hook_name
        #: the class registered objects must be instances of (imported lazily)
        self._base = base
        self._entries: dict[str, tuple[T, str]] | None = None
        self._conflicts: dict[str, tuple[str, str]] = {}

    def _check(self, obj: Any) -> list[str]:
        """The names ``obj`` registers under, or ``_Rejected`` saying why it cannot be registered."""
        base = self._base() if self._base else None
        if base is not None and not isinstance(obj, base):
            if isinstance(obj, type) and issubclass(obj, base):
                raise _Rejected(f"registered the class {obj.__name__} instead of an instance; call register({obj.__name__}())")
            raise _Rejected(
                f"registered {obj!r} ({type(obj).__name__}), which is not a {base.__module__}.{base.__qualname__}"
            )
        names = obj.all_names() if hasattr(obj, "all_names") else [getattr(obj, "name", None)]
        if not names or not all(isinstance(n, str) and n for n in names):
            raise _Rejected(f"registered a {self.kind} without a name: {obj!r}")
        return list(names)

    def _load(self) -> dict[str, tuple[T, str]]:
        if self._entries is not None:
            return self._entries
        entries: dict[str, tuple[T, str]] = {}
        self._conflicts = {}
        pm = get_plugin_manager()
        caller = getattr(pm.hook, self.hook_name)
        for impl in caller.get_hookimpls():  # registration order: builtin, then entry points by name
            owner = impl.plugin_name
            staged: dict[str, tuple[T, str]] = {}

            def register(obj: T, _owner: str = owner, _staged: dict = staged) -> None:
                for n in self._check(obj):
                    if n in _staged:
                        raise _Rejected(f'registered the {self.kind} name "{n}" twice')
                    _staged[n] = (obj, _owner)

            info = _infos.get(owner)
            dist = info.distribution if info else None
            outcome = f"had its {self.kind} registrations rejected"
            try:
                if _flag(ENV_TRACE):
                    sys.stderr.write(f"[acc_train hook] {self.hook_name} [plugin {owner}]\n")
                returned = impl.function(register=register)
                if returned is not None:
                    raise _Rejected(
                        f"{self.hook_name} returned {type(returned).__name__}; its return value is ignored, "
                        f"so call register(...) once per {self.kind} instead"
                    )
            except _Rejected as exc:
                _failures.append(PluginFailure(owner, dist, f"{self.hook_name}: {exc}", outcome=outcome))
                continue
            except Exception as exc:
                _failures.append(PluginFailure(owner, dist, f"{self.hook_name} raised {exc!r}", traceback.format_exc(), outcome))
                continue
            taken = {n: entries[n][1] for n in staged if n in entries or n in self._conflicts}
            for n, other in taken.items():
                first = self._conflicts[n][0] if n in self._conflicts else other
                self._conflicts[n] = (first, owner)
                entries.pop(n, None)
                _failures.append(
                    PluginFailure(
                        owner,
                        dist,
                        f'{self.kind} name "{n}" is claimed by both plugin "{first}" and plugin "{owner}"; '
                        "neither gets it",
                        outcome=outcome,
                    )
                )
            if taken:
                continue
            entries.update(staged)
        self._entries = entries
        return entries

    def names(self) -> list[str]:
        return sorted(self._load())

    def primary(self) -> list[tuple[T, str]]:
        """Each registered object once (not once per alias), with its owner."""
        seen: dict[int, tuple[T, str]] = {}
        for obj, owner in self._load().values():
            seen.setdefault(id(obj), (obj, owner))
        return sorted(seen.values(), key=lambda e: getattr(e[0], "name", ""))

    def owner(self, name: str) -> str:
        return self._load()[name][1]

    def get(self, name: str) -> T:
        entries = self._load()
        if name in entries:
            return entries[name][0]
        if name in self._conflicts:
            first, second = self._conflicts[name]
            raise NameConflictError(
                f'{self.kind} name "{name}" is claimed by both plugin "{first}" and plugin "{second}"',
                hint=f"uninstall one of them, or block one with {ENV_BLOCK}={second}",
            )
        raise self.not_found(name)

    def not_found(self, name: str) -> UserError:
        entries = self._load()
        near = closest(name, entries)
        hint = f'did you mean "{near}"?' if near else None
        return UserError(f'unknown {self.kind} "{name}"; registered: {", ".join(sorted(entries)) or "none"}', hint=hint)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


#: Strategy names of acc-train's own packages, so a missing one names what to install.
KNOWN_STRATEGY_PACKAGES: dict[str, str] = {
    "ddp": "acc-train-strategy-ddp",
    **dict.fromkeys(["fsdp", "fsdp1", "fsdp2", "fsdp-offload"], "acc-train-strategy-fsdp"),
    **dict.fromkeys(
        ["deepspeed", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload"], "acc-train-strategy-deepspeed"
    ),
}


class StrategyRegistry(Registry["Any"]):
    def not_found(self, name: str) -> UserError:
        installed = ", ".join(s.name for s, _ in self.primary()) or "none"
        package = KNOWN_STRATEGY_PACKAGES.get(name)
        if package:
            folder = "packages/" + package.removeprefix("acc-train-")
            return UserError(
                f'strategy "{name}" is not installed (installed strategies: {installed})',
                where="strategy.name",
                hint=f"install it with `pip install {package}` (in the acc-train repository: `pip install ./{folder}`)",
            )
        near = closest(name, self._load())
        return UserError(
            f'unknown strategy "{name}" (installed strategies: {installed})',
            where="strategy.name",
            hint=(f'did you mean "{near}"? ' if near else "")
            + "`acc-train strategies` lists them; a third-party strategy is installed with pip",
        )


def _strategy_base() -> type:
    from acc_train.strategy import Strategy

    return Strategy


def _wrap_policy_base() -> type:
    from acc_train.strategy import WrapPolicy

    return WrapPolicy


def _checkpoint_format_base() -> type:
    from acc_train.checkpoint import CheckpointFormat

    return CheckpointFormat


_REGISTRIES: dict[str, Registry[Any]] = {
    "strategy": StrategyRegistry("strategy", "acc_train_register_strategies", _strategy_base),
    "wrap_policy": Registry("wrap policy", "acc_train_register_wrap_policies", _wrap_policy_base),
    "checkpoint_format": Registry("checkpoint format", "acc_train_register_checkpoint_formats", _checkpoint_format_base),
}


def strategies() -> StrategyRegistry:
    return _REGISTRIES["strategy"]  # type: ignore[return-value]


def wrap_policies() -> Registry[Any]:
    return _REGISTRIES["wrap_policy"]


def checkpoint_formats() -> Registry[Any]:
    return _REGISTRIES["checkpoint_format"]


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


def call_lifecycle(name: str, **kwargs: Any) -> None:
    """Fire a lifecycle hook on all plugins."""
    getattr(get_plugin_manager().hook, name)(**kwargs)


def register_temporarily(plugin: object, name: str) -> Callable[[], None]:
    """Register an in-process plugin object; returns the function that unregisters it."""
    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    return lambda: pm.unregister(plugin)
