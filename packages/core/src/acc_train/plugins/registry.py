"""Objects registered by name through a registration hook: strategies, wrap policies,
checkpoint formats, data kinds, optimizers; a name two plugins claim belongs to neither."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from acc_train.errors import PluginError, UserError, closest
from acc_train.plugins.manager import ENV_BLOCK, ENV_TRACE, PluginFailure, _failures, _flag, _infos, forget_plugins, get_plugin_manager
from acc_train.strategy import Strategy, WrapPolicy, legacy_contract_problem

__all__ = [
    "KNOWN_STRATEGY_PACKAGES", "NameConflictError", "Registry", "StrategyRegistry", "strategies", "wrap_policies",
    "checkpoint_formats", "data_kinds", "optimizers", "plugin_failures", "reset", "trackers", "evaluators",
]  # fmt: skip


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

    def registered(self) -> list[tuple[T, str]]:
        """Each registered object once, with its owner, in the order they registered (core's
        own plugin first, then the entry points by name)."""
        seen: dict[int, tuple[T, str]] = {}
        for obj, owner in self._load().values():
            seen.setdefault(id(obj), (obj, owner))
        return list(seen.values())

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

    def lookup(self, name: str, where: str) -> T:
        """:meth:`get` for a name the user's config gives at ``where``: an unknown name is a
        UserError naming the installed ones, the closest, and the hook that adds more (a name
        two plugins claim stays a :class:`NameConflictError`)."""
        try:
            return self.get(name)
        except NameConflictError:
            raise
        except UserError:
            names = self.names()
            near = closest(name, names)
            raise UserError(
                f"unknown {self.kind} {name!r} (installed {self.kind}s: {', '.join(names) or 'none'})",
                where=where,
                hint=(f"did you mean {near!r}? " if near else "") + f"a plugin adds {self.kind}s through the {self.hook_name} hook",
            ) from None

    def not_found(self, name: str) -> UserError:
        entries = self._load()
        near = closest(name, entries)
        hint = f'did you mean "{near}"?' if near else None
        return UserError(f'unknown {self.kind} "{name}"; registered: {", ".join(sorted(entries)) or "none"}', hint=hint)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


#: The one table of strategies core knows by name: acc-train's own strategy packages, so that
#: selecting a strategy that is not installed names the package to install. A test checks it
#: against what the workspace's plugins register (names, aliases and presets).
KNOWN_STRATEGY_PACKAGES: dict[str, str] = {
    **dict.fromkeys(["ddp", "data-parallel"], "acc-train-strategy-ddp"),
    **dict.fromkeys(["fsdp", "fully-sharded", "fsdp1", "fsdp2", "fsdp-offload"], "acc-train-strategy-fsdp"),
    **dict.fromkeys(
        ["deepspeed", "zero", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload"], "acc-train-strategy-deepspeed"
    ),
}


class StrategyRegistry(Registry["Strategy[Any]"]):
    def _check(self, obj: Any) -> list[str]:
        names = super()._check(obj)
        problem = legacy_contract_problem(obj)
        if problem is not None:
            raise _Rejected(problem)
        return names

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


def _checkpoint_format_base() -> type:
    from acc_train.checkpoint import CheckpointFormat

    return CheckpointFormat


def _data_kind_base() -> type:
    from acc_train.contracts.data_kind import DataKind

    return DataKind


def _tracker_base() -> type:
    from acc_train.outputs.tracker_kinds import TrackerKind

    return TrackerKind


def _evaluator_base() -> type:
    from acc_train.contracts.evaluator import EvaluatorKind

    return EvaluatorKind


def _optimizer_base() -> type:
    from acc_train.model.optimizer import OptimizerKind

    return OptimizerKind


_REGISTRIES: dict[str, Registry[Any]] = {
    "strategy": StrategyRegistry("strategy", "acc_train_register_strategies", lambda: Strategy),
    "wrap_policy": Registry("wrap policy", "acc_train_register_wrap_policies", lambda: WrapPolicy),
    "checkpoint_format": Registry("checkpoint format", "acc_train_register_checkpoint_formats", _checkpoint_format_base),
    "data_kind": Registry("data kind", "acc_train_register_data_kinds", _data_kind_base),
    "optimizer": Registry("optimizer", "acc_train_register_optimizers", _optimizer_base),
    "tracker": Registry("tracker", "acc_train_register_trackers", _tracker_base),
    "evaluator": Registry("evaluator", "acc_train_register_evaluators", _evaluator_base),
    # click commands: the CLI checks their type (core does not import click)
    "command": Registry("command", "acc_train_register_commands"),
}


def strategies() -> StrategyRegistry:
    return _REGISTRIES["strategy"]  # type: ignore[return-value]


def wrap_policies() -> Registry[Any]:
    return _REGISTRIES["wrap_policy"]


def checkpoint_formats() -> Registry[Any]:
    return _REGISTRIES["checkpoint_format"]


def data_kinds() -> Registry[Any]:
    return _REGISTRIES["data_kind"]


def optimizers() -> Registry[Any]:
    return _REGISTRIES["optimizer"]


def trackers() -> Registry[Any]:
    return _REGISTRIES["tracker"]


def evaluators() -> Registry[Any]:
    return _REGISTRIES["evaluator"]


def commands() -> Registry[Any]:
    return _REGISTRIES["command"]


def plugin_failures() -> list[PluginFailure]:
    """Plugins that failed to import or register, after loading."""
    get_plugin_manager()
    strategies(), wrap_policies(), checkpoint_formats(), data_kinds(), optimizers(), trackers(), evaluators(), commands()
    return list(_failures)


def reset() -> None:
    """Forget the loaded plugins and registries (tests use this)."""
    forget_plugins()
    for reg in _REGISTRIES.values():
        reg._entries = None
        reg._conflicts = {}
