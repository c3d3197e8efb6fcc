"""The launch protocol a strategy hands out (:meth:`acc_train.Strategy.launch_protocol`): how
``acc-train launch`` runs a user's own program (an Accelerate script, HF Trainer, TRL) unchanged
under the strategy. Core's side of the protocol (the variables every launch sets, the shell's
leftovers) is :mod:`acc_train.launch.protocol`.

A strategy that is one of Accelerate's own types maps its options to Accelerate's variables::

    class MyLaunch(LaunchProtocol["MyStrategy"]):
        launch_variables = ("ACCELERATE_USE_MINE", "MINE_")

        def launch_env(self, scratch):
            return {"ACCELERATE_USE_MINE": "true", ...self.strategy.options...}

    class MyStrategy(Strategy[MyOptions]):
        def launch_protocol(self):
            return MyLaunch(self)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

__all__ = ["LaunchProtocol"]

#: the configured ``acc_train.Strategy`` the protocol launches (typed loosely: this layer is below it)
StrategyT = TypeVar("StrategyT")


class LaunchProtocol(Generic[StrategyT]):
    """``acc-train launch``'s side of ``strategy``: configured, and bound to the launch's machine
    (``self.strategy.machine``) when :meth:`launch_env` and :meth:`before_program` are called.
    The default suits a plain data-parallel strategy, which needs no variable."""

    #: The ``accelerate launch`` variables :meth:`launch_env` speaks for: names, or prefixes
    #: ending in ``_`` (``FSDP_``). Those left in the user's shell give way when a program is
    #: launched under any strategy (with a warning), so a stale one never changes it.
    launch_variables: ClassVar[tuple[str, ...]] = ()
    #: ``Accelerator`` arguments through which a program asks Accelerate for this strategy
    #: (``fsdp_plugin``): a launched program passing one under another strategy is refused.
    accelerator_arguments: ClassVar[tuple[str, ...]] = ()

    def __init__(self, strategy: StrategyT) -> None:
        self.strategy = strategy

    def launch_env(self, scratch: Path) -> dict[str, str]:
        """The variables ``accelerate launch`` gives its workers for the strategy with its options
        (``ACCELERATE_USE_FSDP``, ``FSDP_*``, ``ACCELERATE_DEEPSPEED_*``...) on its machine, for a
        program ``acc-train launch`` runs unchanged: Accelerate, HF Trainer and TRL build their
        plugins from them. ``scratch`` is a private directory that lives as long as the launch,
        for a file a variable names (a DeepSpeed JSON). Raise :class:`acc_train.UserError` naming
        an option that no variable carries and that ``Strategy.after_accelerator`` does not apply
        either.

        The default calls ``Strategy.accelerator_kwargs`` with no job, so a strategy that refuses
        to run a user's program says so before launch, and needs no variable."""
        strategy: Any = self.strategy
        strategy.accelerator_kwargs(None)
        return {}

    def before_program(self) -> None:
        """Called in each worker of ``acc-train launch`` just before the user's program starts
        (after Accelerate's own classes are adopted): where a strategy refuses, with an error a
        person can act on, what a program may build that cannot run under it (e.g. a plugin
        written for another version of the strategy, which would fail inside Accelerate)."""
