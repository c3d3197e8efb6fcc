"""The job config's schema: one pydantic model per section, strict at every level.

The sections live beside it (:mod:`~acc_train.config.model_data`, :mod:`~acc_train.config.training`,
:mod:`~acc_train.config.launch`, on :mod:`~acc_train.config.base`); this module assembles them into
:class:`JobConfig` and is where callers import them from. The ``strategy`` section is a plain
mapping here: its options belong to the strategy, whose own schema validates them when the job
is resolved (:mod:`acc_train.config.resolve`).
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import Field, model_validator

from acc_train.config.base import (
    DEFAULT_MAX_STEPS,
    DEMO_EVAL_FRACTION,
    FINE_TUNE_DEFAULTS,
    MAX_INT64,
    MAX_PROCESSES_PER_MACHINE,
    MAX_SEED,
    MAX_SEQ_LEN,
    MODEL_DTYPES,
    SCHEDULERS,
    Section,
)
from acc_train.config.evaluation import EvalConfig
from acc_train.config.launch import CheckpointConfig, LaunchConfig
from acc_train.config.model_data import DataConfig, LoraConfig, ModelConfig
from acc_train.config.training import OptimizerConfig, SchedulerConfig, TrainingConfig
from acc_train.strategy import DEFAULT_STRATEGY
from acc_train.outputs.trackers import TRACKER_MODULES, TrackerConfig

__all__ = [
    "JobConfig", "ModelConfig", "DataConfig", "OptimizerConfig", "SchedulerConfig", "TrainingConfig", "TrackerConfig",
    "CheckpointConfig", "EvalConfig", "LaunchConfig", "LoraConfig", "DEFAULT_MAX_STEPS", "TRACKER_MODULES", "SCHEDULERS", "MAX_INT64",
    "MAX_SEED", "MAX_PROCESSES_PER_MACHINE", "MAX_SEQ_LEN", "MODEL_DTYPES", "FINE_TUNE_DEFAULTS", "DEMO_EVAL_FRACTION",
]  # fmt: skip


class JobConfig(Section):
    output_dir: str = Field(
        "runs/demo",
        description="Where the run writes `config.yaml`, `metrics.jsonl`, `run.json`, `checkpoints/` and `final/`.",
    )
    resume: str | None = Field(None, description="`latest` (or `auto`: latest if any, else start fresh) or a checkpoint path.")
    overwrite: bool = Field(False, description="Replace a run already in `output_dir` (refused together with `resume`).")
    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="The model: the demo model, or a pretrained one to fine-tune.",
    )
    data: DataConfig = Field(
        default_factory=DataConfig,
        description="The training and eval data: files, what a row is, tokenization and caching.",
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="The optimizer and its hyperparameters.")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig,
        description="The learning-rate schedule (a transformers scheduler).",
    )
    training: TrainingConfig = Field(
        default_factory=TrainingConfig,
        description="Steps, batches, precision, evaluation, logging, trackers and compilation.",
    )
    eval: EvalConfig = Field(
        default_factory=EvalConfig,
        description=(
            "What each evaluation runs besides `eval_loss`: generation samples and their settings, lm-evaluation-harness "
            "tasks, and the evaluators plugins register (`NAME: {options}`)."
        ),
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="How often checkpoints are written and how many are kept.",
    )
    launch: LaunchConfig = Field(
        default_factory=LaunchConfig,
        description="How the workers start: processes, machines, rendezvous, restarts, signals.",
    )
    strategy: dict[str, Any] = Field(
        default_factory=lambda: {"name": DEFAULT_STRATEGY},
        description="`name` plus the options whose schema the strategy owns.",
    )

    @model_validator(mode="after")
    def _streaming_needs_steps(self) -> JobConfig:
        if self.data.streaming and self.training.epochs is not None:
            raise ValueError("data.streaming needs training.max_steps, not training.epochs (a stream's length is not known)")
        if self.data.streaming and not self.data.train_files:
            raise ValueError("data.streaming reads data.train_files (the demo corpus is made in memory); name them, or drop data.streaming")
        return self

    @model_validator(mode="after")
    def _job_defaults(self) -> JobConfig:
        """Unset keys whose default depends on the job: fine-tuning a pretrained model or the
        demo (:data:`FINE_TUNE_DEFAULTS`, ``data.eval_fraction``); ``mixed_precision: auto``
        under low-precision weights."""
        if self.model.name_or_path is not None:
            for (section, key), value in FINE_TUNE_DEFAULTS.items():
                part = getattr(self, section)
                if key not in part.model_fields_set and getattr(part, key) is not None:  # None: not this optimizer's
                    setattr(part, key, copy.deepcopy(value))
        if "eval_fraction" not in self.data.model_fields_set and not self.data.train_files:
            self.data.eval_fraction = DEMO_EVAL_FRACTION
        if self.model.dtype in ("bf16", "fp16"):
            _low_precision_compute(self)
        return self

    @property
    def max_steps(self) -> int | None:
        if self.training.max_steps is None and self.training.epochs is None:
            return DEFAULT_MAX_STEPS
        return self.training.max_steps


def _low_precision_compute(job: JobConfig) -> None:
    """Under ``model.dtype: bf16``/``fp16`` the weights themselves compute in that dtype:
    ``mixed_precision: auto`` means ``no``. An explicit bf16/fp16 mixed precision is refused:
    it would make the strategies hold fp32 masters after all (Accelerate upcasts sharded
    parameters under mixed precision), which is ``model.dtype: auto``'s job."""
    precision = job.training.mixed_precision
    if precision == "auto":
        job.training.mixed_precision = "no"
    elif precision != "no":
        raise ValueError(
            f"model.dtype: {job.model.dtype} trains the weights themselves in {job.model.dtype}; "
            f"training.mixed_precision: {precision} would keep fp32 master weights on some strategies. "
            f"Use model.dtype: auto with mixed_precision: {precision} (fp32 masters, {precision} compute), "
            f"or mixed_precision: no (or auto) with model.dtype: {job.model.dtype} (pure {job.model.dtype})"
        )
