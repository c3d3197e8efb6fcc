"""The ``deepspeed`` strategy: ZeRO stage 1/2/3 (optimizer state, gradients, parameters sharded).

On GPUs this is Accelerate's own DeepSpeed path. On CPU, Accelerate refuses DeepSpeed and
silently runs DDP; the strategy switches its state to DEEPSPEED through
:mod:`acc_train.accelerate_compat`, and DeepSpeed's CPU accelerator trains over gloo.

Batch size, gradient accumulation and clipping have one source of truth: the job's
``training`` section.
"""

from __future__ import annotations

from typing import Any

from acc_train.api import ModelStateMeter, Strategy, UserError
from acc_train_deepspeed.config import ds_zero_stage, load_ds_config, read_ds_config
from acc_train_deepspeed.launch import DeepSpeedLaunch
from acc_train_deepspeed.options import DeepSpeedOptions, ds_config
from acc_train_deepspeed.planning import DeepSpeedPlanner

__all__ = ["DeepSpeedOptions", "DeepSpeedStrategy"]


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

    def planner(self) -> DeepSpeedPlanner:
        return DeepSpeedPlanner(self)

    def launch_protocol(self) -> DeepSpeedLaunch:
        return DeepSpeedLaunch(self)

    def check_environment(self) -> None:
        options, machine = self.options, self.machine
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
            from acc_train.api import resolve_mixed_precision

            precision = resolve_mixed_precision(training.mixed_precision if training else "auto", self.machine)
            mbs = training.micro_batch_size if training else "auto"
            from_file = load_ds_config(options.config_file, mbs, gas, clip, precision)
            stage = ds_zero_stage(from_file, options.config_file)
            return {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=from_file, zero3_init_flag=stage == 3)}
        config = ds_config(options, gas, clip)
        plugin = DeepSpeedPlugin(
            hf_ds_config=config,
            zero3_init_flag=bool(options.zero3_init_flag) if options.zero_stage == 3 else False,
        )
        return {"deepspeed_plugin": plugin}

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
        if self.machine.device_type != "cpu":
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

    def clip_grad_norm(self, accelerator: Any, max_norm: float) -> Any:
        """The engine clips inside its step (its config's ``gradient_clipping``) and keeps the
        norm it measured; Accelerate's ``clip_grad_norm_`` reads it back to the host
        (``.item()``) on every call. Here it stays where DeepSpeed left it, so a step that logs
        nothing waits for nothing."""
        wrapped = accelerator.deepspeed_engine_wrapped
        return None if wrapped is None else wrapped.engine.get_global_grad_norm()

    def expected_distributed_types(self) -> set[str]:
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

    def summary(self, accelerator: Any) -> dict[str, Any]:
        """``zero_stage`` as the DeepSpeed engine runs it (None where no engine was built)."""
        wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
        return {"zero_stage": wrapped.engine.zero_optimization_stage() if wrapped is not None else None}


