"""A run's context, handed to lifecycle hooks, and core's reporter of a run's progress.

The reporter (``metrics.jsonl``, Accelerate trackers, the progress bar) is itself a plugin
implementing the lifecycle hooks; the loop only fires hooks.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.hookspecs import hookimpl
from acc_train.outputs.metrics import METRICS_FILE, MetricsRow, parse_line
from acc_train.files.output_paths import replace_file
from acc_train.plugins import register_temporarily
from acc_train.outputs.trackers import plan_trackers, record_runs, start_trackers, started_runs, store_config

if TYPE_CHECKING:
    from accelerate import Accelerator

    from acc_train.config import ResolvedJob
    from acc_train.memory.state import ModelStateMeter
    from acc_train.outputs.tracker_kinds import TrackerKind

__all__ = ["RunContext", "RunReporter", "reporting"]


@dataclass
class RunContext:
    """One rank's run, as lifecycle hooks see it."""

    job: ResolvedJob
    accelerator: Accelerator
    output_dir: Path
    max_steps: int
    #: the last optimizer step taken (the step a resumed run starts from, at ``train_start``)
    step: int = 0
    #: the prepared (strategy-wrapped) model and optimizer
    model: Any = None
    optimizer: Any = None
    #: the learning-rate scheduler and where training stands (``acc_train.checkpoint.TrainerState``:
    #: step, epoch, data position), which the loop advances
    scheduler: Any = None
    state: Any = None
    #: counts the model state this rank holds (the strategy's, or None where it has none)
    model_state_meter: ModelStateMeter | None = None
    #: per-run state of plugins, by a key of their own; core keeps nothing here
    extras: dict[str, Any] = field(default_factory=dict)
    #: the tracker runs this launch logs to (project, run name, ids: run.json's ``trackers``),
    #: on the main process once they started; None without trackers
    trackers: dict[str, Any] | None = None
    #: what MFU is computed against (:func:`acc_train.outputs.mfu.run_basis`): FLOPs per token, the
    #: devices' peak; None before the model is built, ``{"error": ...}`` where there is no figure
    mfu_basis: dict[str, Any] | None = None

    @property
    def config(self) -> Any:
        return self.job.config

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process


class RunReporter:
    """Writes ``metrics.jsonl``, logs to trackers and draws the progress bar (main process)."""

    def __init__(self, metrics_path: Path, resumed_step: int) -> None:
        self.metrics_path = metrics_path
        self.resumed_step = resumed_step
        self._file: Any = None
        self._bar: Any = None
        self._streams: tuple[Any, Any] | None = None
        self._logging: Any = None

    @hookimpl
    def acc_train_train_start(self, run: RunContext) -> None:
        if not run.is_main_process:
            return
        keep = []  # (train_start comes after every check that can refuse the run: trainer.claim_output_dir)
        if self.resumed_step and self.metrics_path.is_file():  # drop steps the resumed run will redo
            # (a line cut short by a crash, or not text, counts as unlogged)
            text = self.metrics_path.read_text(errors="replace")
            keep = [ln for ln in text.splitlines() if (row := parse_line(ln)) is not None and row.step <= self.resumed_step]
        # a new file renamed into place, then appended to: a hard-linked copy of the run (cp -al)
        # keeps its own metrics.jsonl when this one resumes
        replace_file(self.metrics_path, "".join(ln + "\n" for ln in keep).encode())
        self._file = open(self.metrics_path, "a", buffering=1)
        if run.config.training.progress_bar:
            from tqdm.auto import tqdm
            from tqdm.contrib import DummyTqdmFile

            # what anything else prints while the bar is drawn (a plugin's warning, a library's
            # message) goes on lines of its own above the bar, as tqdm.write puts them, not glued
            # onto the bar's line; logging's handlers keep the stream they were made with
            self._streams = (sys.stdout, sys.stderr)
            self._bar = tqdm(total=run.max_steps, initial=run.step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
            sys.stdout, sys.stderr = DummyTqdmFile(sys.stdout), DummyTqdmFile(sys.stderr)
            self._logging = _logging_above(self._bar)

    def _write(self, run: RunContext, step: int, row: MetricsRow) -> None:
        line = row.to_dict()
        self._file.write(json.dumps(line) + "\n")
        if run.config.training.report_to:
            run.accelerator.log(row.numbers(), step=step)

    @hookimpl
    def acc_train_log(self, run: RunContext, step: int, metrics: dict[str, Any]) -> None:
        if not run.is_main_process:
            return
        row = MetricsRow.from_dict(metrics)
        self._write(run, step, row)
        if self._bar is not None:  # the last values read; the bar itself advances every step
            shown = {"loss": f"{row.loss:.4f}", "lr": f"{row.lr or 0:.2e}", "tok_s": f"{row.tokens_per_s or 0:.0f}"}
            if row.mfu is not None:
                shown["mfu"] = f"{row.mfu:.1%}"
            self._bar.set_postfix(shown, refresh=False)

    @hookimpl
    def acc_train_step_end(self, run: RunContext, step: int, metrics: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.update(1)

    @hookimpl
    def acc_train_eval_end(self, run: RunContext, step: int, metrics: dict[str, Any]) -> None:
        if run.is_main_process:
            row = MetricsRow.from_dict(metrics)
            self._write(run, step, row)
            if self._bar is not None and row.numbers():
                self._bar.write(f"step {step}: " + "; ".join(f"{name} {value:.4f}" for name, value in row.numbers().items()))

    @hookimpl
    def acc_train_train_end(self, run: RunContext, summary: dict[str, Any]) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            if self._streams is not None:
                redirected = (sys.stdout, sys.stderr)
                sys.stdout, sys.stderr = self._streams
                for wrapper, stream in zip(redirected, self._streams):
                    held = getattr(wrapper, "_buf", None)  # a last line without its newline
                    if held and any(held):
                        stream.write(type(held[0])().join(held))
                        wrapper._buf = []
                self._streams = None
            if self._logging is not None:
                self._logging.__exit__(None, None, None)
                self._logging = None
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _logging_above(bar: Any) -> Any:
    """tqdm's redirection of the root logger's console handlers (entered; exited with the bar)."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    redirect = logging_redirect_tqdm(tqdm_class=type(bar))
    redirect.__enter__()
    return redirect


@contextmanager
def reporting(run: RunContext) -> Iterator[RunReporter]:
    """Core's reporter registered for the run (and Accelerate's trackers started) while it lasts."""
    reporter = RunReporter(run.output_dir / METRICS_FILE, run.step)
    unregister = register_temporarily(reporter, f"reporter-{id(reporter)}")
    trackers = bool(run.config.training.report_to)
    try:
        if trackers and run.is_main_process:
            _start_trackers(run)
        yield reporter
        if trackers:
            run.accelerator.end_training()
    finally:
        reporter.close()
        unregister()


def _start_trackers(run: RunContext) -> None:
    """Start the job's trackers (main process), continuing the tracker runs an earlier launch of
    this run started (:mod:`acc_train.outputs.trackers`), and record which runs they log to."""
    kinds = job_trackers(run.config.training.report_to)
    plan = plan_trackers(run.config.training.tracker, run.output_dir, run.step, kinds)
    start_trackers(run.accelerator, plan, run.output_dir, [k for k in kinds.values() if not k.accelerate_builtin])
    run.trackers = record_runs(run.output_dir, plan, started_runs(run.accelerator, run.output_dir, kinds))
    store_config(run.accelerator, _flat(run.job.to_dict()), plan)


def job_trackers(report_to: list[str]) -> dict[str, TrackerKind]:
    """The registered trackers ``training.report_to`` names, by name (``all``: every installed one)."""
    from acc_train.plugins import trackers

    registry = trackers()
    if "all" in report_to:
        return {kind.name: kind for kind, _ in registry.primary() if kind.installed()}
    return {name: registry.get(name) for name in report_to}


def accelerate_log_with(report_to: list[str]) -> list[str] | None:
    """What Accelerate's ``log_with`` gets: its own trackers, by name (a plugin's are made and
    started with them, :func:`acc_train.outputs.trackers.start_trackers`)."""
    names = [name for name, kind in job_trackers(report_to).items() if kind.accelerate_builtin]
    return names or None


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as trackers take it: ``{"training.lr": ...}``, values as scalars."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float, str, bool)):
            out[f"{prefix}{k}"] = v
        else:
            out[f"{prefix}{k}"] = str(v)
    return out
