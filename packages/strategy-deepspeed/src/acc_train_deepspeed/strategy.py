"""The ``deepspeed`` strategy: ZeRO stage 1/2/3 (optimizer state, gradients, parameters sharded).

On GPUs this is Accelerate's own DeepSpeed path. On CPU, Accelerate refuses DeepSpeed and
silently runs DDP; the strategy switches its state to DEEPSPEED through
:mod:`acc_train.accelerate_compat`, and DeepSpeed's CPU accelerator trains over gloo.

Batch size, gradient accumulation and clipping have one source of truth: the job's
``training`` section.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from acc_train.api import Machine, ModelStateMeter, Strategy, StrategyOptions, UserError
from acc_train_deepspeed.config import ds_zero_stage, load_ds_config, read_ds_config

if TYPE_CHECKING:
    from acc_train.api import MemoryPlan, PlanInput

__all__ = ["DeepSpeedOptions", "DeepSpeedStrategy"]

Offload = Literal["none", "cpu", "nvme"]

#: DeepSpeed's default ``reduce_bucket_size`` (elements)
DEEPSPEED_REDUCE_BUCKET = 500_000_000
#: DeepSpeed's default ``stage3_max_live_parameters`` (elements): ZeRO-3 keeps up to this many
#: gathered parameter elements alive for reuse
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000

#: What ZeRO keeps of a model loaded in bf16/fp16 (``model.dtype``) when its own bf16/fp16 mode is
#: off (``training.mixed_precision: no``), measured with DeepSpeed 0.19.8 on 2 CPU ranks, by ZeRO
#: ``stage``; stage 0 is refused before launch (check_environment)
_LOW_PRECISION_WEIGHTS = {
    0: "ZeRO-0 with model.dtype {dtype} was not measured; planned as ZeRO-1/2",
    1: "ZeRO-1/2 keep the parameters and gradients in {dtype} but step fp32 master partitions (12 bytes a parameter, sharded)",
    2: "ZeRO-1/2 keep the parameters and gradients in {dtype} but step fp32 master partitions (12 bytes a parameter, sharded)",
    3: "ZeRO-3 without its bf16/fp16 mode partitions the parameters in fp32, so they, their gradients and the masters are fp32",
}

#: options that shape zero_optimization; a config_file decides them instead
ZERO_KEYS = (
    "stage", "offload_optimizer", "offload_param", "nvme_path", "zero3_init_flag", "zero3_save_16bit_model",
    "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
)  # fmt: skip


class DeepSpeedOptions(StrategyOptions):
    stage: Literal[0, 1, 2, 3] | None = Field(
        None,
        description=(
            "ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters (default 3, or the "
            "`config_file`'s)."
        ),
    )
    config_file: str | None = Field(
        None,
        description="A DeepSpeed JSON config used as given; `\"auto\"` values are filled from the job.",
    )
    offload_optimizer: Offload = Field("none", description="Where optimizer state lives between steps.")
    offload_param: Offload = Field("none", description="Where parameters live between uses (stage 3 only).")
    nvme_path: str | None = Field(None, description="Directory for NVMe offload.")
    zero3_init_flag: bool | None = Field(
        None,
        description="Build the model already partitioned (stage 3; for models too large for one rank).",
    )
    zero3_save_16bit_model: bool | None = Field(
        None,
        description=(
            "Gather the whole model's 16-bit weights when the model is saved (stage 3; DeepSpeed's "
            "`stage3_gather_16bit_weights_on_model_save`). Default: on, so `accelerator.get_state_dict(model)` "
            "and `save_pretrained` keep the trained model; it costs one gather of the weights at such a save "
            "(checkpoints do not use it). `false` leaves a program's 16-bit save refused by DeepSpeed."
        ),
    )
    overlap_comm: bool | None = Field(None, description="Overlap gradient reduction with backward (DeepSpeed's `overlap_comm`).")
    contiguous_gradients: bool | None = Field(
        None,
        description=(
            "Copy gradients into one contiguous buffer as they are produced (DeepSpeed's "
            "`contiguous_gradients`)."
        ),
    )
    reduce_bucket_size: int | None = Field(None, ge=1, description="Elements per gradient reduction bucket.")
    allgather_bucket_size: int | None = Field(None, ge=1, description="Elements per all-gather bucket (stages 1 and 2).")

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


class DeepSpeedStrategy(Strategy[DeepSpeedOptions]):
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
    accelerate_distributed_types = ("DEEPSPEED",)
    accelerate_config_sections = ("deepspeed_config",)
    launch_variables = (
        "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_", "ACCELERATE_CONFIG_DS_FIELDS",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING",
    )  # fmt: skip
    accelerator_arguments = ("deepspeed_plugin", "deepspeed_plugins")

    def equivalent_to_ddp(self) -> bool:
        return self.options.config_file is None  # a user's JSON may set its own precision or optimizer

    def check_environment(self, machine: Machine) -> None:
        options = self.options
        if machine.device_type == "cpu" and "cpu" in (options.offload_optimizer, options.offload_param):
            raise UserError(
                "CPU offload moves state from accelerator memory to CPU memory; this run has no accelerator, so it would do nothing",
                where="strategy.offload_optimizer" if options.offload_optimizer == "cpu" else "strategy.offload_param",
                hint="use zero2 / zero3 (without -offload) on a CPU-only run",
            )
        if options.config_file is None:
            stage, where = options.zero_stage, "strategy.stage"
        else:
            stage, where = ds_zero_stage(read_ds_config(options.config_file), options.config_file), f"{options.config_file}: zero_optimization.stage"
        if stage == 0:
            # measured (DeepSpeed 0.19.8): stage 0 steps the plain torch optimizer (fp32) or its
            # FP16_UnfusedOptimizer (bf16), whose state the portable checkpoint's ZeRO gather does
            # not know: the first save (and final/) failed, fp32 and bf16 alike
            raise UserError(
                "ZeRO stage 0 (no partitioning) is not supported: its optimizer state cannot be saved as a portable "
                "checkpoint, so the run would fail at its first save"
                + (" (a DeepSpeed config without zero_optimization.stage means stage 0)" if options.config_file else ""),
                where=where,
                hint="use --strategy ddp (stage 0 is plain data parallelism) or ZeRO stage 1, 2 or 3",
            )

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        from accelerate.utils import DeepSpeedPlugin

        options = self.options
        training = job.config.training if job is not None else None
        gas = training.gradient_accumulation_steps if training else 1
        clip = (training.max_grad_norm or 0.0) if training else 0.0
        if options.config_file is not None:
            from acc_train.api import current_machine, resolve_mixed_precision

            precision = resolve_mixed_precision(training.mixed_precision if training else "auto", current_machine())
            mbs = training.micro_batch_size if training else "auto"
            ds_config = load_ds_config(options.config_file, mbs, gas, clip, precision)
            stage = ds_zero_stage(ds_config, options.config_file)
            return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=ds_config, zero3_init_flag=stage == 3)}
        config = self._ds_config(gas, clip)
        plugin = DeepSpeedPlugin(
            hf_ds_config=config,
            zero3_init_flag=bool(options.zero3_init_flag) if options.zero_stage == 3 else False,
        )
        return {"deepspeed_plugin": plugin}

    #: options no ``accelerate launch`` variable carries: a DeepSpeed JSON written for the launch carries them
    JSON_ONLY = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size", "nvme_path")

    def launch_env(self, machine: Machine, scratch: Any) -> dict[str, str]:
        """``accelerate launch``'s DeepSpeed variables for the options (Accelerate's
        ``prepare_deepspeed_cmd_env``). ``config_file`` is named by
        ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` as given (its ``"auto"`` values are filled by
        Accelerate or the program's Trainer, as under ``accelerate launch``). Options no variable
        carries (:attr:`JSON_ONLY`) go into a DeepSpeed JSON written for the launch in
        ``scratch`` and named the same way; then the stage and offload travel in it too (Accelerate
        refuses to read them twice). Batch size, accumulation and clipping stay ``"auto"``: the
        program's (or its Trainer's) values fill them; where nothing does by the time the model
        is prepared, :meth:`before_prepare` turns clipping off, as DDP does not clip."""
        import json

        options = self.options
        env = {"ACCELERATE_USE_DEEPSPEED": "true"}
        if options.config_file is not None:
            import os

            ds_zero_stage(read_ds_config(options.config_file), options.config_file)
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = os.path.abspath(options.config_file)
            return env
        stage = options.zero_stage
        init = "true" if stage == 3 and options.zero3_init_flag else "false"
        if any(getattr(options, key) is not None for key in self.JSON_ONLY):
            config = self._ds_config(gas="auto", clip="auto")
            config["train_batch_size"] = "auto"
            path = scratch / "deepspeed.json"
            path.write_text(json.dumps(config, indent=2))
            return {**env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path), "ACCELERATE_DEEPSPEED_ZERO3_INIT": init}
        env.update(
            {
                "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage),
                "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": options.offload_optimizer,
                "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": options.offload_param,
                "ACCELERATE_DEEPSPEED_ZERO3_INIT": init,
                "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true" if stage == 3 and options.zero3_save_16bit_model is not False else "false",
            }
        )
        return env

    def before_prepare(self, accelerator: Any, model: Any) -> None:
        """A program launched unchanged whose DeepSpeed clipping is still ``"auto"`` when its
        model is prepared (nothing filled it: an Accelerate script, not a Trainer, which fills it
        from ``max_grad_norm``) trains without clipping, as the same program does under DDP;
        Accelerate alone would clip at 1.0."""
        plugin = accelerator.state.deepspeed_plugin
        if getattr(accelerator, "acc_launched", False) and plugin is not None and plugin.deepspeed_config.get("gradient_clipping") == "auto":
            plugin.deepspeed_config["gradient_clipping"] = 0.0

    def after_accelerator(self, accelerator: Any) -> None:
        """On CPU, switch Accelerate to DeepSpeed with the strategy's plugin (or, in a program
        launched unchanged, the one built from the launch variables or passed by the program),
        unless an earlier Accelerator of the process already did: a later one shares its plugin,
        as on GPUs."""
        if accelerator.acc_machine.device_type != "cpu":
            return
        from acc_train.api import already_running, run_sharded_on_cpu

        if already_running(accelerator, "DEEPSPEED", "deepspeed_plugins"):
            return
        plugin = accelerator.acc_kwargs.get("deepspeed_plugin") or accelerator.acc_kwargs.get("deepspeed_plugins")
        if isinstance(plugin, dict):
            raise UserError(
                "several DeepSpeed plugins (Accelerator(deepspeed_plugins={...})) were not tried on CPU",
                where="Accelerator(deepspeed_plugins=...)",
                hint="pass one deepspeed_plugin, or run on GPUs",
            )
        if plugin is None and getattr(accelerator, "acc_launched", False):
            from accelerate.utils import DeepSpeedPlugin

            # the plugin Accelerate built from the launch variables, and AcceleratorState dropped on CPU
            plugin = DeepSpeedPlugin()
        if plugin is None:
            raise RuntimeError("strategy deepspeed on CPU: the Accelerator was built without a DeepSpeed plugin")
        plugin.set_mixed_precision(accelerator.mixed_precision)
        plugin.select(_from_accelerator_state=True)
        run_sharded_on_cpu(accelerator, "DEEPSPEED", deepspeed_plugins=plugin)
        accelerator.deepspeed_engine_wrapped = None

    def _ds_config(self, gas: Any, clip: Any) -> dict[str, Any]:
        """The DeepSpeed config of the options (no ``config_file``)."""
        options = self.options
        zero: dict[str, Any] = {"stage": options.zero_stage}
        for key in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size"):
            if getattr(options, key) is not None:
                zero[key] = getattr(options, key)
        if options.offload_optimizer != "none":
            zero["offload_optimizer"] = {"device": options.offload_optimizer, **({"nvme_path": options.nvme_path} if options.offload_optimizer == "nvme" else {})}
        if options.offload_param != "none":
            zero["offload_param"] = {"device": options.offload_param, **({"nvme_path": options.nvme_path} if options.offload_param == "nvme" else {})}
        if options.zero_stage == 3:
            zero["stage3_gather_16bit_weights_on_model_save"] = options.zero3_save_16bit_model is not False  # default on
        return {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": gas,
            "gradient_clipping": clip,
            "zero_optimization": zero,
        }

    def clip_grad_norm(self, accelerator: Any, max_norm: float) -> Any:
        """The engine clips inside its step (its config's ``gradient_clipping``) and keeps the
        norm it measured; Accelerate's ``clip_grad_norm_`` reads it back to the host
        (``.item()``) on every call. Here it stays where DeepSpeed left it, so a step that logs
        nothing waits for nothing."""
        wrapped = accelerator.deepspeed_engine_wrapped
        return None if wrapped is None else wrapped.engine.get_global_grad_norm()

    def expected_distributed_types(self, machine: Machine) -> set[str]:
        return {"DEEPSPEED"}

    def full_state_dict(self, accelerator: Any, model: Any) -> dict[str, Any]:
        """Under ZeRO-3 the partitions are gathered (DeepSpeed's consolidated state dict)."""
        if accelerator.state.deepspeed_plugin.zero_stage == 3:
            state = model._zero3_consolidated_16bit_state_dict()
            return state if accelerator.is_main_process else {}
        return accelerator.get_state_dict(model)

    def parameter_elements(self, accelerator: Any, model: Any) -> tuple[int, int]:
        """Under ZeRO-3 a rank holds its partition ``ds_tensor`` of each parameter; below, every
        parameter whole."""
        local = total = 0
        for p in model.parameters():
            if hasattr(p, "ds_tensor"):
                local, total = local + p.ds_tensor.numel(), total + p.ds_numel
            else:
                local, total = local + p.numel(), total + p.numel()
        return local, total

    def model_state_meter(self, accelerator: Any, model: Any, optimizer: Any) -> ModelStateMeter | None:
        """ZeRO keeps its state in its own flat partitions, not in the torch optimizer."""
        from acc_train_deepspeed.meter import ZeroMeter

        return ZeroMeter(model)

    def memory_tracker(self, model: Any, optimizer: Any) -> Any | None:
        """``MemTracker`` with ZeRO's flat buffers (parameter, gradient and fp32 master
        partitions, reduction buckets) counted as what they are: torch's own sees none of them
        (:mod:`acc_train_deepspeed.simulate`). ``model`` is the ``DeepSpeedEngine``."""
        if getattr(model, "optimizer", None) is None or not hasattr(model, "zero_optimization_stage"):
            return None
        from acc_train_deepspeed.simulate import zero_memory_tracker

        return zero_memory_tracker(model)

    def summary(self, accelerator: Any) -> dict[str, Any]:
        """``zero_stage`` as the DeepSpeed engine runs it (None where no engine was built)."""
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        return {"zero_stage": wrapped.engine.zero_optimization_stage() if wrapped is not None else None}

    def low_precision_warning(self, dtype: str) -> str:
        """What ZeRO makes of parameters loaded in bf16/fp16 without its own bf16/fp16 mode
        (measured with DeepSpeed 0.19.8, see the plan's note)."""
        return (
            f"model.dtype: {dtype} under DeepSpeed ZeRO-{self._stage()} is not pure {dtype} training: "
            + _LOW_PRECISION_WEIGHTS[self._stage()].format(dtype=dtype)
            + ". For fp32 masters with bf16 compute use model.dtype: auto with training.mixed_precision: bf16 "
            "(DeepSpeed's bf16 mode); run.json's per-rank param_dtype and master_dtype show what was held and stepped"
        )

    def parameter_shards(self, machine: Machine) -> int:
        """ZeRO-3 partitions parameters over every rank; stages 0-2 keep them whole."""
        return machine.world_size if self._stage() == 3 else 1

    def _stage(self) -> int:
        """The ZeRO stage of these options, or of the ``config_file``'s ``zero_optimization``."""
        options = self.options
        if options.config_file is None:
            return options.zero_stage
        return ds_zero_stage(read_ds_config(options.config_file), options.config_file)

    def plan_memory(self, plan: PlanInput) -> MemoryPlan:
        """The ZeRO paper's accounting: parameters and gradients in the training precision
        (2 bytes each under bf16/fp16, 4 in fp32), and K = 12 bytes of optimizer state (fp32
        master partition, momentum, variance), which DeepSpeed keeps even in fp32 training.
        Measured in fp32: ZeRO-1 8psi + 12psi/N, ZeRO-2 4psi + 16psi/N, ZeRO-3 20psi/N."""
        from acc_train.api import MemoryPlan

        options = self.options
        psi, n = plan.parameters, plan.world_size
        stage = self._stage()  # a config_file's own checks run when the job starts
        # model.dtype bf16 without DeepSpeed's bf16 mode (measured): ZeRO-1/2 hold the parameters
        # and gradients in bf16 and still step fp32 master partitions; ZeRO-3 partitions in fp32
        p = g = 2 if plan.low_precision or (plan.low_precision_weights and stage < 3) else 4
        notes: list[str] = []
        if plan.low_precision_weights:
            notes.append(_LOW_PRECISION_WEIGHTS[stage].format(dtype=plan.dtype))
        if options.config_file is not None:
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
            notes.append("parameters under stage3_param_persistence_threshold are also kept whole")
        pinned, why = _experts_pinned(plan, stage, p)
        buffers, what = self._plan_buffers(stage, psi, n, p, g, grads, plan.largest_layer, plan.expert_parameters if pinned else 0)
        if what:
            notes.append(what)
        if pinned:
            buffers += pinned
            notes.append(why)
        offload: dict[str, str] = {}
        if options.offload_optimizer != "none":  # ZeRO-Offload: the gradient partition goes with the step
            offload["optimizer"] = options.offload_optimizer
            if stage >= 2:
                offload["grads"] = options.offload_optimizer
            notes.append(f"offload: the optimizer step runs on the CPU, its state in {options.offload_optimizer.upper()} memory")
        if options.offload_param != "none":
            offload["params"] = options.offload_param
            notes.append(f"parameter partitions in {options.offload_param.upper()} memory, gathered to the accelerator per layer")
        return MemoryPlan(params, grads, optim, formula, offload=offload, note="; ".join(notes), buffers=buffers)

    def _plan_buffers(self, stage: int, psi: int, n: int, p: int, g: int, grads: int, largest: int = 0, pinned: int = 0) -> tuple[int, str]:
        """What DeepSpeed allocates beside the ZeRO paper's model state, as ``plan --simulate``
        found it (BENCHMARKS.md): the reduction bucket, ``reduce_bucket_size`` elements allocated
        in full when the engine starts (``contiguous_gradients``, the default), whatever the
        model's size (what ``grads`` does not already count of it under ZeRO-2); under ZeRO-3
        also the gathered parameters it keeps alive for reuse, up to ``stage3_max_live_parameters``
        (DeepSpeed's default: 1.87 GiB of a 7B model's bf16 parameters at the simulated peak), and
        never less than the largest layer, which is gathered whole whatever that limit (a
        Mixtral-8x7B layer: 1.41e9 elements), with that layer's gradients made in full in
        backward before they are partitioned (``plan --simulate`` of a 4-layer Mixtral-8x7B shape
        with gradient checkpointing: 3.2 GiB of parameters and 3.6 of gradients beyond the
        partitions, issue 41). Where a mixture of experts' weights stay gathered anyway
        (``pinned`` elements, :func:`_experts_pinned`), the live parameters are the others."""
        if stage == 0 or self.options.config_file is not None:
            return 0, ""
        bucket = self.options.reduce_bucket_size or DEEPSPEED_REDUCE_BUCKET
        counted = max(0, grads - g * psi // n) if stage == 2 else 0  # ZeRO-2's gradients column holds one bucket
        total = max(0, g * bucket - counted) if self.options.contiguous_gradients is not False else 0
        parts = [f"the reduction bucket ({bucket:,} elements, reduce_bucket_size, allocated in full)"] if total else []
        if stage == 3:
            live = min(psi - pinned, DEEPSPEED_MAX_LIVE_PARAMETERS)
            total += p * (live if pinned else max(live, largest)) + g * largest
            parts.append(f"gathered parameters kept alive for reuse (up to {live:,} elements, stage3_max_live_parameters)")
            if largest > live and not pinned:
                parts.append(f"the largest layer gathered whole ({largest:,} elements, above stage3_max_live_parameters)")
            if largest:
                parts.append(f"the largest layer's gradients before they are partitioned ({largest:,} elements)")
        return total, ("buffers: " + " and ".join(parts)) if parts else ""


def _experts_pinned(plan: PlanInput, stage: int, p: int) -> tuple[int, str]:
    """Mixture-of-experts weights ZeRO-3 cannot release (issue 41, found by ``plan --simulate``):
    transformers hands every expert weight to ``grouped_mm`` as ``weight.transpose(-2, -1)``, a
    view of the gathered tensor, and autograd saves that view for backward. ZeRO-3's release
    swaps the parameter's ``.data`` for an empty tensor, which frees nothing while the view holds
    the storage: every layer's gathered experts (``p`` bytes each, the gathered dtype) stay from
    forward to backward. FSDP resizes its unsharded storage to zero, which frees it under the view;
    transformers' gradient checkpointing drops the saved view after each layer's forward."""
    if stage != 3 or not plan.expert_parameters or plan.gradient_checkpointing:
        return 0, ""
    pinned = p * plan.expert_parameters
    return pinned, (
        f"MoE experts pinned: transformers passes weight.transpose(-2, -1) (a view) to grouped_mm and autograd saves it, "
        f"so ZeRO-3's release frees nothing and every layer's gathered experts stay from forward to backward "
        f"({plan.expert_parameters:,} elements, {p} bytes each, counted in buffers); set training.gradient_checkpointing: true "
        "(each layer's experts regathered in backward) or use fsdp2, which frees them"
    )
