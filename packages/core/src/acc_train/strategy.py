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

Modules defining strategies must not import torch, accelerate or deepspeed at import time:
listing strategies and ``--help`` never pay for them. Import them inside methods.
"""

from __future__ import annotations

import copy
import inspect
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from acc_train.errors import PluginError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from acc_train.memory.plan import MemoryPlan, PlanInput
    from acc_train.memory.state import ModelStateMeter
    from acc_train.contracts.protocols import JobView, RunView

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
    is a prototype; :meth:`configure` returns a copy bound to validated options, and that copy
    is what the job, the worker, the Accelerator and ``acc-train plan`` use.
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
    #: The ``accelerate launch`` variables :meth:`launch_env` speaks for: names, or prefixes
    #: ending in ``_`` (``FSDP_``). Those left in the user's shell give way when a program is
    #: launched under any strategy (with a warning), so a stale one never changes it.
    launch_variables: ClassVar[tuple[str, ...]] = ()
    #: ``Accelerator`` arguments through which a program asks Accelerate for this strategy
    #: (``fsdp_plugin``): a launched program passing one under another strategy is refused.
    accelerator_arguments: ClassVar[tuple[str, ...]] = ()

    rejoins_run: ClassVar[bool] = False  # a launch into a directory holding a run continues it (a replica group rejoins)
    _options: OptionsT | None = None

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

    def parse_options(self, raw: dict[str, Any]) -> OptionsT:
        """Validate the ``strategy:`` section. Raises pydantic's ValidationError; the caller
        turns it into a message naming the key path."""
        return self.options_schema.model_validate(raw)  # type: ignore[return-value]

    def configure(self, options: OptionsT) -> Strategy[OptionsT]:
        """A copy of this strategy bound to ``options`` (already validated)."""
        bound = copy.copy(self)
        bound._options = options
        return bound

    def check_environment(self, machine: Machine) -> None:
        """Raise :class:`acc_train.UserError` with a hint when this strategy cannot run on
        ``machine`` as configured. A strategy never silently becomes another."""

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

    def launch_env(self, machine: Machine, scratch: Path) -> dict[str, str]:
        """The variables ``accelerate launch`` gives its workers for this strategy with these
        options (``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``ACCELERATE_DEEPSPEED_*``...), for a program
        ``acc-train launch`` runs unchanged: Accelerate, HF Trainer and TRL build their plugins
        from them. ``scratch`` is a private directory that lives as long as the launch, for a file
        a variable names (a DeepSpeed JSON). Raise :class:`acc_train.UserError` naming an option
        that no variable carries and that :meth:`after_accelerator` does not apply either.

        The default suits a plain data-parallel strategy (Accelerate's ``MULTI_*`` types), which
        needs no variable; it calls :meth:`accelerator_kwargs` with no job so a strategy that
        refuses to run a user's program says so before launch. A strategy that declares another
        of Accelerate's types must map its options itself, or it is refused by name."""
        plain = {t for t in self.accelerate_distributed_types if t == "NO" or t.startswith("MULTI_")}
        if set(self.accelerate_distributed_types) - plain:
            from acc_train.errors import UserError

            raise UserError(
                f'strategy "{self.name}" declares no `acc-train launch` mapping (Strategy.launch_env), so a program '
                "launched unchanged would not run it",
                where="--strategy",
                hint="train through a job config (acc-train --config ...), or ask the plugin's authors for launch_env",
            )
        self.accelerator_kwargs(None)
        return {}

    def after_accelerator(self, accelerator: Accelerator) -> None:
        """Called right after the Accelerator is built, before anything is prepared.
        ``accelerator.acc_kwargs`` holds the keyword arguments it was built with.

        It is called for every Accelerator of a program that ``acc-train launch`` runs
        unchanged too (``accelerator.acc_launched`` is then True): there Accelerate built the
        plugins from :meth:`launch_env`'s variables, or the program passed its own, and this is
        where options no variable carries are applied, and where a strategy switches Accelerate
        to itself on a machine where Accelerate would fall back to another."""

    def before_program(self, machine: Machine) -> None:
        """Called in each worker of ``acc-train launch`` just before the user's program starts
        (after Accelerate's own classes are adopted): where a strategy refuses, with an error a
        person can act on, what a program may build that cannot run under it (e.g. a plugin
        written for another version of the strategy, which would fail inside Accelerate)."""

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

    def plan_variants(self) -> dict[str, dict[str, Any]]:
        """The option sets ``acc-train plan`` shows a row for, by label: the presets, or the
        defaults when there are none."""
        return {name: dict(options) for name, options in self.presets.items()} or {self.name: {}}

    def plan_memory(self, plan: PlanInput) -> MemoryPlan:
        """What one rank holds of the model state with these options, for ``acc-train plan``
        (no model is built). The default is a full replica on every rank, as DDP holds:
        16psi bytes in fp32. A sharding strategy states its own."""
        from acc_train.memory.plan import replicated

        return replicated(plan)

    def memory_tracker(self, model: Any, optimizer: Any) -> Any | None:
        """The torch memory tracker (``torch.distributed._tools``) that measures a step of
        ``model`` and ``optimizer`` as ``prepare`` returned them (Accelerate's optimizer wrapper),
        for ``acc-train plan --simulate``; None: ``MemTracker`` over the model and the torch
        optimizer, which suits a strategy whose parameters and optimizer state are the model's
        and the torch optimizer's own (a strategy keeping state elsewhere must count it here). FSDP2 answers ``FSDPMemTracker``, which
        tells sharded from gathered parameters and the all-gather and reduce-scatter buffers."""
        return None

    def parameter_shards(self, machine: Machine) -> int:
        """Into how many parts this strategy, with these options, splits the model's parameters
        across the ranks of ``machine``: 1 where every rank holds them whole (DDP, ZeRO-1/2),
        ``machine.world_size`` where each holds about 1/N (FSDP, ZeRO-3), the processes per
        machine under hybrid sharding. The conformance kit holds a run to it: each rank's
        parameter elements (``parameter_elements``, in ``run.json``) must be about total/shards."""
        return 1

    def checkpoint_format_name(self) -> str:
        """The registered checkpoint format to save with, given the options."""
        return self.checkpoint_format

    def equivalent_to_ddp(self) -> bool:
        """Whether, with these options and fp32, this strategy computes DDP's updates (sharding
        changes where state lives, not the arithmetic). The conformance kit
        (``acc_train.testing``) then checks that its losses match DDP's."""
        return False

    def compile_problem(self, settings: Any) -> str | None:
        """Why ``training.compile`` as set (``settings``: the validated section, with ``backend``,
        ``mode``, ``fullgraph``, ``dynamic``, ``regional``) cannot run under this strategy with
        these options, or None where it can. Called only when compile is enabled. Accelerate
        compiles the model its ``prepare`` returns; the default (None) suits a strategy whose
        model is prepared that way. A strategy whose wrapper or library does not survive
        compilation says why and what to use instead; the job is refused before launch with it."""
        return None

    def expected_distributed_types(self, machine: Machine) -> set[str]:
        """Names of Accelerate ``DistributedType`` members this strategy accepts on ``machine``.
        If Accelerate picks another one, the run stops with an error instead of training
        under a strategy the user did not ask for. Where the strategy declares
        ``accelerate_distributed_types``, the conformance kit also holds a run on several
        processes to those: a strategy that is Accelerate's FSDP must run as FSDP."""
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

    def data_part(self) -> tuple[int, int]:
        """(index, count): launches apart (replica groups) split each batch; this one reads part ``index``."""
        return (0, 1)

    def step_start(self, run: RunContext) -> None:
        """Before a step's first forward; may replace the state (a heal): the loop re-reads from ``run.state``."""

    def commit_step(self, run: RunContext) -> bool:
        """Before the optimizer step; False discards it (no optimizer or scheduler step, its batches again)."""
        return True

    def summary(self, accelerator: Accelerator) -> dict[str, Any]:
        """Extra keys for ``run.json`` (e.g. a ZeRO stage)."""
        return {}

    def low_precision_warning(self, dtype: str) -> str:
        """The one warning a run with ``model.dtype: bf16``/``fp16`` (``dtype``) prints: what this
        strategy then keeps in which precision. The default suits strategies whose torch
        optimizer steps the parameters themselves (DDP, FSDP); one whose library keeps its own
        master copy says so."""
        return (
            f"model.dtype: {dtype} trains the weights in {dtype} with no fp32 master copy: parameters, gradients and "
            f"optimizer moments are {dtype}, and updates smaller than its precision round away. "
            "model.dtype: auto keeps fp32 masters, with training.mixed_precision for the compute"
        )

    def all_names(self) -> list[str]:
        return [self.name, *self.aliases, *self.presets]


#: methods whose ``options`` parameter the first contract had; now ``self.options``
_LEGACY_OPTIONS_METHODS = (
    "check_environment", "accelerator_kwargs", "after_accelerator", "before_prepare", "full_state_dict",
    "plan_memory", "equivalent_to_ddp", "summary",
)  # fmt: skip


def legacy_contract_problem(strategy: Strategy[Any]) -> str | None:
    """Why ``strategy`` was written against the first strategy contract (methods taking
    ``options``), or None. Such a strategy would be called with the wrong arguments, so it is
    refused at registration with this message."""
    cls = type(strategy)
    if any("checkpoint_format_for" in vars(k) for k in cls.__mro__ if k is not Strategy):
        return (
            f"{cls.__name__} defines checkpoint_format_for(options), from acc-train's first strategy contract, "
            "which is no longer called; options are now bound to the strategy: rename it to "
            "checkpoint_format_name(self) and read self.options (docs/writing-a-strategy.md, 'Options belong to the strategy')"
        )
    for method in _LEGACY_OPTIONS_METHODS:
        impl = getattr(cls, method, None)
        if impl is None or impl is getattr(Strategy, method):
            continue
        try:
            params = inspect.signature(impl).parameters
        except (TypeError, ValueError):
            continue
        if "options" in params:
            return (
                f"{cls.__name__}.{method} takes an `options` argument, as in acc-train's first strategy contract; "
                f"options are now bound to the strategy: drop the parameter and read self.options "
                "(docs/writing-a-strategy.md, 'Options belong to the strategy')"
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
