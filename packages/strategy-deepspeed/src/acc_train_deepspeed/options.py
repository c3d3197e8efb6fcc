"""The ``strategy:`` section for DeepSpeed, validated strictly, and the DeepSpeed config it makes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from acc_train.api import StrategyOptions
from acc_train_deepspeed.config import ds_zero_stage, read_ds_config

__all__ = ["DeepSpeedOptions", "ZERO_KEYS", "ds_config", "zero_stage_of"]

Offload = Literal["none", "cpu", "nvme"]

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


def zero_stage_of(options: DeepSpeedOptions) -> int:
    """The ZeRO stage of the options, or of the ``config_file``'s ``zero_optimization``."""
    if options.config_file is None:
        return options.zero_stage
    return ds_zero_stage(read_ds_config(options.config_file), options.config_file)


def ds_config(options: DeepSpeedOptions, gas: Any, clip: Any) -> dict[str, Any]:
    """The DeepSpeed config of the options (no ``config_file``)."""
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
