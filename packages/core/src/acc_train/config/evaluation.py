"""The ``eval`` section of the job config: what a run evaluates besides ``eval_loss``."""

from __future__ import annotations

from acc_train.config.harness import HarnessSettings

__all__ = ["EvalConfig"]


class EvalConfig(HarnessSettings):
    """Evaluations at every ``training.eval_every`` steps and after the last step: benchmark
    tasks through lm-evaluation-harness (``harness_*``)."""
