"""A program ``acc-train launch`` runs unchanged: every ``accelerate.Accelerator`` it builds
(its own, or the one inside HF Trainer or TRL) runs the launched strategy, and a strategy that
cannot apply to what it builds is an error, never silence.

Accelerate builds its state and plugins from the launch variables
(:mod:`acc_train.launch.protocol`) as under ``accelerate launch``; this module only wraps
``Accelerator.__init__`` and ``prepare`` around that, so the strategy's ``after_accelerator``
(the CPU switch of :mod:`acc_train.accelerate_compat`, options no variable carries) and
``before_prepare`` run for those Accelerators too.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["LaunchedProgram", "adopt_accelerate", "is_plain"]


class LaunchedProgram:
    """What a program ``acc-train launch`` runs unchanged did with Accelerate, for the checks at
    its exit: how many Accelerators it built, and whether it joined a process group (its own
    ``init_process_group``, or Accelerate's ``PartialState``), which it may have left again."""

    def __init__(self) -> None:
        self.accelerators = 0
        self.process_group = False


def is_plain(expected: set[str]) -> bool:
    """Whether a strategy accepting the Accelerate types ``expected`` is plain data parallelism."""
    return any(t == "NO" or t.startswith("MULTI_") for t in expected)


def _refuse_contradicting_plugins(strategy: Any, expected: set[str], kwargs: dict[str, Any]) -> None:
    """A plugin argument through which the program asks for another installed strategy (one
    whose Accelerate types the launched one does not accept) is an error naming both."""
    from acc_train.errors import UserError
    from acc_train.plugins import strategies

    for other, _ in strategies().primary():
        protocol = other.launch_protocol()
        if set(other.accelerate_distributed_types) & expected or protocol is None:
            continue
        for key in protocol.accelerator_arguments:
            if kwargs.get(key) is not None:
                raise UserError(
                    f'the program builds Accelerator({key}=...), which asks Accelerate for strategy "{other.name}", but '
                    f'acc-train launch was asked for strategy "{strategy.name}"',
                    where=f"Accelerator({key}=...)",
                    hint=f"launch it with --strategy {other.name}, or drop {key} from the program",
                )


def adopt_accelerate(strategy: Any) -> LaunchedProgram:
    """Make every ``accelerate.Accelerator`` a program builds run ``strategy`` (bound to this
    process's machine), for a program that ``acc-train launch`` runs unchanged (installed before
    it starts).

    Accelerate builds its state and plugins from the launch variables as always; then the
    strategy's ``after_accelerator`` applies what no variable carries and, on CPU, switches the
    state to the strategy with the plugin built from those variables (where Accelerate would
    fall back to DDP). A plugin the program passes that asks for another strategy, a
    distributed type other than the strategy's, and (under a sharding strategy) a model the
    program wraps in torch's DistributedDataParallel itself are errors. ``acc_train.Accelerator``
    builds itself from the strategy and is left alone.
    """
    import accelerate
    import torch

    from acc_train.accelerate_compat import undo_switch_after_reset
    from acc_train.errors import UserError

    from acc_train.launch.protocol import launch_protocol_of

    program = LaunchedProgram()
    machine = strategy.machine
    cls = accelerate.Accelerator
    original_init, original_prepare, original_prepare_model = cls.__init__, cls.prepare, cls.prepare_model
    expected = strategy.expected_distributed_types()

    @functools.wraps(original_init)  # (libraries read Accelerator.__init__'s signature to see what it takes)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        from acc_train.accelerator import Accelerator as AccTrainAccelerator

        if isinstance(self, AccTrainAccelerator):
            original_init(self, *args, **kwargs)
            program.accelerators += 1
            return
        _refuse_contradicting_plugins(strategy, expected, kwargs)
        undo_switch_after_reset()
        original_init(self, *args, **kwargs)
        self.acc_strategy, self.acc_machine, self.acc_kwargs, self.acc_launched = strategy, machine, kwargs, True
        self._acc_prepared = set()
        strategy.after_accelerator(self)
        actual = self.distributed_type.name
        if actual not in expected:
            raise RuntimeError(
                f'strategy "{strategy.name}" expected Accelerate to run as {sorted(expected)} on {machine.world_size} '
                f"{machine.device_type} process(es), but the program's Accelerator chose {actual}; refusing to train "
                "under a strategy that was not asked for"
            )
        program.accelerators += 1

    def before_prepare(self: Any, objects: tuple[Any, ...]) -> None:
        if not getattr(self, "acc_launched", False):
            return
        for obj in objects:
            if isinstance(obj, torch.nn.Module) and id(obj) not in self._acc_prepared:
                self._acc_prepared.add(id(obj))
                strategy.before_prepare(self, obj)

    @functools.wraps(original_prepare)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        before_prepare(self, args)
        return original_prepare(self, *args, **kwargs)

    @functools.wraps(original_prepare_model)
    def prepare_model(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        before_prepare(self, (model,))
        return original_prepare_model(self, model, *args, **kwargs)

    cls.__init__, cls.prepare, cls.prepare_model = __init__, prepare, prepare_model  # type: ignore[method-assign]

    original_init_group = torch.distributed.init_process_group

    @functools.wraps(original_init_group)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        program.process_group = True
        return original_init_group(*args, **kwargs)

    torch.distributed.init_process_group = init_process_group
    launch_protocol_of(strategy).before_program()

    if not is_plain(expected):
        ddp = torch.nn.parallel.DistributedDataParallel
        original_ddp_init = ddp.__init__

        @functools.wraps(original_ddp_init)
        def ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
            raise UserError(
                f"the program wraps its model in torch.nn.parallel.DistributedDataParallel itself, so strategy "
                f'"{strategy.name}" would not apply to it (every rank would hold the whole model)',
                where="torch.nn.parallel.DistributedDataParallel",
                hint="let accelerator.prepare(model) wrap it, or launch with --strategy ddp",
            )

        ddp.__init__ = ddp_init  # type: ignore[method-assign]
    return program
