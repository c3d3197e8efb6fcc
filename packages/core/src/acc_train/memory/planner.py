"""The planner a strategy hands out (:meth:`acc_train.Strategy.planner`): what ``acc-train plan``,
``plan --simulate`` and the conformance kit ask of a strategy with its options, none of which a
run needs. Planning answers for machines other than this one (eight GPUs, from a laptop), so its
questions name the world they are about.

A strategy that shards subclasses :class:`StrategyPlanner` and returns it from ``planner()``::

    class MyPlanner(StrategyPlanner["MyStrategy"]):
        def plan_memory(self, plan):
            ...self.options...

    class MyStrategy(Strategy[MyOptions]):
        def planner(self):
            return MyPlanner(self)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from acc_train.contracts.protocols import MachineView
    from acc_train.memory.plan import MemoryPlan, PlanInput

__all__ = ["StrategyPlanner"]

#: the configured ``acc_train.Strategy`` the planner answers for (typed loosely: this layer is below it)
StrategyT = TypeVar("StrategyT")


class StrategyPlanner(Generic[StrategyT]):
    """Planning, simulation and the conformance kit's facts for ``strategy`` (configured). The
    defaults describe a full replica on every rank, as DDP holds."""

    def __init__(self, strategy: StrategyT) -> None:
        self.strategy = strategy

    @property
    def options(self) -> Any:
        """The strategy's validated options."""
        return self.strategy.options  # type: ignore[attr-defined]

    def plan_variants(self) -> dict[str, dict[str, Any]]:
        """The option sets ``acc-train plan`` shows a row for, by label: the presets, or the
        defaults when there are none."""
        strategy: Any = self.strategy
        return {name: dict(options) for name, options in strategy.presets.items()} or {strategy.name: {}}

    def plan_memory(self, plan: PlanInput) -> MemoryPlan:
        """What one rank holds of the model state with these options, for ``acc-train plan``
        (no model is built). The default is a full replica on every rank, as DDP holds:
        16psi bytes in fp32. A sharding strategy states its own."""
        from acc_train.memory.plan import replicated

        return replicated(plan)

    def parameter_shards(self, machine: MachineView) -> int:
        """Into how many parts the strategy, with these options, splits the model's parameters
        across the ranks of ``machine``: 1 where every rank holds them whole (DDP, ZeRO-1/2),
        ``machine.world_size`` where each holds about 1/N (FSDP, ZeRO-3), the processes per
        machine under hybrid sharding. The conformance kit holds a run to it: each rank's
        parameter elements (``Strategy.parameter_elements``, in ``run.json``) must be about total/shards."""
        return 1

    def memory_tracker(self, model: Any, optimizer: Any) -> Any | None:
        """The torch memory tracker (``torch.distributed._tools``) that measures a step of
        ``model`` and ``optimizer`` as ``prepare`` returned them (Accelerate's optimizer wrapper),
        for ``acc-train plan --simulate``; None: ``MemTracker`` over the model and the torch
        optimizer, which suits a strategy whose parameters and optimizer state are the model's
        and the torch optimizer's own (a strategy keeping state elsewhere must count it here).
        FSDP2 answers ``FSDPMemTracker``, which tells sharded from gathered parameters and the
        all-gather and reduce-scatter buffers."""
        return None

    def equivalent_to_ddp(self) -> bool:
        """Whether, with these options and fp32, the strategy computes DDP's updates (sharding
        changes where state lives, not the arithmetic). The conformance kit
        (``acc_train.testing``) then checks that its losses match DDP's."""
        return False

    def low_precision_warning(self, dtype: str) -> str:
        """The one warning a run with ``model.dtype: bf16``/``fp16`` (``dtype``) prints: what the
        strategy then keeps in which precision (the plan's note says the same). The default suits
        strategies whose torch optimizer steps the parameters themselves (DDP, FSDP); one whose
        library keeps its own master copy says so."""
        return (
            f"model.dtype: {dtype} trains the weights in {dtype} with no fp32 master copy: parameters, gradients and "
            f"optimizer moments are {dtype}, and updates smaller than its precision round away. "
            "model.dtype: auto keeps fp32 masters, with training.mixed_precision for the compute"
        )
