"""What the lower layers are handed, as protocols: a job, its config, a run, a machine.

Strategies, checkpoint formats, data kinds, optimizers, hooks and the model builders are handed
objects that the upper layers make (``acc_train.config.ResolvedJob``, ``acc_train.run.RunContext``,
``acc_train.strategy.Machine``). They are typed against these protocols instead, so no module
names a layer above it, not even for annotations: the import-linter contracts count
``TYPE_CHECKING`` imports too. The classes that implement them are checked against them in
``tests/layout/test_house_plan.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["JobConfigView", "JobView", "MachineView", "RunView", "Section"]

#: one validated section of the job config (``acc_train.config.schema``: ``ModelConfig``,
#: ``DataConfig``, ``OptimizerConfig``, ...): a frozen pydantic model, read by attribute
Section = Any


@runtime_checkable
class JobConfigView(Protocol):
    """The validated job config (``acc_train.config.JobConfig``), section by section."""

    output_dir: str
    model: Section
    data: Section
    optimizer: Section
    scheduler: Section
    training: Section
    eval: Section
    launch: Section
    strategy: dict[str, Any]


@runtime_checkable
class JobView(Protocol):
    """A resolved job (``acc_train.config.ResolvedJob``): the config and its configured strategy."""

    config: Any  # a JobConfigView
    strategy: Any  # the configured acc_train.strategy.Strategy

    @property
    def strategy_name(self) -> str: ...


@runtime_checkable
class RunView(Protocol):
    """One rank's run (``acc_train.run.RunContext``), as hooks, strategies and checkpoints see it."""

    job: Any  # a JobView
    accelerator: Any
    output_dir: Path
    max_steps: int
    step: int
    model: Any
    optimizer: Any
    extras: dict[str, Any]

    @property
    def config(self) -> Any: ...

    @property
    def is_main_process(self) -> bool: ...


@runtime_checkable
class MachineView(Protocol):
    """What a run's machine is (``acc_train.strategy.Machine``): device type, ranks, machines."""

    device_type: str
    world_size: int
    num_machines: int
