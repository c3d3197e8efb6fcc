"""Every hook acc-train calls, in one place.

Plugins implement these with ``@acc_train.hookimpl``. Registration hooks hand the plugin a
``register`` callback; lifecycle hooks let a plugin observe a run without touching the loop.
Lifecycle hooks are called on every rank; check ``run.is_main_process`` to act once.
``docs/hooks.md`` shows each hook with an example (a test keeps its signatures equal to these).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from acc_train.checkpoint import CheckpointFormat
    from acc_train.contracts.data_kind import DataKind
    from acc_train.contracts.evaluator import EvaluatorKind
    from acc_train.model.optimizer import OptimizerKind
    from acc_train.contracts.questions import Question
    # hooks are handed an acc_train.run.RunContext; typed by its protocol, as run.py sits above this module
    from acc_train.contracts.protocols import RunView as RunContext
    from acc_train.strategy import Strategy, WrapPolicy
    from acc_train.outputs.tracker_kinds import TrackerKind

__all__ = ["hookspec", "hookimpl", "PROJECT_NAME"]

PROJECT_NAME = "acc_train"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -------------------------------------------------------------------------
# Registration hooks: called once, when the plugin manager first loads.
# -------------------------------------------------------------------------


@hookspec
def acc_train_register_strategies(register: Callable[[Strategy], None]) -> None:
    """Register strategies this plugin provides.

    Called once, the first time any strategy is looked up or listed. Call
    ``register(strategy)`` once per :class:`acc_train.Strategy` instance. Its name, aliases and
    preset names must not clash with another plugin's; a clash is an error naming both plugins.
    The return value is ignored.

    :param register: callback taking a ``Strategy`` instance.
    """


@hookspec
def acc_train_register_wrap_policies(register: Callable[[WrapPolicy], None]) -> None:
    """Register wrap policies (how a sharding strategy splits a model into units).

    Called once, the first time a wrap policy is looked up or listed. Call
    ``register(policy)`` once per :class:`acc_train.WrapPolicy` instance. The return value is
    ignored.

    :param register: callback taking a ``WrapPolicy`` instance.
    """


@hookspec
def acc_train_register_checkpoint_formats(register: Callable[[CheckpointFormat], None]) -> None:
    """Register checkpoint formats (how model and optimizer state are written and read).

    Called once, the first time a checkpoint format is looked up or listed. Call
    ``register(fmt)`` once per :class:`acc_train.checkpoint.CheckpointFormat` instance. The
    return value is ignored.

    :param register: callback taking a ``CheckpointFormat`` instance.
    """


@hookspec
def acc_train_register_data_kinds(register: Callable[[DataKind], None]) -> None:
    """Register kinds of training example (``data.kind``): how a row of a data file becomes
    tokens, and which of them count in the loss.

    Called once, the first time a data kind is looked up or listed. Call ``register(kind)``
    once per :class:`acc_train.api.DataKind` instance. The return value is ignored.

    :param register: callback taking a ``DataKind`` instance.
    """


@hookspec
def acc_train_register_optimizers(register: Callable[[OptimizerKind], None]) -> None:
    """Register optimizers (``optimizer.name``): their options, what they need to run, their
    state, and how they are built over the model's parameter groups.

    Called once, the first time an optimizer is looked up or listed (when a config is
    validated). Call ``register(optimizer)`` once per :class:`acc_train.api.OptimizerKind`
    instance. The return value is ignored.

    :param register: callback taking an ``OptimizerKind`` instance.
    """


@hookspec
def acc_train_register_trackers(register: Callable[[TrackerKind], None]) -> None:
    """Register trackers ``training.report_to`` can name (Accelerate's own are registered by
    core's plugin the same way).

    Called once, the first time a tracker is looked up or listed (when a config names one).
    Call ``register(kind)`` once per :class:`acc_train.api.TrackerKind`: its ``name`` (the
    tracker's ``GeneralTracker.name``), its ``tracker`` (an ``accelerate.tracking.GeneralTracker``
    subclass, or ``"module:Class"`` imported only when a run starts it), the modules it needs,
    and, by overriding ``continue_run``/``identify``, how a resumed launch logs to the same
    tracker run. The tracker gets every row of ``metrics.jsonl`` (``log``) and the job's config
    (``store_init_configuration``); the run's summary reaches the plugin's
    :func:`acc_train_train_end`. The return value is ignored.

    :param register: callback taking a ``TrackerKind`` instance.
    """


@hookspec
def acc_train_register_commands(register: Callable[[Any], None]) -> None:
    """Register subcommands of the ``acc-train`` command: call ``register(command)`` with a
    ``click.Command`` (its name is the subcommand's, e.g. a fault-tolerant strategy's
    ``acc-train lighthouse``). Called when the command line names a subcommand that is not a
    built-in one (``acc-train --help`` lists the built-in ones only: it imports nothing of core).
    A plugin's command never replaces a built-in one (a warning names the plugin); a name two
    plugins register belongs to neither, as with every registration. Must not import torch, accelerate or deepspeed (import them inside the command).
    The return value is ignored.

    :param register: call once per command.
    """


@hookspec
def acc_train_register_evaluators(register: Callable[[EvaluatorKind], None]) -> None:
    """Register evaluators a job can ask for as ``eval.NAME`` (core's eval loss, ``eval.samples``
    and ``eval.harness_tasks`` are registered by core's plugin the same way).

    Called once, the first time an evaluator is looked up or listed (when a config has a key
    under ``eval`` that is not one of its settings, and when a run starts). Call
    ``register(kind)`` once per :class:`acc_train.api.EvaluatorKind`: its ``name`` (the key
    under ``eval``), its ``evaluate`` function (or ``"module:function"``, imported only when a
    run starts it), and its ``options_schema`` (a pydantic model of ``eval.NAME``). At each
    evaluation, on every rank, ``evaluate`` gets an :class:`acc_train.api.EvalContext` (the
    model, the run, the step, its options) and returns named metrics, which go to
    ``metrics.jsonl``, the trackers, ``run.json``'s ``evaluations``, ``acc-train report`` and
    the model card. The return value is ignored.

    :param register: callback taking an ``EvaluatorKind`` instance.
    """


@hookspec(firstresult=True)
def acc_train_accelerate_config(distributed_type: str, config: dict[str, Any]) -> dict[str, Any] | None:
    """Map a config file written by ``accelerate config`` onto this plugin's strategy.

    Called when ``acc-train --config FILE`` reads a file with a top-level ``distributed_type``
    (a strategy declares the types that select it in ``accelerate_distributed_types``; with no
    answer, that strategy runs with its defaults). Return acc-train config sections built from
    the file's own section (one the strategy lists in ``accelerate_config_sections``): at least
    ``{"strategy": {"name": ..., **options}}``, plus e.g. ``training`` keys the section carries;
    or None when the type is not this plugin's. Stops at the first non-None result. Raise
    :class:`acc_train.UserError` for a value that cannot be mapped.

    :param distributed_type: the file's ``distributed_type``.
    :param config: the whole file, as read.
    """


@hookspec(firstresult=True)
def acc_train_config_questions(strategy_name: str) -> list[Question] | None:
    """The questions ``acc-train config`` asks about this plugin's strategy.

    Called by the wizard after the user picks a strategy (or one of its presets), with the
    strategy's own name (not the preset's). Return :class:`acc_train.Question` objects, keyed
    inside the ``strategy:`` section, in the order to ask them; an empty list asks nothing; None
    when the strategy is not this plugin's. Stops at the first non-None result. Each answer is
    validated through the strategy's options schema, and a preset's options replace the
    questions' defaults. Must not import torch, accelerate or deepspeed.

    :param strategy_name: the chosen strategy's registered name.
    """


# -------------------------------------------------------------------------
# Lifecycle hooks: called on every rank while a job trains.
# -------------------------------------------------------------------------


@hookspec
def acc_train_train_start(run: RunContext) -> None:
    """Called once per rank after model, optimizer and data are prepared and any checkpoint
    has been restored, just before the first step. ``run.step`` is the step training resumes
    from (0 for a fresh run). The return value is ignored.

    :param run: the run's context: config, accelerator, output directory, step.
    """


@hookspec
def acc_train_step_end(run: RunContext, step: int, metrics: dict[str, Any]) -> None:
    """Called on every rank right after each optimizer step, before any evaluation or save
    of that step.

    ``metrics`` holds what the host knows without waiting for the accelerator: ``step``,
    ``epoch`` and ``lr``. The step's loss and gradient norm are read later, with other steps'
    (``training.read_every``), and handed to :func:`acc_train_log`. A plugin may add keys to
    ``metrics``: they go into the step's row of ``metrics.jsonl`` (on a logged step) when it is
    written. The return value is ignored.

    :param run: the run's context.
    :param step: the optimizer step just completed, counted from 1.
    :param metrics: ``{"step": ..., "epoch": ..., "lr": ...}``.
    """


@hookspec
def acc_train_log(run: RunContext, step: int, metrics: dict[str, Any]) -> None:
    """Called on every rank once per logged step (every ``training.log_every`` steps, and the
    last), in step order, when the loop reads the steps' values back from the accelerator:
    every ``training.read_every`` steps, at the first step, before an evaluation, a checkpoint, a stop and the end
    (and, after a failure, for the steps it can still read without a collective). So it comes up
    to ``read_every`` steps after :func:`acc_train_step_end` of the same step.

    ``metrics`` holds ``step``, ``epoch``, ``loss`` (the step's per-token mean over ranks and
    accumulation), ``lr``, ``grad_norm`` (None on a step where it was not measured: with
    clipping off it is measured only on the steps the loop reads at), ``tokens`` (seen so far,
    all ranks), ``tokens_per_s``, ``elapsed_s`` and, where the devices' peak is known, ``mfu``.
    It is the dict written to ``metrics.jsonl``; a plugin may add keys to it. The return value
    is ignored.

    :param run: the run's context.
    :param step: the optimizer step the row is for, counted from 1.
    :param metrics: the step's row.
    """


@hookspec
def acc_train_eval_end(run: RunContext, step: int, metrics: dict[str, Any]) -> None:
    """Called on every rank after each evaluator of a periodic evaluation returned metrics
    (once per evaluator: :func:`acc_train_register_evaluators`); ``metrics`` is the row written
    to ``metrics.jsonl``: ``step`` and the evaluator's metrics: ``eval_loss`` for the eval loss,
    ``harness`` (``{task: {metric: value}}``, lm-evaluation-harness's scores) after
    ``eval.harness_tasks``, a plugin's evaluator its own. The return value is ignored.

    :param run: the run's context.
    :param step: the optimizer step after which evaluation ran.
    :param metrics: ``{"step": ..., "eval_loss": ...}``, ``{"step": ..., "harness": ...}``, ...
    """


@hookspec
def acc_train_checkpoint_saved(run: RunContext, step: int, path: str) -> None:
    """Called on every rank after a checkpoint is complete (its manifest written and the
    ``latest`` pointer moved to it). The return value is ignored.

    :param run: the run's context.
    :param step: the step the checkpoint holds.
    :param path: the committed checkpoint directory.
    """


@hookspec
def acc_train_train_end(run: RunContext, summary: dict[str, Any]) -> None:
    """Called on every rank after the last step and the final model have been written.
    ``summary`` is the content of ``run.json`` (on rank 0; other ranks get the same keys).
    The return value is ignored.

    :param run: the run's context.
    :param summary: the run summary.
    """


# -------------------------------------------------------------------------
# Report hooks: called when core records what a run ran with.
# -------------------------------------------------------------------------


@hookspec
def acc_train_library_versions() -> dict[str, str]:
    """Report the versions of the libraries this plugin depends on, for checkpoint manifests.

    Called on the main process each time a checkpoint is committed. Return a mapping of
    distribution name to installed version (``{"deepspeed": "0.19.8"}``), leaving out the
    libraries that are not installed. Every plugin's answer goes into the manifest's
    ``versions``, core's first; a later plugin does not replace a version already reported.
    Must be cheap: read ``importlib.metadata``, do not import the libraries.
    """
