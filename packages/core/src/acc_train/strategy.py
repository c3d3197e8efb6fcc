"""The ``Strategy`` contract: everything a distributed strategy changes goes through here.

A strategy plugin subclasses :class:`Strategy`, names its options schema, and registers an
instance. acc-train resolves the job's ``strategy:`` section once and hands every method a
*configured* strategy: ``self.options`` is the validated options, typed by the class parameter::

    from acc_train import Strategy, StrategyOptions, hookimpl

    class MyOptions(StrategyOptions):
        bucket_cap_mb: int = 25

    class MyStrategy(Strategy[MyOptions]):
        name = "mine"
        options_schema = MyOptions          # a pydantic model, extra="forbid"

        def accelerator_kwargs(self, job):
            return {"kwargs_handlers": [...self.options.bucket_cap_mb...]}

    @hookimpl
    def acc_train_register_strategies(register):
        register(MyStrategy())

The strategy holds what the run needs. What only one caller asks about lives in objects it
hands out: :meth:`Strategy.planner` (``acc-train plan``, the simulation, the conformance kit) and
:meth:`Strategy.launch_protocol` (``acc-train launch`` of a user's own program). The machine the
run is on is bound once (:meth:`Strategy.bind`) and read as ``self.machine``.

Modules defining strategies must not import torch, accelerate or deepspeed at import time:
listing strategies and ``--help`` never pay for them. Import them inside methods.
"""

from __future__ import annotations

import copy
import functools
import inspect
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from acc_train.errors import PluginError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from acc_train.contracts.launch import LaunchProtocol
    from acc_train.contracts.protocols import JobView, RunView
    from acc_train.contracts.replica_groups import ReplicaGroups
    from acc_train.memory.planner import StrategyPlanner
    from acc_train.memory.state import ModelStateMeter

__all__ = ["DEFAULT_STRATEGY", "Strategy", "StrategyOptions", "WrapPolicy", "Machine", "legacy_contract_problem"]

#: The strategy a job runs under when it names none.
DEFAULT_STRATEGY = "ddp"


class StrategyOptions(BaseModel):
    """Base for a strategy's options schema: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


OptionsT = TypeVar("OptionsT", bound=StrategyOptions)


@dataclass(frozen=True)
class Machine:
    """What the worker runs on, as a strategy needs to know it."""

    device_type: str  # "cpu" or "cuda" (or another torch device type)
    world_size: int
    num_machines: int = 1


class Strategy(ABC, Generic[OptionsT]):
    """A distributed training strategy, registered by name.

    Subclasses set ``name`` and ``options_schema`` and implement :meth:`accelerator_kwargs`.
    Everything else has a default that suits a data-parallel strategy. The registered instance
    is a prototype; :meth:`configure` returns a copy bound to validated options, and
    :meth:`bind` a copy of that bound to the machine the run is on: that copy is what the job's
    checks, the worker and the Accelerator use. Values a strategy derives from its options and
    machine may be cached with ``functools.cached_property``: each copy computes them afresh.
    """

    #: The name users pass to ``--strategy``.
    name: ClassVar[str]
    #: Other names that select the same strategy with no preset.
    aliases: ClassVar[tuple[str, ...]] = ()
    #: Named option sets: ``{"zero3-offload": {"stage": 3, ...}}``. Selecting a preset by name
    #: starts from those options; keys in the config's ``strategy:`` section override them.
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: One line for ``acc-train strategies``.
    description: ClassVar[str] = ""
    #: The pydantic model validating the ``strategy:`` section (less ``name``).
    options_schema: ClassVar[type[StrategyOptions]] = StrategyOptions
    #: The registered checkpoint format this strategy saves with.
    checkpoint_format: ClassVar[str] = "dcp"
    #: Accelerate ``DistributedType`` names (``distributed_type:`` in an ``accelerate config``
    #: file) that select this strategy; its plugin's ``acc_train_accelerate_config`` hook maps
    #: the rest of such a file.
    accelerate_distributed_types: ClassVar[tuple[str, ...]] = ()
    #: Top-level sections of an ``accelerate config`` file that its hook maps (``fsdp_config``).
    accelerate_config_sections: ClassVar[tuple[str, ...]] = ()
    #: Its replica groups (:mod:`acc_train.contracts.replica_groups`): separate launches training one model.
    replica_groups: ClassVar[type[ReplicaGroups] | None] = None

    _options: OptionsT | None = None
    _machine: Machine | None = None

    @property
    def options(self) -> OptionsT:
        """The validated options this strategy was configured with."""
        if self._options is None:
            raise PluginError(
                f'strategy "{self.name}" is not configured with options',
                hint="resolve it with acc_train.resolve_strategy(name, options) instead of using the registered instance",
            )
        return self._options

    @property
    def is_configured(self) -> bool:
        return self._options is not None

    @property
    def machine(self) -> Machine:
        """The machine this strategy was bound to (:meth:`bind`): device type, world size, machines."""
        if self._machine is None:
            raise PluginError(
                f'strategy "{self.name}" is not bound to a machine',
                hint="bind it with strategy.bind(machine) (acc-train does, from the launch section, before calling it)",
            )
        return self._machine

    @property
    def is_bound(self) -> bool:
        return self._machine is not None

    def parse_options(self, raw: dict[str, Any]) -> OptionsT:
        """Validate the ``strategy:`` section. Raises pydantic's ValidationError; the caller
        turns it into a message naming the key path."""
        return self.options_schema.model_validate(raw)  # type: ignore[return-value]

    def configure(self, options: OptionsT) -> Strategy[OptionsT]:
        """A copy of this strategy bound to ``options`` (already validated)."""
        bound = self._fresh_copy()
        bound._options = options
        return bound

    def bind(self, machine: Machine) -> Strategy[OptionsT]:
        """A copy of this strategy bound to ``machine``, the one the run is on (built once from the
        launch section before launch, :func:`acc_train.launch.launcher.launch_machine`; the worker's own in
        a worker), read as ``self.machine``."""
        bound = self._fresh_copy()
        bound._machine = machine
        return bound

    def _fresh_copy(self) -> Strategy[OptionsT]:
        """A shallow copy without the values ``functools.cached_property`` cached on this one."""
        fresh = copy.copy(self)
        for klass in type(self).__mro__:
            for key, value in vars(klass).items():
                if isinstance(value, functools.cached_property):
                    fresh.__dict__.pop(key, None)
        return fresh

    def check_environment(self) -> None:
        """Raise :class:`acc_train.UserError` with a hint when this strategy cannot run on
        ``self.machine`` as configured. A strategy never silently becomes another."""

    def check_job(self, config: Any) -> None:
        """Raise :class:`acc_train.UserError` when this strategy as configured cannot train the
        job's settings (``config``: the validated ``JobConfig``), e.g. a sequence length a
        context-parallel size must divide. Called before launch and in every worker."""

    def check_model(self, model: Any) -> None:
        """Raise :class:`acc_train.UserError` when this strategy as configured cannot split
        ``model`` (built on the meta device before launch, e.g. heads a tensor-parallel size must divide)."""

    @abstractmethod
    def accelerator_kwargs(self, job: JobView | None) -> dict[str, Any]:
        """Keyword arguments for ``accelerate.Accelerator(...)``: plugins and kwargs handlers
        (``fsdp_plugin``, ``deepspeed_plugin``, ``kwargs_handlers``...). ``job`` is None when a
        user's own script is launched (``acc-train launch``)."""

    def after_accelerator(self, accelerator: Accelerator) -> None:
        """Called right after the Accelerator is built, before anything is prepared.
        ``accelerator.acc_kwargs`` holds the keyword arguments it was built with.

        It is called for every Accelerator of a program that ``acc-train launch`` runs
        unchanged too (``accelerator.acc_launched`` is then True): there Accelerate built the
        plugins from the variables of :meth:`launch_protocol`, or the program passed its own, and this is
        where options no variable carries are applied, and where a strategy switches Accelerate
        to itself on a machine where Accelerate would fall back to another."""

    def before_prepare(self, accelerator: Accelerator, model: Any) -> None:
        """Called with each model just before Accelerate prepares (wraps) it, e.g. to resolve a
        wrap policy against the model's layers. In a program launched unchanged
        (``accelerator.acc_launched``) the plugin is Accelerate's or the program's: leave what
        it decides."""

    def clip_grad_norm(self, accelerator: Accelerator, max_norm: float) -> Any:
        """The loop's gradient clipping, where the strategy does it its own way: clip to
        ``max_norm`` (``inf``: only measure) and return the global norm, as a tensor left on
        the device or a float, never read back to the host (the loop reads it with the step's
        other values, every ``training.read_every`` steps). None (the default): Accelerate's
        ``clip_grad_norm_``. Not called in programs launched unchanged."""
        return None

    def full_state_dict(self, accelerator: Accelerator, model: Any) -> dict[str, Any]:
        """The whole model's state, gathered for ``save_pretrained`` on the main process (called
        on every rank; other ranks may get an empty dict)."""
        return accelerator.get_state_dict(model)

    def generation_model(self, accelerator: Accelerator, model: Any) -> AbstractContextManager[Any]:
        """The module to call ``generate`` on while the context lasts, for the samples a run
        writes at its evaluations (``eval.samples``). Called on every rank with the prepared
        model in eval mode, under ``torch.no_grad``; every rank then generates the same prompts
        in lockstep (``synced_gpus``), so a module that gathers its parameters in its forward
        may keep them sharded. The default, Accelerate's unwrapped model, suits a wrapper that
        only adds gradient hooks (DDP) and modules that gather their own parameters in their
        forward (FSDP2's ``fully_shard``, ZeRO-3's hooks); a strategy whose root wrapper
        gathers some parameters only in its own forward (FSDP1) gathers those here."""
        import contextlib

        return contextlib.nullcontext(accelerator.unwrap_model(model, keep_torch_compile=False))

    def parameter_elements(self, accelerator: Accelerator, model: Any) -> tuple[int, int]:
        """(elements this rank holds, elements of the whole model) for ``run.json``. The default
        understands plain tensors and DTensors; a strategy that partitions parameters its own
        way counts them itself."""
        local = total = 0
        for p in model.parameters():
            if hasattr(p, "to_local"):  # DTensor: numel() is the global size
                local, total = local + p.to_local().numel(), total + p.numel()
            else:
                local, total = local + p.numel(), total + p.numel()
        return local, total

    def model_state_meter(self, accelerator: Accelerator, model: Any, optimizer: Any) -> ModelStateMeter | None:
        """What counts this rank's parameter, gradient and optimizer-state bytes for run.json's
        ``model_state_bytes``, or None where they cannot be counted. Called once, after
        ``prepare``. The default reads the torch optimizer's parameters, gradients and state."""
        from acc_train.memory.state import TorchOptimizerMeter

        return TorchOptimizerMeter(optimizer)

    def checkpoint_format_name(self) -> str:
        """The registered checkpoint format to save with, given the options."""
        return self.checkpoint_format

    def compile_problem(self, settings: Any) -> str | None:
        """Why ``training.compile`` as set (``settings``: the validated section, with ``backend``,
        ``mode``, ``fullgraph``, ``dynamic``, ``regional``) cannot run under this strategy with
        these options, or None where it can. Called only when compile is enabled. Accelerate
        compiles the model its ``prepare`` returns; the default (None) suits a strategy whose
        model is prepared that way. A strategy whose wrapper or library does not survive
        compilation says why and what to use instead; the job is refused before launch with it."""
        return None

    def expected_distributed_types(self) -> set[str]:
        """Names of Accelerate ``DistributedType`` members this strategy accepts on ``self.machine``.
        If Accelerate picks another one, the run stops with an error instead of training
        under a strategy the user did not ask for. Where the strategy declares
        ``accelerate_distributed_types``, the conformance kit also holds a run on several
        processes to those: a strategy that is Accelerate's FSDP must run as FSDP."""
        machine = self.machine
        multi = "MULTI_GPU" if machine.device_type == "cuda" else f"MULTI_{machine.device_type.upper()}"
        # one process: NO in-process, or a one-rank process group under the launcher
        return {"NO", multi} if machine.world_size == 1 else {multi}

    def state_dict(self, run: RunView) -> dict[str, Any]:
        """This rank's state that the strategy keeps beyond model and optimizer (a comm hook's
        error feedback, a step counter), so that a resumed run continues exactly. Called on every
        rank at each checkpoint, with the run (``run.extras`` is where plugins keep per-run
        objects). Return a dict with string keys whose leaves are tensors or JSON values, nested
        in dicts: it is written per rank as safetensors plus JSON, never pickled. ``{}`` (the
        default): nothing of its own."""
        return {}

    def load_state_dict(self, run: RunView, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned on this rank, with tensors on the CPU. Called
        on every rank of a resumed run, after model and optimizer are restored and before
        ``acc_train_train_start``, when the checkpoint holds this strategy's state for this rank
        (written by a strategy of the same name, under the same number of processes); otherwise
        the run starts the strategy's state afresh, as a new run would."""

    def summary(self, accelerator: Accelerator) -> dict[str, Any]:
        """Extra keys for ``run.json`` (e.g. a ZeRO stage)."""
        return {}

    def planner(self) -> StrategyPlanner[Any]:
        """What ``acc-train plan``, ``plan --simulate`` and the conformance kit ask about this
        strategy with these options: its memory plan, the variants the plan shows, how it splits
        the parameters, the tracker that measures a simulated step, whether it computes DDP's
        updates, what it keeps in low precision. The default suits a replicated strategy (DDP);
        a strategy that shards returns its own :class:`acc_train.api.StrategyPlanner`."""
        from acc_train.memory.planner import StrategyPlanner

        return StrategyPlanner(self)

    def launch_protocol(self) -> LaunchProtocol[Any] | None:
        """How ``acc-train launch`` runs a user's own program under this strategy: the variables
        ``accelerate launch`` would give its workers, the ``Accelerator`` arguments that ask for
        it, and what to refuse before the program starts; None: such programs cannot run under
        it, and ``acc-train launch`` refuses it by name. The default suits a plain data-parallel
        strategy (Accelerate's ``MULTI_*`` types), which needs no variable; a strategy declaring
        another of Accelerate's types maps its options in its own
        :class:`acc_train.api.LaunchProtocol`, or is refused."""
        plain = {t for t in self.accelerate_distributed_types if t == "NO" or t.startswith("MULTI_")}
        if set(self.accelerate_distributed_types) - plain:
            return None
        from acc_train.contracts.launch import LaunchProtocol

        return LaunchProtocol(self)

    def all_names(self) -> list[str]:
        return [self.name, *self.aliases, *self.presets]


#: methods whose ``options`` parameter the first contract had; now ``self.options``
_LEGACY_OPTIONS_METHODS = (
    "check_environment", "accelerator_kwargs", "after_accelerator", "before_prepare", "full_state_dict", "summary",
)  # fmt: skip
#: members that moved off ``Strategy`` into the object it hands out, by that object's method and class
_MOVED = {
    **dict.fromkeys(
        ("plan_variants", "plan_memory", "parameter_shards", "memory_tracker", "equivalent_to_ddp", "low_precision_warning"),
        ("planner", "StrategyPlanner"),
    ),
    **dict.fromkeys(("launch_env", "before_program", "launch_variables", "accelerator_arguments"), ("launch_protocol", "LaunchProtocol")),
}
#: methods that took the machine as an argument; now ``self.machine``
_LEGACY_MACHINE_METHODS = ("check_environment", "expected_distributed_types")
_GUIDE = "docs/writing-a-strategy.md"


def _parameters(cls: type, method: str) -> Any:
    impl = getattr(cls, method, None)
    if impl is None or impl is getattr(Strategy, method, None):
        return {}
    try:
        return inspect.signature(impl).parameters
    except (TypeError, ValueError):
        return {}


def legacy_contract_problem(strategy: Strategy[Any]) -> str | None:
    """Why ``strategy`` was written against an earlier strategy contract, or None: methods taking
    ``options`` (the first), planning or launch members on the strategy itself, or methods taking
    the machine (the second). Such a strategy would be called with the wrong arguments, or not
    at all, so it is refused at registration with this message, which names the rename."""
    cls = type(strategy)
    own = [k for k in cls.__mro__ if k is not Strategy and k is not object]
    if any("checkpoint_format_for" in vars(k) for k in own):
        return (
            f"{cls.__name__} defines checkpoint_format_for(options), from acc-train's first strategy contract, "
            "which is no longer called; options are now bound to the strategy: rename it to "
            f"checkpoint_format_name(self) and read self.options ({_GUIDE}, 'Options belong to the strategy')"
        )
    for method in _LEGACY_OPTIONS_METHODS:
        if "options" in _parameters(cls, method):
            return (
                f"{cls.__name__}.{method} takes an `options` argument, as in acc-train's first strategy contract; "
                f"options are now bound to the strategy: drop the parameter and read self.options "
                f"({_GUIDE}, 'Options belong to the strategy')"
            )
    for name, (method, base) in _MOVED.items():
        if any(name in vars(k) for k in own):
            return (
                f"`{name}` moved to the strategy's {method}(): {cls.__name__} defines it on the strategy, where acc-train "
                f"no longer reads it; define it on a subclass of acc_train.api.{base} (self.strategy is the configured "
                f"strategy) and return an instance from {cls.__name__}.{method}() ({_GUIDE}, 'What a strategy hands out')"
            )
    for method in _LEGACY_MACHINE_METHODS:
        if "machine" in _parameters(cls, method):
            return (
                f"{cls.__name__}.{method} takes a `machine` argument, as in acc-train's second strategy contract; the "
                f"machine is now bound to the strategy once: drop the parameter and read self.machine "
                f"({_GUIDE}, 'The machine')"
            )
    return None


class WrapPolicy(ABC):
    """How a sharding strategy splits a model into separately sharded units."""

    name: ClassVar[str]
    description: ClassVar[str] = ""

    @abstractmethod
    def build(self, model: Any, options: dict[str, Any]) -> Any:
        """Return what the sharding library takes as its auto-wrap policy for ``model``."""

    def all_names(self) -> list[str]:
        return [self.name]
