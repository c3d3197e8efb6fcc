"""``optimizer.name`` -> the registered optimizer, and whether it can run under the job's
strategy and checkpoint format (checked before launch and in each worker)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from acc_train.errors import UserError
from acc_train.model.optimizer import OptimizerKind

if TYPE_CHECKING:
    from acc_train.contracts.protocols import JobView, MachineView, Section

__all__ = ["optimizer_kind", "registered_name", "fit_to_optimizer", "check_optimizer", "optimizer_summary"]


def optimizer_kind(name: str) -> OptimizerKind:
    """The optimizer registered as ``name`` (core's and plugins'); an unknown name is an error
    naming the installed ones and the closest."""
    from acc_train.plugins import optimizers

    return optimizers().lookup(name, "optimizer.name")


def registered_name(name: str) -> str:
    """``optimizer.name``, once it names a registered optimizer (a ValueError for pydantic,
    which adds the key and its origin)."""
    try:
        optimizer_kind(name)
    except UserError as exc:
        raise ValueError(f"{exc.message}; {exc.hint}" if exc.hint else exc.message) from None
    return name


def fit_to_optimizer(cfg: Section) -> None:
    """Give the shared keys the chosen optimizer takes its defaults where unset (leaving them
    out of ``model_fields_set``, so fine-tuning defaults still apply), refuse those it does not
    take, and validate ``optimizer.options`` by its schema, filling in its defaults:
    ValueErrors naming the key."""
    from pydantic import ValidationError

    from acc_train.config.problems import problem_lines
    from acc_train.config.sources import Sources
    from acc_train.model.optimizer import COMMON_KEYS

    kind = optimizer_kind(cfg.name)
    for key in COMMON_KEYS:
        value = getattr(cfg, key)
        if key in kind.defaults:
            if value is None:
                cfg.__dict__[key] = copy.deepcopy(kind.defaults[key])
        elif value is not None:
            takes = ", ".join(["lr", "weight_decay", *kind.defaults, "options"])
            raise ValueError(f"optimizer.{key} does not apply to optimizer {cfg.name!r} (it takes {takes}); remove it")
    if cfg.options and not kind.options_schema.model_fields:
        raise ValueError(f"optimizer {cfg.name!r} takes no optimizer.options (got {', '.join(map(str, cfg.options))}); remove them")
    try:
        parsed = kind.options_schema.model_validate(cfg.options)
    except ValidationError as exc:
        lines = problem_lines(exc, kind.options_schema, Sources(), prefix="optimizer.options.")
        raise ValueError(f"optimizer {cfg.name!r}: " + "; ".join(lines)) from None
    cfg.__dict__["options"] = parsed.model_dump(mode="json")  # the resolved config shows every option
    problem = kind.problem(cfg)
    if problem:
        raise ValueError(problem)


def check_optimizer(job: JobView, machine: MachineView) -> OptimizerKind:
    """The job's optimizer, once it is known to run on ``machine`` under the job's strategy and
    to fit the strategy's checkpoint format; else a :class:`UserError` naming the optimizer,
    the strategy and what to change. Never a silent wrong resume."""
    from acc_train.plugins import checkpoint_formats

    cfg = job.config.optimizer
    kind = optimizer_kind(cfg.name)
    kind.check(cfg, machine)
    strategy = job.strategy
    label = f"strategy {job.config.strategy['name']!r}"
    if not kind.elementwise_state and strategy.planner().parameter_shards(machine) > 1:
        raise UserError(
            f"optimizer {kind.name!r} keeps state not shaped like its parameters (factored or quantized), which "
            f"cannot be sharded with them: {label} shards the parameters across the {machine.world_size} ranks",
            where="optimizer.name",
            hint="use it under a strategy where every rank holds the parameters whole (ddp), or choose adamw or sgd",
        )
    fmt = checkpoint_formats().get(strategy.checkpoint_format_name())
    carried = getattr(fmt, "optimizer_state_keys", None)
    if carried is not None and not set(kind.state_keys) <= set(carried):
        missing = ", ".join(sorted(set(kind.state_keys) - set(carried)))
        raise UserError(
            f"optimizer {kind.name!r} keeps {missing}, which the {fmt.name!r} checkpoint format of {label} does not "
            f"save (it carries {', '.join(carried)}): a resume would lose that state",
            where="optimizer.name",
            hint=f"under this strategy use an optimizer whose state it carries ({_fitting(carried)}), or another strategy",
        )
    return kind


def _fitting(carried: tuple[str, ...]) -> str:
    from acc_train.plugins import optimizers

    names = [k.name for k, _ in optimizers().primary() if set(k.state_keys) <= set(carried)]
    return ", ".join(names) or "none installed"


def optimizer_summary(job: JobView, optimizer: Any) -> dict[str, Any]:
    """What ``run.json`` records of the run's optimizer: its name and what the optimizer
    itself reports of the built one (adamw: ``implementation``, fused or foreach)."""
    from acc_train.checkpoint.portable import torch_optimizer

    kind = optimizer_kind(job.config.optimizer.name)
    return {"name": kind.name, **kind.describe(torch_optimizer(optimizer))}
