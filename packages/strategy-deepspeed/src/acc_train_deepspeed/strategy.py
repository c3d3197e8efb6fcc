"""The ``deepspeed`` strategy: ZeRO stage 1/2/3 (optimizer state, gradients, parameters sharded).

On GPUs this is Accelerate's own DeepSpeed path. On CPU, Accelerate refuses DeepSpeed and
silently runs DDP; the strategy switches its state to DEEPSPEED through
:mod:`acc_train.accelerate_compat`, and DeepSpeed's CPU accelerator trains over gloo.

Batch size, gradient accumulation and clipping have one source of truth: the job's
``training`` section.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from acc_train import Machine, Strategy, StrategyOptions, UserError
from acc_train.checkpoint import CheckpointFormat
from acc_train.model_state import ModelStateMeter, local_nbytes
from acc_train_deepspeed.config import load_ds_config

if TYPE_CHECKING:
    from acc_train.memory_plan import MemoryPlan, PlanInput

__all__ = ["DeepSpeedOptions", "DeepSpeedStrategy", "DeepSpeedCheckpointFormat", "ZeroMeter"]

Offload = Literal["none", "cpu", "nvme"]

#: DeepSpeed's default ``reduce_bucket_size`` (elements)
DEEPSPEED_REDUCE_BUCKET = 500_000_000

#: options that shape zero_optimization; a config_file decides them instead
ZERO_KEYS = (
    "stage", "offload_optimizer", "offload_param", "nvme_path", "zero3_init_flag", "zero3_save_16bit_model",
    "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
)  # fmt: skip


class DeepSpeedOptions(StrategyOptions):
    #: ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters (default 3,
    #: or the ``config_file``'s).
    stage: Literal[0, 1, 2, 3] | None = None
    #: A DeepSpeed JSON config used as given; ``"auto"`` values are filled from the job.
    config_file: str | None = None
    #: Where optimizer state lives between steps.
    offload_optimizer: Offload = "none"
    #: Where parameters live between uses (stage 3 only).
    offload_param: Offload = "none"
    #: Directory for NVMe offload.
    nvme_path: str | None = None
    #: Build the model already partitioned (stage 3; for models too large for one rank).
    zero3_init_flag: bool | None = None
    #: Gather 16-bit weights when DeepSpeed saves the model (stage 3).
    zero3_save_16bit_model: bool | None = None
    overlap_comm: bool | None = None
    contiguous_gradients: bool | None = None
    #: Elements per gradient reduction bucket.
    reduce_bucket_size: int | None = Field(None, ge=1)
    #: Elements per all-gather bucket (stages 1 and 2).
    allgather_bucket_size: int | None = Field(None, ge=1)

    @property
    def zero_stage(self) -> int:
        return 3 if self.stage is None else self.stage

    @model_validator(mode="after")
    def _consistent(self) -> DeepSpeedOptions:
        if self.config_file is not None:
            given = [k for k in ZERO_KEYS if getattr(self, k) not in (None, "none")]
            if given:
                raise ValueError(
                    f"with config_file, the DeepSpeed JSON's zero_optimization decides; remove {', '.join(given)} "
                    "(or use the plain 'deepspeed' strategy name, not a zero* preset)"
                )
            return self
        stage = self.zero_stage
        if self.offload_param != "none" and stage != 3:
            raise ValueError(f"offload_param needs stage 3 (this config has stage {stage})")
        if self.offload_optimizer != "none" and stage == 0:
            raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise ValueError("NVMe offload needs nvme_path")
        for key in ("zero3_init_flag", "zero3_save_16bit_model"):
            if getattr(self, key) is not None and stage != 3:
                raise ValueError(f"{key} applies to stage 3 only (this config has stage {stage})")
        if self.allgather_bucket_size is not None and stage == 3:
            raise ValueError("allgather_bucket_size applies to stages 1 and 2; stage 3 prefetches parameters instead")
        return self


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    aliases = ("zero",)
    presets = {
        "zero1": {"stage": 1},
        "zero2": {"stage": 2},
        "zero3": {"stage": 3},
        "zero2-offload": {"stage": 2, "offload_optimizer": "cpu"},
        "zero3-offload": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
    }
    description = "DeepSpeed ZeRO 1/2/3 (optimizer state, gradients, parameters sharded), with offload"
    options_schema = DeepSpeedOptions
    checkpoint_format = "deepspeed"

    def equivalent_to_ddp(self, options: StrategyOptions) -> bool:
        assert isinstance(options, DeepSpeedOptions)
        return options.config_file is None  # a user's JSON may set its own precision or optimizer

    def check_environment(self, options: StrategyOptions, machine: Machine) -> None:
        assert isinstance(options, DeepSpeedOptions)
        if machine.device_type == "cpu" and "cpu" in (options.offload_optimizer, options.offload_param):
            raise UserError(
                "CPU offload moves state from accelerator memory to CPU memory; this run has no accelerator, so it would do nothing",
                where="strategy.offload_optimizer" if options.offload_optimizer == "cpu" else "strategy.offload_param",
                hint="use zero2 / zero3 (without -offload) on a CPU-only run",
            )

    def accelerator_kwargs(self, options: StrategyOptions, job: Any) -> dict[str, Any]:
        from accelerate.utils import DeepSpeedPlugin

        assert isinstance(options, DeepSpeedOptions)
        training = job.config.training if job is not None else None
        gas = training.gradient_accumulation_steps if training else 1
        clip = (training.max_grad_norm or 0.0) if training else 0.0
        if options.config_file is not None:
            from acc_train.accelerator import current_machine, resolve_mixed_precision

            precision = resolve_mixed_precision(training.mixed_precision if training else "auto", current_machine())
            mbs = training.micro_batch_size if training else "auto"
            ds_config = load_ds_config(options.config_file, mbs, gas, clip, precision)
            stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
            return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=ds_config, zero3_init_flag=stage == 3)}
        zero: dict[str, Any] = {"stage": options.zero_stage}
        for key in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size"):
            if getattr(options, key) is not None:
                zero[key] = getattr(options, key)
        if options.offload_optimizer != "none":
            zero["offload_optimizer"] = {"device": options.offload_optimizer, **({"nvme_path": options.nvme_path} if options.offload_optimizer == "nvme" else {})}
        if options.offload_param != "none":
            zero["offload_param"] = {"device": options.offload_param, **({"nvme_path": options.nvme_path} if options.offload_param == "nvme" else {})}
        if options.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = bool(options.zero3_save_16bit_model)
        config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": gas,
            "gradient_clipping": clip,
            "zero_optimization": zero,
        }
        plugin = DeepSpeedPlugin(
            hf_ds_config=config,
            zero3_init_flag=bool(options.zero3_init_flag) if options.zero_stage == 3 else False,
        )
        return {"deepspeed_plugin": plugin}

    def after_accelerator(self, accelerator: Any, options: StrategyOptions) -> None:
        if accelerator.acc_machine.device_type != "cpu":
            return
        from acc_train.accelerate_compat import run_sharded_on_cpu

        plugin = accelerator.acc_kwargs["deepspeed_plugin"]
        plugin.set_mixed_precision(accelerator.mixed_precision)
        plugin.select(_from_accelerator_state=True)
        run_sharded_on_cpu(accelerator, "DEEPSPEED", deepspeed_plugins=plugin)
        accelerator.deepspeed_engine_wrapped = None

    def expected_distributed_types(self, machine: Machine) -> set[str]:
        return {"DEEPSPEED"}

    def full_state_dict(self, accelerator: Any, model: Any, options: StrategyOptions) -> dict[str, Any]:
        """Under ZeRO-3 the partitions are gathered (DeepSpeed's consolidated state dict)."""
        if accelerator.state.deepspeed_plugin.zero_stage == 3:
            state = model._zero3_consolidated_16bit_state_dict()
            return state if accelerator.is_main_process else {}
        return accelerator.get_state_dict(model)

    def model_state_meter(self, accelerator: Any, model: Any, optimizer: Any) -> ModelStateMeter | None:
        """ZeRO keeps its state in its own flat partitions, not in the torch optimizer."""
        return ZeroMeter(model)

    def summary(self, accelerator: Any, options: StrategyOptions) -> dict[str, Any]:
        return {"zero_stage": accelerator.state.deepspeed_plugin.zero_stage}

    def plan_memory(self, options: StrategyOptions, plan: PlanInput) -> MemoryPlan:
        """The ZeRO paper's accounting: parameters and gradients in the training precision
        (2 bytes each under bf16/fp16, 4 in fp32), and K = 12 bytes of optimizer state (fp32
        master partition, momentum, variance), which DeepSpeed keeps even in fp32 training.
        Measured in fp32: ZeRO-1 8psi + 12psi/N, ZeRO-2 4psi + 16psi/N, ZeRO-3 20psi/N."""
        from acc_train.memory_plan import MemoryPlan

        assert isinstance(options, DeepSpeedOptions)
        psi, n = plan.parameters, plan.world_size
        p = g = 2 if plan.low_precision else 4
        stage = options.zero_stage
        notes: list[str] = []
        if options.config_file is not None:  # its own checks run when the job starts
            import json

            try:
                zero = json.loads(Path(options.config_file).read_text()).get("zero_optimization", {})
            except (OSError, ValueError):
                raise UserError(f"cannot read DeepSpeed config {options.config_file!r}", where="strategy.config_file") from None
            stage = int(zero.get("stage", 0))
            notes.append(f"stage {stage} from {options.config_file} (its offload settings are not shown)")
        if stage == 0:
            params, grads, optim = p * psi, g * psi, (16 - p - g) * psi
            formula = f"{p}psi + {g}psi + {16 - p - g}psi = 16psi"
        elif stage == 1:
            params, grads, optim = p * psi, g * psi, 12 * psi // n
            formula = f"{p}psi + {g}psi + 12psi/N = {p + g}psi + 12psi/N"
        elif stage == 2:
            bucket = options.reduce_bucket_size or DEEPSPEED_REDUCE_BUCKET
            params, grads, optim = p * psi, g * min(psi, psi // n + bucket), 12 * psi // n
            if psi // n + bucket < psi:
                formula = f"{p}psi + {g}psi/N + 12psi/N = {p}psi + {g + 12}psi/N (+ one bucket)"
                notes.append(f"gradients: the partition plus one reduce bucket ({bucket:,} elements, reduce_bucket_size)")
            else:
                formula = f"{p}psi + {g}psi + 12psi/N = {p + g}psi + 12psi/N (model within one bucket)"
                notes.append(
                    f"gradients: the whole model fits one reduce bucket ({bucket:,} elements, reduce_bucket_size), so every "
                    f"gradient exists at once before it is partitioned, as under ZeRO-1; the paper's {p}psi + {g + 12}psi/N needs a model much larger than the bucket"
                )
        else:
            params, grads, optim = p * psi // n, g * psi // n, 12 * psi // n
            formula = f"{p}psi/N + {g}psi/N + 12psi/N = {p + g + 12}psi/N"
            notes.append("+ the layers being gathered; parameters under stage3_param_persistence_threshold are also kept whole")
        offload: dict[str, str] = {}
        if options.offload_optimizer != "none":  # ZeRO-Offload: the gradient partition goes with the step
            offload["optimizer"] = options.offload_optimizer
            if stage >= 2:
                offload["grads"] = options.offload_optimizer
            notes.append(f"offload: the optimizer step runs on the CPU, its state in {options.offload_optimizer.upper()} memory")
        if options.offload_param != "none":
            offload["params"] = options.offload_param
            notes.append(f"parameter partitions in {options.offload_param.upper()} memory, gathered to the accelerator per layer")
        return MemoryPlan(params, grads, optim, formula, offload=offload, note="; ".join(notes))


class DeepSpeedCheckpointFormat(CheckpointFormat):
    """DeepSpeed's own per-rank files (``engine.save_checkpoint``), plus the portable state.

    DeepSpeed writes its files with ``torch.save`` and reads them with ``torch.load``: they are
    pickles, read only by DeepSpeed's own loader, only after the manifest's sha256 of every file
    has been checked. They serve a resume under the same ZeRO stage and world size. Beside
    them, ``state/`` holds the portable state (the fp32 weights and Adam moments gathered per
    parameter, keyed by name, as safetensors): any other strategy or world size resumes from
    that, and this format resumes from any other strategy's portable state."""

    name = "deepspeed"
    description = "DeepSpeed's own per-rank files, plus the portable state (safetensors) for other strategies"
    writes_portable = True

    def save(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        from acc_train.checkpoint import write_portable_state

        model.save_checkpoint(str(directory / "deepspeed"), tag="state", save_latest=False)
        weights, moments = _gather_portable(model)
        write_portable_state(directory, weights, moments)

    def load(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        if not (directory / "deepspeed").is_dir():  # e.g. converted to the portable state alone
            self.load_portable(accelerator, model, optimizer, directory)
            return
        path, _ = model.load_checkpoint(str(directory / "deepspeed"), tag="state", load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise UserError(f"DeepSpeed found no checkpoint in {directory / 'deepspeed'}", where="--resume")

    def load_portable(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        _scatter_portable(model, directory)


#: Adam's per-parameter state, as torch's AdamW names it
MOMENTS = ("exp_avg", "exp_avg_sq")


def _full_shape(p: Any) -> Any:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def _names_by_param(module: Any) -> list[tuple[str, list[str], Any]]:
    """(first name, every name, parameter): tied parameters appear once, under all their names."""
    seen: dict[int, tuple[str, list[str], Any]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            seen[id(p)][1].append(name)
        else:
            seen[id(p)] = (name, [name], p)
    return list(seen.values())


def _ensure_adam_state(engine: Any) -> None:
    """Before the first step the torch optimizer has no state for ZeRO's flat partitions:
    create AdamW's (step, exp_avg, exp_avg_sq), as its first step would, to be filled."""
    import torch

    zero = engine.optimizer
    flats = zero.fp32_partitioned_groups_flat if engine.zero_optimization_stage() == 3 else zero.single_partition_of_fp32_groups
    for flat in flats:
        state = zero.optimizer.state[flat]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)


def _link_optimizer_state(engine: Any) -> None:
    """Stages 1-2: point every parameter's fragment at its group's optimizer state. DeepSpeed
    links them once, after the first group's first step, so the later groups' fragments (here
    the norms' no-decay group) stay empty and ``safe_get_full_optimizer_state`` fails on them
    (DeepSpeed 0.19.8)."""
    if engine.zero_optimization_stage() == 3:
        return
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    zero = engine.optimizer
    for i, flat in enumerate(zero.single_partition_of_fp32_groups):
        if flat in zero.optimizer.state:
            lazy_init_hp_params_optimizer_state(zero.bit16_groups[i], flat, zero.optimizer.state)


def _adam_step(zero: Any) -> float:
    steps = [float(s["step"]) for s in zero.optimizer.state.values() if "step" in s]
    return max(steps) if steps else 0.0


def _gather_portable(engine: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every parameter's fp32 weight and Adam moments, whole, keyed by name (collective:
    DeepSpeed all-gathers each from the ranks' partitions)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _link_optimizer_state(engine)
    step = torch.tensor(_adam_step(engine.optimizer), dtype=torch.float32)
    weights: dict[str, Any] = {}
    moments: dict[str, Any] = {}
    for first, names, p in _names_by_param(engine.module):
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        if full is None:  # frozen: not in the optimizer, the module holds it (whole below stage 3)
            full = p.detach()
        full = full.detach().cpu().float().reshape(_full_shape(p))
        for name in names:
            weights[name] = full
        if p.requires_grad:
            moments[first] = {"step": step.clone(), **{k: safe_get_full_optimizer_state(p, k).detach().cpu().reshape(_full_shape(p)) for k in MOMENTS}}
    return weights, moments


def _set_partition(zero: Any, p: Any, value: Any, key: str | None) -> None:
    """Stage 3: this rank's slice of ``value`` into its fp32 partition (of the weight, or of an
    optimizer state), padding included, which DeepSpeed's public setter does not allow."""
    part, _ = zero._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
    flat = value.flatten().to(part.dtype)
    start = part.numel() * zero._get_param_partition_rank(p)
    n = max(0, min(part.numel(), flat.numel() - start))
    part.data.zero_()
    part.data[:n].copy_(flat[start : start + n])


def _scatter_portable(engine: Any, directory: Path) -> None:
    """Set weights, fp32 master partitions and Adam moments from a portable state written
    under any strategy and world size."""
    import torch
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from acc_train.checkpoint import read_portable_state

    zero = engine.optimizer
    stage = engine.zero_optimization_stage()
    params = _names_by_param(engine.module)
    weights = {name: torch.empty(_full_shape(p), dtype=torch.float32) for _, names, p in params for name in names}
    moments = {
        first: {"step": torch.zeros((), dtype=torch.float32), **{k: torch.empty(_full_shape(p), dtype=torch.float32) for k in MOMENTS}}
        for first, _, p in params
        if p.requires_grad
    }
    read_portable_state(directory, weights, moments)
    _ensure_adam_state(engine)
    _link_optimizer_state(engine)
    with torch.no_grad():
        for first, _, p in params:
            w = weights[first]
            if stage == 3:
                if p.requires_grad:
                    _set_partition(zero, p, w, None)
                    for k in MOMENTS:
                        _set_partition(zero, p, moments[first][k], k)
                else:
                    n = p.ds_tensor.numel()
                    start = n * zero._get_param_partition_rank(p)
                    flat = w.flatten()
                    p.ds_tensor.data.zero_()
                    p.ds_tensor.data[: max(0, min(n, flat.numel() - start))].copy_(flat[start : start + n])
                continue
            p.data.copy_(w.to(p.dtype))  # below stage 3 every rank holds the module's weights whole
            if p.requires_grad:
                safe_set_full_fp32_param(p, w)
                for k in MOMENTS:
                    safe_set_full_optimizer_state(p, moments[first][k], k)
        if stage == 3:  # the module's partitions follow the fp32 masters, as after a step
            for lp, hp in zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat):
                lp.data.copy_(hp.data)
        step = max((float(m["step"]) for m in moments.values()), default=0.0)
        for state in zero.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32) if torch.is_tensor(state["step"]) else int(step)


class ZeroMeter(ModelStateMeter):
    """Model-state bytes of one rank under ZeRO, counted from DeepSpeed's own buffers.

    - parameters: the module's parameters (under stage 3, this rank's partition ``ds_tensor``);
    - gradients: the most held at once. Stage 1 and 2 are looked at when the engine starts
      reducing them (stage 1 still holds every parameter's full ``.grad`` there) and when the
      ZeRO optimizer steps (the partition in ``averaged_gradients``); stage 3 keeps its
      partition in ``grad_partitions_flat_buffer``. Accelerate runs the step inside
      ``backward``, so the engine's methods are wrapped to look before they free anything;
    - optimizer: the fp32 master partitions and the torch optimizer's state (Adam moments).
      A master partition that shares storage with the parameters is counted once.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.zero = engine.optimizer
        self.stage = engine.zero_optimization_stage()
        self.grads = 0
        self._watch(engine, "allreduce_gradients")
        self._watch(self.zero, "step")

    def _watch(self, owner: Any, method: str) -> None:
        original = getattr(owner, method)

        def watched(*args: Any, **kwargs: Any) -> Any:
            self.grads = max(self.grads, self._gradient_bytes())
            return original(*args, **kwargs)

        setattr(owner, method, watched)

    def _gradient_bytes(self) -> int:
        if self.stage == 3:
            return local_nbytes(getattr(self.zero, "grad_partitions_flat_buffer", None))
        on_params = sum(local_nbytes(p.grad) for p in self.engine.module.parameters())
        averaged = getattr(self.zero, "averaged_gradients", None) or {}
        partitions = [t for v in averaged.values() if v is not None for t in (v if isinstance(v, list) else [v])]
        return on_params + sum(local_nbytes(t) for t in partitions)

    def result(self) -> dict[str, int]:
        import torch

        module_params = list(self.engine.module.parameters())
        held = [p.ds_tensor for p in module_params] if self.stage == 3 else module_params
        storages = {t.untyped_storage().data_ptr() for t in held}
        masters = self.zero.fp32_partitioned_groups_flat if self.stage == 3 else self.zero.single_partition_of_fp32_groups
        master_bytes = sum(local_nbytes(t) for t in masters if t.untyped_storage().data_ptr() not in storages)
        state = self.zero.optimizer.state
        moments = sum(local_nbytes(v) for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))
        return {"params": sum(local_nbytes(t) for t in held), "grads": self.grads, "optimizer": master_bytes + moments}
