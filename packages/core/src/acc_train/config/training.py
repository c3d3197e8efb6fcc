"""The ``optimizer``, ``scheduler`` and ``training`` sections of the job config."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from acc_train.config.base import (
    MAX_SEED,
    SCHEDULERS,
    Beta,
    Count,
    NonEmptyStr,
    NonNegativeCount,
    NonNegativeFloat,
    PositiveFloat,
    Section,
)
from acc_train.config.compile import CompileConfig
from acc_train.errors import UserError
from acc_train.outputs.trackers import TrackerConfig, owned_key_error

if TYPE_CHECKING:
    from acc_train.outputs.tracker_kinds import TrackerKind

__all__ = ["OptimizerConfig", "SchedulerConfig", "TrainingConfig"]



def tracker_kind(name: str, where: str) -> TrackerKind:
    """The tracker registered as ``name`` (Accelerate's, registered by core, or a plugin's): an
    unknown one is a ValueError for pydantic naming the installed ones and the closest."""
    from acc_train.plugins import trackers

    try:
        return trackers().lookup(name, where)  # type: ignore[no-any-return]
    except UserError as exc:
        prefix = "" if where == "training.report_to" else f"{where}: "  # (pydantic names the field it checks)
        raise ValueError(prefix + (f"{exc.message}; {exc.hint}" if exc.hint else exc.message)) from None


class OptimizerConfig(Section):
    """``name`` selects a registered optimizer (core's: adamw, sgd, adafactor, adamw_8bit; a
    plugin's through ``acc_train_register_optimizers``). ``betas``/``eps`` (AdamW's),
    ``momentum``/``nesterov`` (SGD's) apply to the optimizers that take them: unset, they get
    that optimizer's default; set for one that does not take them, they are refused; null in
    the resolved config where they do not apply. ``options`` holds the optimizer's own keys.
    The defaults are the demo job's; a job naming a pretrained model gets
    :data:`FINE_TUNE_DEFAULTS` for the keys it leaves unset."""

    name: NonEmptyStr = Field(
        "adamw",
        description=(
            "The optimizer: `adamw`, `sgd`, `adafactor`, `adamw_8bit` (bitsandbytes, CUDA only) or one a "
            "plugin registers."
        ),
    )
    lr: PositiveFloat = Field(1e-3, description="Peak learning rate (the scheduler warms up to it). Fine-tuning default 2e-5.")
    weight_decay: NonNegativeFloat = Field(
        0.01,
        description="Decoupled weight decay; biases and norm weights get none. Fine-tuning default 0.",
    )
    betas: list[Beta] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="AdamW's (beta1, beta2), each in [0, 1); default [0.9, 0.95]",
    )
    eps: PositiveFloat | None = Field(None, description="AdamW's; default 1e-8")
    momentum: Beta | None = Field(None, description="SGD's; default 0.9")
    nesterov: bool | None = Field(None, description="SGD's; default false")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the optimizer's own keys (adafactor: clip_threshold, decay_rate, beta1, scale_parameter)",
    )

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        from acc_train.config.optimizer import registered_name

        return registered_name(name)

    @model_validator(mode="after")
    def _for_the_optimizer(self) -> OptimizerConfig:
        from acc_train.config.optimizer import fit_to_optimizer

        fit_to_optimizer(self)
        return self


class SchedulerConfig(Section):
    name: Literal[SCHEDULERS] = Field(  # type: ignore[valid-type]
        "cosine",
        description="A transformers scheduler name (`get_scheduler`).",
    )
    warmup_steps: NonNegativeCount | None = Field(None, description="Steps of linear warmup; null: `warmup_ratio` of the steps.")
    warmup_ratio: float = Field(0.1, ge=0, le=1, allow_inf_nan=False, description="Used when `warmup_steps` is not set.")


class TrainingConfig(Section):
    max_steps: Count | None = Field(None, description="Optimizer steps. Default 300 when neither this nor `epochs` is set.")
    epochs: Count | None = Field(
        None,
        description=(
            "Passes over the training data (instead of `max_steps`); each epoch is cut to a whole number of "
            "optimizer steps."
        ),
    )
    micro_batch_size: Count = Field(8, description="Rows per process per forward pass.")
    gradient_accumulation_steps: Count = Field(
        1,
        description="Micro-batches per optimizer step; the global batch is processes x micro-batch x accumulation.",
    )
    max_grad_norm: PositiveFloat | None = Field(
        1.0,
        description="Clip the global gradient norm to this; null turns clipping off.",
    )
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto",
        description=(
            "Compute precision: `auto` (bf16 where the device computes it natively, CUDA with bf16 or CPUs "
            "with AVX512-BF16/AMX; fp32 elsewhere), `no`, `bf16`, `fp16`."
        ),
    )
    seed: int = Field(
        42,
        ge=0,
        le=MAX_SEED,
        description="Seeds Python, NumPy and torch on every rank and decides the data order.",
    )
    log_every: Count = Field(1, description="Write a row to `metrics.jsonl` (and the trackers) every N steps.")
    read_every: Count = Field(
        10,
        description=(
            "Read the steps' losses, gradient norms and token counts back from the accelerator every N steps "
            "(and at the run's first step, before an evaluation, a checkpoint, a stop and the end); the rows of the steps between are "
            "written then, one per step. Between reads the host never waits for the device. 1 reads every step."
        ),
    )
    eval_every: NonNegativeCount = Field(
        0,
        description="Evaluate every N steps (and after the last); 0 evaluates only after the last step.",
    )
    eval_batches: Count = Field(8, description="Batches each evaluation runs.")
    report_to: list[str] = Field(
        default_factory=list,
        description=(
            "Trackers: Accelerate's (tensorboard, wandb, mlflow, ...) and those plugins register "
            "(`acc-train plugins` lists them); `all` for every installed one."
        ),
    )
    tracker: TrackerConfig = Field(
        default_factory=TrackerConfig,
        description="The tracker run: project, run name, each tracker's init arguments.",
    )
    progress_bar: bool = Field(True, description="Show a progress bar on rank 0 when the output is a terminal.")
    gradient_checkpointing: bool = Field(
        False,
        description=(
            "Recompute each layer's activations in backward instead of storing them (transformers' gradient "
            "checkpointing, non-reentrant), under every strategy: less memory, more compute."
        ),
    )
    compile: CompileConfig = Field(
        default_factory=CompileConfig,
        description=(
            "torch.compile through Accelerate's `TorchDynamoPlugin` (`CompileConfig`); `true` is `{enabled: "
            "true}` with the inductor backend."
        ),
    )

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML 1.1 reads a bare `no` as false

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, value: list[str]) -> list[str]:
        for name in value:
            if name == "all":
                continue
            kind = tracker_kind(name, "training.report_to")
            if not kind.installed():
                raise ValueError(f"tracker {name!r} is not installed (pip install {kind.requires[0]})")
        return value

    @model_validator(mode="after")
    def _kwargs_for_used_trackers(self) -> TrainingConfig:
        for name, kwargs in self.tracker.init_kwargs.items():
            kind = tracker_kind(name, "training.tracker.init_kwargs")
            for key in kwargs:
                if (why := owned_key_error(name, key, kind)) is not None:
                    raise ValueError(f"training.tracker.init_kwargs: {why}")
        unused = sorted(set(self.tracker.init_kwargs) - set(self.report_to)) if "all" not in self.report_to else []
        if unused:
            raise ValueError(
                f"training.tracker.init_kwargs names {', '.join(unused)}, which training.report_to does not list"
                f" ({', '.join(self.report_to) or 'empty'}): add it there, or drop its init_kwargs"
            )
        return self

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainingConfig:
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("set training.max_steps or training.epochs, not both")
        return self
