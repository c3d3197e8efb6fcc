"""``acc-train launch`` under DeepSpeed: Accelerate's DeepSpeed variables for the options, or a
DeepSpeed JSON written for the launch where no variable carries one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from acc_train.api import LaunchProtocol
from acc_train_deepspeed.config import ds_zero_stage, read_ds_config
from acc_train_deepspeed.options import ds_config

if TYPE_CHECKING:
    from acc_train_deepspeed.strategy import DeepSpeedStrategy

__all__ = ["DeepSpeedLaunch"]


class DeepSpeedLaunch(LaunchProtocol["DeepSpeedStrategy"]):
    launch_variables = (
        "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_", "ACCELERATE_CONFIG_DS_FIELDS",
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING",
    )  # fmt: skip
    accelerator_arguments = ("deepspeed_plugin", "deepspeed_plugins")

    #: options no ``accelerate launch`` variable carries: a DeepSpeed JSON written for the launch carries them
    JSON_ONLY = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size", "nvme_path")

    def launch_env(self, scratch: Any) -> dict[str, str]:
        """``accelerate launch``'s DeepSpeed variables for the options (Accelerate's
        ``prepare_deepspeed_cmd_env``). ``config_file`` is named by
        ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` as given (its ``"auto"`` values are filled by
        Accelerate or the program's Trainer, as under ``accelerate launch``). Options no variable
        carries (:attr:`JSON_ONLY`) go into a DeepSpeed JSON written for the launch in
        ``scratch`` and named the same way; then the stage and offload travel in it too (Accelerate
        refuses to read them twice). Batch size, accumulation and clipping stay ``"auto"``: the
        program's (or its Trainer's) values fill them; where nothing does by the time the model
        is prepared, :meth:`DeepSpeedStrategy.before_prepare` turns clipping off, as DDP does not clip."""
        import json

        options = self.strategy.options
        env = {"ACCELERATE_USE_DEEPSPEED": "true"}
        if options.config_file is not None:
            import os

            ds_zero_stage(read_ds_config(options.config_file), options.config_file)
            env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = os.path.abspath(options.config_file)
            return env
        stage = options.zero_stage
        init = "true" if stage == 3 and options.zero3_init_flag else "false"
        if any(getattr(options, key) is not None for key in self.JSON_ONLY):
            config = ds_config(options, gas="auto", clip="auto")
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
