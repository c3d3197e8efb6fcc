"""The replica groups a strategy hands out (:meth:`acc_train.Strategy.replica_groups`): several
launches, each its own process group, that train one model together and go on when one of them is
lost (a fault-tolerant strategy's groups). Setup splits each global batch between them, and the
loop asks them at every step::

    class MyGroups(ReplicaGroups):
        def data_part(self):
            return (self.strategy.options.group, self.strategy.options.groups)

    class MyStrategy(Strategy[MyOptions]):
        replica_groups = MyGroups
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from acc_train.contracts.protocols import RunView

__all__ = ["ReplicaGroups", "data_part", "replica_groups_of"]


class ReplicaGroups(ABC):
    """What the loop and setup ask of a strategy whose replica groups are separate launches."""

    #: A launch into an output directory holding a run continues it instead of being refused: from
    #: its latest checkpoint (``--resume auto``), or in its place without one (a relaunched group
    #: rejoins a run that went on without it, and the strategy brings it up to its peers).
    rejoins_run: ClassVar[bool] = True

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @abstractmethod
    def data_part(self) -> tuple[int, int]:
        """(index, count): each global batch is split in ``count`` parts and this launch reads part
        ``index``; positions, checkpoints and the data order count all parts."""

    def step_start(self, run: RunView) -> None:
        """Called on every rank before the first forward of each optimizer step. It may replace the
        run's state in place (model, optimizer, ``run.scheduler``, ``run.state``: a group that
        rejoins takes a live peer's); the loop then reads the data from ``run.state``'s position."""

    def commit_step(self, run: RunView) -> bool:
        """Called on every rank once a step's gradients are complete (after clipping), before the
        optimizer steps. False discards the step: neither the optimizer nor the scheduler steps,
        the step is not counted and its batches are trained again. Default: True."""
        return True


def replica_groups_of(strategy: Any) -> ReplicaGroups | None:
    """The configured strategy's replica groups, or None where one launch trains the model."""
    kind = getattr(strategy, "replica_groups", None)
    return kind(strategy) if kind is not None else None


def data_part(strategy: Any) -> tuple[int, int]:
    """(index, count) of the strategy's replica groups' data split; (0, 1) for one launch."""
    groups = replica_groups_of(strategy)
    return groups.data_part() if groups is not None else (0, 1)
