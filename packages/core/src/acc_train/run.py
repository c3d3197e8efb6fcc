"""A run's context, handed to lifecycle hooks, and core's reporter of a run's progress.

The reporter (``metrics.jsonl``, Accelerate trackers, the progress bar) is itself a plugin
implementing the lifecycle hooks; the loop only fires hooks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.hookspecs import hookimpl

if TYPE_CHECKING:
    from accelerate import Accelerator

    from acc_train.config import ResolvedJob

__all__ = ["RunContext", "RunReporter"]


@dataclass
class RunContext:
    job: ResolvedJob
    accelerator: Accelerator
    output_dir: Path
    max_steps: int
    step: int = 0
    model: Any = None
    optimizer: Any = None
    extras: dict[str, Any] = field(default_factory=dict)

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

    @hookimpl
    def acc_train_train_start(self, run: RunContext) -> None:
        if not run.is_main_process:
            return
        keep = []
        if self.resumed_step and self.metrics_path.is_file():  # drop steps the resumed run will redo
            keep = [ln for ln in self.metrics_path.read_text().splitlines() if _step_of(ln) <= self.resumed_step]
        self.metrics_path.write_text("".join(ln + "\n" for ln in keep))
        self._file = open(self.metrics_path, "a", buffering=1)
        if run.config.training.progress_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=run.max_steps, initial=run.step, desc="train", unit="step", dynamic_ncols=True)

    def _write(self, run: RunContext, step: int, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        if run.config.training.report_to:
            run.accelerator.log(numeric, step=step)

    @hookimpl
    def acc_train_step_end(self, run: RunContext, step: int, metrics: dict[str, Any]) -> None:
        if not run.is_main_process:
            return
        if "loss" in metrics:
            self._write(run, step, metrics)
            if self._bar is not None:
                self._bar.set_postfix(
                    loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}", tok_s=f"{metrics.get('tokens_per_s', 0):.0f}", refresh=False
                )
        if self._bar is not None:
            self._bar.update(1)

    @hookimpl
    def acc_train_eval_end(self, run: RunContext, step: int, metrics: dict[str, Any]) -> None:
        if run.is_main_process:
            self._write(run, step, metrics)
            if self._bar is not None:
                self._bar.write(f"step {step}: eval_loss {metrics['eval_loss']:.4f}")

    @hookimpl
    def acc_train_train_end(self, run: RunContext, summary: dict[str, Any]) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _step_of(line: str) -> float:
    """The step a metrics line belongs to; a line cut short by a crash counts as unlogged."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
