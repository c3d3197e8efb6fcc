"""Core's own plugin: what every install has, registered through the ordinary hooks."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from acc_train.checkpoint import CheckpointFormat, DCPFormat
from acc_train.hookspecs import hookimpl

if TYPE_CHECKING:
    from acc_train.contracts.data_kind import DataKind
    from acc_train.contracts.evaluator import EvaluatorKind
    from acc_train.model.optimizer import OptimizerKind
    from acc_train.run import RunContext
    from acc_train.outputs.tracker_kinds import TrackerKind


@hookimpl
def acc_train_register_checkpoint_formats(register: Callable[[CheckpointFormat], None]) -> None:
    register(DCPFormat())


@hookimpl
def acc_train_register_data_kinds(register: Callable[[DataKind], None]) -> None:
    from acc_train.data.kinds import BUILTIN_KINDS

    for kind in BUILTIN_KINDS:
        register(kind)


@hookimpl
def acc_train_register_optimizers(register: Callable[[OptimizerKind], None]) -> None:
    from acc_train.model.optimizer import BUILTIN_OPTIMIZERS

    for optimizer in BUILTIN_OPTIMIZERS:
        register(optimizer)


@hookimpl
def acc_train_register_trackers(register: Callable[[TrackerKind], None]) -> None:
    from acc_train.outputs.tracker_kinds import builtin_tracker_kinds

    for kind in builtin_tracker_kinds():  # Accelerate's own trackers
        register(kind)


@hookimpl
def acc_train_register_evaluators(register: Callable[[EvaluatorKind], None]) -> None:
    from acc_train.loop.evaluators import builtin_evaluator_kinds

    for kind in builtin_evaluator_kinds():  # the eval loss, eval.samples, eval.harness_tasks
        register(kind)


#: what core itself runs on, reported in every checkpoint's manifest
CORE_LIBRARIES = ("acc-train-core", "torch", "accelerate", "transformers", "safetensors")


@hookimpl
def acc_train_library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in CORE_LIBRARIES:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


@hookimpl
def acc_train_train_end(run: RunContext, summary: dict[str, Any]) -> None:
    """Draw the run's report.png once run.json is written (main process). A failure to draw
    is a warning: the run itself has succeeded."""
    if not run.is_main_process:
        return
    from acc_train.outputs.plot import write_report

    try:
        write_report(run.output_dir)
    except Exception as exc:  # noqa: BLE001 - reporting never fails a finished run
        sys.stderr.write(f"warning: could not draw {run.output_dir / 'report.png'}: {type(exc).__name__}: {exc}\n")
