"""The job config's schema: one pydantic model per section, strict at every level.

The ``strategy`` section is a plain mapping here: its options belong to the strategy, whose
own schema validates them when the job is resolved (:mod:`acc_train.config.resolve`).
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from acc_train.config.compile import CompileConfig
from acc_train.strategy import DEFAULT_STRATEGY
from acc_train.trackers import TRACKER_MODULES, TrackerConfig

__all__ = [
    "JobConfig", "ModelConfig", "DataConfig", "OptimizerConfig", "SchedulerConfig", "TrainingConfig", "TrackerConfig",
    "CheckpointConfig", "LaunchConfig", "LoraConfig", "DEFAULT_MAX_STEPS", "TRACKER_MODULES", "SCHEDULERS", "MAX_INT64",
    "MAX_SEED", "MAX_PROCESSES_PER_MACHINE", "MAX_SEQ_LEN", "MODEL_DTYPES", "FINE_TUNE_DEFAULTS", "DEMO_EVAL_FRACTION",
]  # fmt: skip

DEFAULT_MAX_STEPS = 300

# Constrained types: every number a job holds is finite and in a range that means something, so a
# bad value is refused here, naming its key and origin, never inside the workers.
#: the largest count torch and numpy hold (a C int64); beyond it they overflow, not this check
MAX_INT64 = 2**63 - 1
#: seeds go to numpy's ``np.random.seed``, which takes 0 <= seed < 2**32
MAX_SEED = 2**32 - 1
#: processes per machine: 4x the largest machines made (256 cores, 8-16 accelerators). Each process
#: is a Python interpreter holding a model; thousands would exhaust the machine, not train
MAX_PROCESSES_PER_MACHINE = 1024
#: tokens per sequence: beyond any model's context; a larger value is a typo that would only
#: fail inside the workers, when the first batch is allocated
MAX_SEQ_LEN = 2**24
Count = Annotated[int, Field(ge=1, le=MAX_INT64)]
NonNegativeCount = Annotated[int, Field(ge=0, le=MAX_INT64)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]
NonEmptyStr = Annotated[str, Field(min_length=1)]

#: ``model.dtype`` values; the low-precision ones train without an fp32 master copy.
MODEL_DTYPES = ("auto", "fp32", "bf16", "fp16")

#: Defaults for fine-tuning, where the job names a pretrained model (``model.name_or_path``) and
#: leaves the key unset; the demo job (and any key set anywhere) keeps the schema's default.
#: A pretrained model is wrecked by the demo's lr of 1e-3; these follow HF Trainer / TRL / axolotl.
FINE_TUNE_DEFAULTS: dict[tuple[str, str], Any] = {
    ("optimizer", "lr"): 2e-5,
    ("optimizer", "weight_decay"): 0.0,
    ("optimizer", "betas"): [0.9, 0.999],
}

#: ``data.eval_fraction`` unset: the demo text holds out this share for eval; the user's own
#: training files are never held out unless ``data.eval_fraction`` says so.
DEMO_EVAL_FRACTION = 0.02

SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)


class LoraConfig(Section):
    """LoRA adapters through PEFT (``model.lora``): the base model's weights are frozen, and only
    the adapters are trained, in the optimizer and in checkpoints. The defaults follow the QLoRA
    paper and axolotl: rank 16, alpha 32, every linear layer of the transformer blocks."""

    #: The adapters' rank.
    r: int = Field(16, ge=1, le=65536)
    #: Scaling numerator: the adapter's output is scaled by ``alpha / r``.
    alpha: PositiveFloat = 32.0
    dropout: float = Field(0.05, ge=0.0, lt=1.0, allow_inf_nan=False)
    #: Module names (or suffixes) to adapt, or ``all-linear``: every linear layer but the output
    #: head, whatever the architecture calls them (PEFT's own rule).
    target_modules: list[NonEmptyStr] | Literal["all-linear"] = "all-linear"
    #: Modules trained in full beside the adapters and saved with them (e.g. ``lm_head`` and
    #: ``embed_tokens`` after adding tokens); PEFT's ``modules_to_save``.
    modules_to_save: list[NonEmptyStr] = Field(default_factory=list)


class ModelConfig(Section):
    #: A local directory or hub id for ``from_pretrained``; None trains the built-in demo model.
    name_or_path: NonEmptyStr | None = None
    #: Tokenizer path or id; defaults to ``name_or_path``. The demo job is byte-level.
    tokenizer: NonEmptyStr | None = None
    #: Overrides for the demo model's ``LlamaConfig`` (ignored when ``name_or_path`` is set).
    config: dict[str, Any] = Field(default_factory=dict)
    trust_remote_code: bool = False
    #: What the trainable parameters are held and stepped in. ``auto`` and ``fp32``: fp32, whatever
    #: dtype the checkpoint is stored in (hub checkpoints are bf16), with
    #: ``training.mixed_precision`` doing the compute casts. ``bf16``/``fp16``: pure low-precision
    #: training, with no fp32 master copy (a warning says so).
    dtype: Literal[MODEL_DTYPES] = "auto"  # type: ignore[valid-type]
    #: Attention kernel (transformers' ``attn_implementation``): ``sdpa``, ``eager``,
    #: ``flash_attention_2`` (a CUDA GPU and the flash-attn package) or any name transformers
    #: accepts. Null: transformers' default, ``sdpa`` where the model supports it, else ``eager``.
    attn_implementation: NonEmptyStr | None = None
    #: Train LoRA adapters (PEFT) on the frozen model instead of every weight; null: full fine-tuning.
    lora: LoraConfig | None = None

    @model_validator(mode="after")
    def _config_only_for_demo(self) -> ModelConfig:
        if self.name_or_path and self.config:
            raise ValueError("model.config overrides the demo model only; remove it when model.name_or_path is set")
        return self


class DataConfig(Section):
    #: Data files for ``datasets`` (json, jsonl, text, parquet); empty trains on the demo text.
    train_files: list[NonEmptyStr] = Field(default_factory=list)
    eval_files: list[NonEmptyStr] = Field(default_factory=list)
    #: The files' format (``auto``: from their names).
    format: Literal["auto", "json", "jsonl", "text", "parquet"] = "auto"
    #: What a row is: ``text`` (pretraining documents), ``prompt_completion`` or ``chat``
    #: (loss on the completion / assistant tokens only), or a kind a plugin registers.
    kind: NonEmptyStr = "text"
    text_field: NonEmptyStr = "text"
    prompt_field: NonEmptyStr = "prompt"
    completion_field: NonEmptyStr = "completion"
    messages_field: NonEmptyStr = "messages"
    seq_len: int = Field(128, ge=2, le=MAX_SEQ_LEN)
    #: Pack short examples into ``seq_len`` rows (position ids restart at each example).
    #: Default: on for ``text``, off for the other kinds (examples padded per batch).
    packing: bool | None = None
    #: An example longer than ``seq_len`` (not ``text``, whose documents are cut into rows):
    #: ``truncate`` keeps its first ``seq_len`` tokens, ``drop`` leaves it out. Both are counted.
    overlong: Literal["truncate", "drop"] = "truncate"
    #: Read the files as a stream, tokenized and packed on the fly (for corpora larger than
    #: RAM or disk); needs ``training.max_steps``.
    streaming: bool = False
    #: Where tokenized data is cached; default ``$XDG_CACHE_HOME/acc-train/data``
    #: (``~/.cache/acc-train/data``).
    cache_dir: NonEmptyStr | None = None
    #: Processes that tokenize (``datasets.map(num_proc=...)``); default: the CPU cores.
    num_proc: int | None = Field(None, ge=1, le=1024)
    #: Share of the training blocks held out for eval when no ``eval_files`` are given. Unset:
    #: 0 for the user's ``train_files`` (training data is never held out silently),
    #: :data:`DEMO_EVAL_FRACTION` for the demo text.
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, allow_inf_nan=False)
    #: How much of the standard library's source the demo job reads.
    demo_max_bytes: int = Field(1_500_000, ge=1024, le=MAX_INT64)
    shuffle: bool = True


class OptimizerConfig(Section):
    """``name`` selects a registered optimizer (core's: adamw, sgd, adafactor, adamw_8bit; a
    plugin's through ``acc_train_register_optimizers``). ``betas``/``eps`` (AdamW's),
    ``momentum``/``nesterov`` (SGD's) apply to the optimizers that take them: unset, they get
    that optimizer's default; set for one that does not take them, they are refused; null in
    the resolved config where they do not apply. ``options`` holds the optimizer's own keys.
    The defaults are the demo job's; a job naming a pretrained model gets
    :data:`FINE_TUNE_DEFAULTS` for the keys it leaves unset."""

    name: NonEmptyStr = "adamw"
    lr: PositiveFloat = 1e-3
    weight_decay: NonNegativeFloat = 0.01
    #: AdamW's (beta1, beta2), each in [0, 1); default [0.9, 0.95]
    betas: list[Beta] | None = Field(None, min_length=2, max_length=2)
    #: AdamW's; default 1e-8
    eps: PositiveFloat | None = None
    #: SGD's; default 0.9
    momentum: Beta | None = None
    #: SGD's; default false
    nesterov: bool | None = None
    #: the optimizer's own keys (adafactor: clip_threshold, decay_rate, beta1, scale_parameter)
    options: dict[str, Any] = Field(default_factory=dict)

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
    #: A transformers scheduler name (``get_scheduler``).
    name: Literal[SCHEDULERS] = "cosine"  # type: ignore[valid-type]
    warmup_steps: NonNegativeCount | None = None
    #: Used when ``warmup_steps`` is not set.
    warmup_ratio: float = Field(0.1, ge=0, le=1, allow_inf_nan=False)


class TrainingConfig(Section):
    #: Optimizer steps. Default 300 when neither this nor ``epochs`` is set.
    max_steps: Count | None = None
    epochs: Count | None = None
    micro_batch_size: Count = 8
    gradient_accumulation_steps: Count = 1
    #: Clip the global gradient norm to this; null turns clipping off.
    max_grad_norm: PositiveFloat | None = 1.0
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    seed: int = Field(42, ge=0, le=MAX_SEED)
    log_every: Count = 1
    #: Evaluate every N steps (and after the last); 0 evaluates only after the last step.
    eval_every: NonNegativeCount = 0
    eval_batches: Count = 8
    #: Accelerate trackers: tensorboard, wandb, ... (``all`` for every installed one).
    report_to: list[str] = Field(default_factory=list)
    #: The tracker run: project, run name, each tracker's init arguments.
    tracker: TrackerConfig = Field(default_factory=TrackerConfig)
    progress_bar: bool = True
    #: Recompute each layer's activations in backward instead of storing them (transformers'
    #: gradient checkpointing, non-reentrant), under every strategy: less memory, more compute.
    gradient_checkpointing: bool = False
    #: torch.compile through Accelerate's ``TorchDynamoPlugin`` (:class:`CompileConfig`); ``true`` is
    #: ``{enabled: true}`` with the inductor backend.
    compile: CompileConfig = Field(default_factory=CompileConfig)

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML 1.1 reads a bare `no` as false

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, value: list[str]) -> list[str]:
        import importlib.util

        for name in value:
            module = TRACKER_MODULES.get(name)
            if name != "all" and module is None:
                raise ValueError(f"unknown tracker {name!r}; known: {', '.join(sorted(TRACKER_MODULES))}, all")
            if module and not any(importlib.util.find_spec(m) for m in module):
                raise ValueError(f"tracker {name!r} is not installed (pip install {module[0]})")
        return value

    @model_validator(mode="after")
    def _kwargs_for_used_trackers(self) -> TrainingConfig:
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


class CheckpointConfig(Section):
    #: Save every N steps (and after the last); 0 saves only after the last step.
    every: NonNegativeCount = 100
    #: Keep the N most recent complete checkpoints; null keeps all.
    keep_last: Count | None = 2
    #: Write the state in a background thread (torch.distributed.checkpoint's async_save): the
    #: loop blocks only while it is copied aside. The checkpoint is committed (manifest,
    #: ``latest``) once written, at the next save or the end of training. ``dcp`` format only.
    async_save: bool = False


class LaunchConfig(Section):
    """How the workers start; keys left unset here fill themselves from Slurm or torchrun's
    variables (``acc_train.cluster``, docs/cluster.md) before the job is validated."""

    #: Processes per machine. Null: one per GPU, or 1 on a machine without GPUs.
    num_processes: int | None = Field(None, ge=1, le=MAX_PROCESSES_PER_MACHINE)
    num_machines: Count = 1
    machine_rank: NonNegativeCount = 0
    #: Address of machine 0; required with several machines.
    main_process_ip: NonEmptyStr | None = None
    main_process_port: int = Field(29500, ge=1, le=65535)
    #: ``static`` (fixed machine ranks) or ``c10d`` (elastic rendezvous).
    rdzv_backend: Literal["static", "c10d"] = "static"
    max_restarts: NonNegativeCount = 0
    #: Seconds a collective waits for the slowest rank before the run fails (the process
    #: group's timeout): longer than any phase one rank runs while the others wait.
    timeout: float = Field(1800.0, gt=0, le=7 * 24 * 3600, allow_inf_nan=False)
    #: Seconds a machine waits at the rendezvous for the others to join (several machines).
    rendezvous_timeout: float = Field(900.0, gt=0, le=7 * 24 * 3600, allow_inf_nan=False)
    #: Signals on which the workers save a checkpoint at the next step boundary and stop (the
    #: command exits 128 + the signal's number): SIGTERM (Kubernetes' eviction, Slurm at
    #: preemption or the time limit), SIGINT (Ctrl-C), SIGUSR1 (Slurm's ``--signal=USR1@SECONDS``).
    #: Empty: a signal stops the run without saving.
    save_signals: list[Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"]] = Field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    #: Seconds between the launcher passing a signal on to the workers and killing them (torch
    #: elastic's ``shutdown_timeout``): room for the rest of a step and one checkpoint write.
    shutdown_timeout: int = Field(30, ge=1, le=24 * 3600)
    #: Under Slurm (a job submitted with ``--requeue``): once a signal's checkpoint is saved, ask
    #: Slurm to requeue the job (``scontrol requeue $SLURM_JOB_ID``); the requeued job runs the
    #: same command, which continues the run (needs ``resume: auto``).
    requeue: bool = False

    @model_validator(mode="after")
    def _rank_in_range(self) -> LaunchConfig:
        if self.num_machines > 1 and not self.main_process_ip:
            raise ValueError(
                "with several machines, launch.main_process_ip (--main-process-ip) must name machine 0 "
                "(under Slurm, or with MASTER_ADDR set, it is detected)"
            )
        if self.machine_rank >= self.num_machines:
            raise ValueError(
                f"launch.machine_rank ({self.machine_rank}) must be below launch.num_machines ({self.num_machines})"
            )
        return self


class JobConfig(Section):
    output_dir: str = "runs/demo"
    #: ``latest`` (or ``auto``: latest if any, else start fresh) or a checkpoint path.
    resume: str | None = None
    overwrite: bool = False
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    #: ``name`` plus the options whose schema the strategy owns.
    strategy: dict[str, Any] = Field(default_factory=lambda: {"name": DEFAULT_STRATEGY})

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
