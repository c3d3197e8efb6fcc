"""The ``Strategy`` contract: everything a distributed strategy changes goes through here.

A strategy plugin subclasses :class:`Strategy` and registers an instance::

    from acc_train import Strategy, hookimpl

    class MyStrategy(Strategy):
        name = "mine"
        options_schema = MyOptions          # a pydantic model, extra="forbid"

        def accelerator_kwargs(self, options, job):
            return {"kwargs_handlers": [...]}

    @hookimpl
    def acc_train_register_strategies(register):
        register(MyStrategy())

Modules defining strategies must not import torch, accelerate or deepspeed at import time:
listing strategies and ``--help`` never pay for them. Import them inside methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from accelerate import Accelerator

    from acc_train.config import JobConfig
    from acc_train.memory_plan import MemoryPlan, PlanInput
    from acc_train.model_state import ModelStateMeter

__all__ = ["Strategy", "StrategyOptions", "WrapPolicy", "Machine"]


class StrategyOptions(BaseModel):
    """Base for a strategy's options schema: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


@dataclass(frozen=True)
class Machine:
    """What the worker runs on, as a strategy needs to know it."""

    device_type: str  # "cpu" or "cuda" (or another torch device type)
    world_size: int
    num_machines: int = 1


class Strategy(ABC):
    """A distributed training strategy, registered by name.

    Subclasses set ``name`` and ``options_schema`` and implement :meth:`accelerator_kwargs`.
    Everything else has a default that suits a data-parallel strategy.
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

    def parse_options(self, raw: dict[str, Any]) -> StrategyOptions:
        """Validate the ``strategy:`` section. Raises pydantic's ValidationError; the caller
        turns it into a message naming the key path."""
        return self.options_schema.model_validate(raw)

    def check_environment(self, options: StrategyOptions, machine: Machine) -> None:
        """Raise :class:`acc_train.UserError` with a hint when this strategy cannot run on
        ``machine`` as configured. A strategy never silently becomes another."""

    @abstractmethod
    def accelerator_kwargs(self, options: StrategyOptions, job: JobConfig | None) -> dict[str, Any]:
        """Keyword arguments for ``accelerate.Accelerator(...)``: plugins and kwargs handlers
        (``fsdp_plugin``, ``deepspeed_plugin``, ``kwargs_handlers``...). ``job`` is None when a
        user's own script is launched (``acc-train launch``)."""

    def after_accelerator(self, accelerator: Accelerator, options: StrategyOptions) -> None:
        """Called right after the Accelerator is built, before anything is prepared.
        ``accelerator.acc_kwargs`` holds the keyword arguments it was built with."""

    def before_prepare(self, accelerator: Accelerator, model: Any, options: StrategyOptions) -> None:
        """Called with each model just before Accelerate prepares (wraps) it, e.g. to resolve a
        wrap policy against the model's layers."""

    def full_state_dict(self, accelerator: Accelerator, model: Any, options: StrategyOptions) -> dict[str, Any]:
        """The whole model's state, gathered for ``save_pretrained`` on the main process (called
        on every rank; other ranks may get an empty dict)."""
        return accelerator.get_state_dict(model)

    def parameter_elements(self, accelerator: Accelerator, model: Any) -> tuple[int, int]:
        """(elements this rank holds, elements of the whole model) for ``run.json``. The default
        understands plain tensors, DTensors (FSDP2) and DeepSpeed ZeRO-3 partitions."""
        local = total = 0
        for p in model.parameters():
            if hasattr(p, "ds_tensor"):  # DeepSpeed ZeRO-3 partition
                local, total = local + p.ds_tensor.numel(), total + p.ds_numel
            elif hasattr(p, "to_local"):  # DTensor: numel() is the global size
                local, total = local + p.to_local().numel(), total + p.numel()
            else:
                local, total = local + p.numel(), total + p.numel()
        return local, total

    def model_state_meter(self, accelerator: Accelerator, model: Any, optimizer: Any) -> ModelStateMeter | None:
        """What counts this rank's parameter, gradient and optimizer-state bytes for run.json's
        ``model_state_bytes``, or None where they cannot be counted. Called once, after
        ``prepare``. The default reads the torch optimizer's parameters, gradients and state."""
        from acc_train.model_state import TorchOptimizerMeter

        return TorchOptimizerMeter(optimizer)

    def plan_variants(self) -> dict[str, dict[str, Any]]:
        """The option sets ``acc-train plan`` shows a row for, by label: the presets, or the
        defaults when there are none."""
        return {name: dict(options) for name, options in self.presets.items()} or {self.name: {}}

    def plan_memory(self, options: StrategyOptions, plan: PlanInput) -> MemoryPlan:
        """What one rank holds of the model state with ``options``, for ``acc-train plan``
        (no model is built). The default is a full replica on every rank, as DDP holds:
        16psi bytes in fp32. A sharding strategy states its own."""
        from acc_train.memory_plan import replicated

        return replicated(plan)

    def checkpoint_format_for(self, options: StrategyOptions) -> str:
        """The registered checkpoint format to save with, given the options."""
        return self.checkpoint_format

    def equivalent_to_ddp(self, options: StrategyOptions) -> bool:
        """Whether, with ``options`` and fp32, this strategy computes DDP's updates (sharding
        changes where state lives, not the arithmetic). The conformance kit
        (``acc_train.testing``) then checks that its losses match DDP's."""
        return False

    def expected_distributed_types(self, machine: Machine) -> set[str]:
        """Names of Accelerate ``DistributedType`` members this strategy accepts on ``machine``.
        If Accelerate picks another one, the run stops with an error instead of training
        under a strategy the user did not ask for."""
        multi = "MULTI_GPU" if machine.device_type == "cuda" else f"MULTI_{machine.device_type.upper()}"
        # one process: NO in-process, or a one-rank process group under the launcher
        return {"NO", multi} if machine.world_size == 1 else {multi}

    def summary(self, accelerator: Accelerator, options: StrategyOptions) -> dict[str, Any]:
        """Extra keys for ``run.json`` (e.g. a ZeRO stage)."""
        return {}

    def all_names(self) -> list[str]:
        return [self.name, *self.aliases, *self.presets]


class WrapPolicy(ABC):
    """How a sharding strategy splits a model into separately sharded units."""

    name: ClassVar[str]
    description: ClassVar[str] = ""

    @abstractmethod
    def build(self, model: Any, options: dict[str, Any]) -> Any:
        """Return what the sharding library takes as its auto-wrap policy for ``model``."""

    def all_names(self) -> list[str]:
        return [self.name]
