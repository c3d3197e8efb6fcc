"""The ``strategy:`` section for FSDP, validated strictly.

Options that only one FSDP version understands default to ``None`` ("the library's default");
setting one under the other version is an error that names the version supporting it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from acc_train.api import StrategyOptions

__all__ = ["FSDPOptions", "MixedPrecisionPolicy", "V1_ONLY", "V2_ONLY"]

Dtype = Literal["fp32", "bf16", "fp16"]


class MixedPrecisionPolicy(BaseModel):
    """Overrides what ``training.mixed_precision`` implies for FSDP's own casts."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    param_dtype: Dtype | None = Field(None, description="The dtype FSDP gathers parameters in for compute.")
    reduce_dtype: Dtype | None = Field(None, description="The dtype gradients are reduced in.")
    buffer_dtype: Dtype | None = Field(None, description="FSDP1: the dtype buffers are held in.")


#: option -> what it is called in the message
V1_ONLY = {
    "sharding_strategy": "sharding_strategy (use reshard_after_forward under FSDP2)",
    "backward_prefetch": "backward_prefetch",
    "forward_prefetch": "forward_prefetch",
    "sync_module_states": "sync_module_states",
    "use_orig_params": "use_orig_params",
}
#: mixed-precision fields FSDP2's MixedPrecisionPolicy does not have
V1_ONLY_PRECISION = {"buffer_dtype"}
V2_ONLY = {
    "reshard_after_forward": "reshard_after_forward (use sharding_strategy under FSDP1)",
    "dp_replicate": "dp_replicate (use sharding_strategy: hybrid_shard under FSDP1)",
    "dp_shard": "dp_shard",
    "tp": "tp (tensor parallelism)",
    "cp": "cp (context parallelism)",
    "cp_comm_strategy": "cp_comm_strategy (context parallelism)",
}


class FSDPOptions(StrategyOptions):
    version: Literal[1, 2] = Field(
        2,
        description=(
            "FSDP version: 2 (`fully_shard`, per-parameter DTensor sharding) or 1 "
            "(`FullyShardedDataParallel`)."
        ),
    )
    sharding_strategy: Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"] | None = Field(
        None,
        description="FSDP1: how parameters, gradients and optimizer state are sharded.",
    )
    reshard_after_forward: bool | None = Field(
        None,
        description=(
            "FSDP2: free the gathered parameters after forward (True = full shard, False = like "
            "shard_grad_op)."
        ),
    )
    auto_wrap_policy: str = Field(
        "transformer",
        description="A registered wrap policy: `transformer`, `size`, `none` or a plugin's.",
    )
    transformer_layer_cls_to_wrap: list[str] | None = Field(
        None,
        description=(
            "Layer classes wrapped as units by the `transformer` policy (default: the model's "
            "`_no_split_modules`)."
        ),
    )
    min_num_params: int | None = Field(
        None,
        ge=1,
        description="Minimum parameters of a unit for the `size` policy (default 100M).",
    )
    backward_prefetch: Literal["backward_pre", "backward_post", "none"] | None = Field(
        None,
        description="FSDP1: when to prefetch the next unit's parameters in backward.",
    )
    forward_prefetch: bool | None = Field(None, description="FSDP1: prefetch the next unit's parameters in forward.")
    cpu_offload: bool = Field(
        False,
        description="Keep parameters (and gradients) in CPU memory between uses; needs a GPU run to mean anything.",
    )
    activation_checkpointing: bool = Field(
        False,
        description=(
            "Recompute each layer's activations in backward instead of storing them: the same as "
            "`training.gradient_checkpointing` (either or both); for a model transformers cannot checkpoint, "
            "torch's checkpoint wrapper on each wrapped unit."
        ),
    )
    state_dict_type: Literal["sharded", "full"] = Field(
        "sharded",
        description="Checkpoint format: `sharded` (torch.distributed.checkpoint, one shard per rank) or `full`.",
    )
    cpu_ram_efficient_loading: bool = Field(
        False,
        description="Load pretrained weights on rank 0 only and broadcast them (large models on little RAM).",
    )
    sync_module_states: bool | None = Field(None, description="FSDP1: broadcast rank 0's module states at wrap time.")
    use_orig_params: bool | None = Field(
        None,
        description="FSDP1: keep the original parameters visible (needed by some optimizers and by freezing).",
    )
    mixed_precision_policy: MixedPrecisionPolicy | None = Field(
        None,
        description=(
            "FSDP's own casts, `{param_dtype, reduce_dtype, buffer_dtype}` (each `fp32`, `bf16` or `fp16`); "
            "overrides what `training.mixed_precision` implies."
        ),
    )
    dp_replicate: int | None = Field(
        None,
        ge=1,
        description=(
            "FSDP2 mesh (Accelerate's `ParallelismConfig`): replicas of the model, each sharded over "
            "`dp_shard` processes (HSDP when both are above 1; torchtitan's and Accelerate's names). Their "
            "product is the world size; set one and the other is the world size divided by it. Unset: every "
            "process shards the model (plain FSDP)."
        ),
    )
    dp_shard: int | None = Field(
        None,
        ge=1,
        description=(
            "FSDP2 mesh: processes each replica is sharded over (with `dp_replicate`: HSDP). Unset: the world"
            " size divided by the other sizes."
        ),
    )
    tp: int | None = Field(
        None,
        ge=1,
        description=(
            "FSDP2 mesh: tensor-parallel size, transformers' `tp_plan` of the model over `tp` processes that "
            "read the same batches (innermost mesh dimension); dp_replicate x dp_shard x tp is the world "
            "size. `tp` alone (dp_shard 1) is pure tensor parallelism, no FSDP."
        ),
    )
    cp: int | None = Field(
        None,
        ge=1,
        description=(
            "FSDP2 mesh: context-parallel size, torch's `context_parallel` (ring attention over SDPA) through"
            " Accelerate: each row's tokens are split over `cp` processes that read the same batches (between"
            " dp_shard and tp in the mesh), and FSDP shards over dp_shard x cp. dp_replicate x dp_shard x cp "
            "x tp is the world size. CUDA only (torch has no CPU kernel for it); needs `sdpa` attention, "
            "packed rows and `data.seq_len` divisible by 2 x cp."
        ),
    )
    cp_comm_strategy: Literal["allgather", "alltoall"] | None = Field(
        None,
        description=(
            "How context-parallel ranks exchange keys and values: `allgather` or `alltoall` (Accelerate's "
            "`cp_comm_strategy`; default: Accelerate's, allgather)."
        ),
    )

    @model_validator(mode="after")
    def _version_specific(self) -> FSDPOptions:
        wrong = V2_ONLY if self.version == 1 else V1_ONLY
        for key, label in wrong.items():
            if getattr(self, key) is not None:
                other = 2 if self.version == 1 else 1
                raise ValueError(f"{label} is an FSDP{other} option; this config runs FSDP{self.version} (strategy.version)")
        if self.cpu_ram_efficient_loading and self.version == 1 and self.sync_module_states is False:
            raise ValueError("cpu_ram_efficient_loading under FSDP1 needs sync_module_states: true")
        if self.use_orig_params is False:
            raise ValueError(
                "use_orig_params: false leaves an optimizer built before wrapping pointing at parameters that get no "
                "gradients; acc-train builds the optimizer first, so it needs use_orig_params: true"
            )
        if self.mixed_precision_policy is not None and self.version == 2:
            for key in V1_ONLY_PRECISION:
                if getattr(self.mixed_precision_policy, key) is not None:
                    raise ValueError(f"mixed_precision_policy.{key} is an FSDP1 option; FSDP2 keeps buffers in their own dtype")
        if self.cp_comm_strategy is not None and self.cp in (None, 1):
            raise ValueError("cp_comm_strategy is used by context parallelism only (set cp above 1, or drop it)")
        if self.activation_checkpointing and self.auto_wrap_policy == "none":
            raise ValueError("activation_checkpointing needs a wrap policy that selects layers (auto_wrap_policy is none)")
        if self.min_num_params is not None and self.auto_wrap_policy != "size":
            raise ValueError(f"min_num_params is used by the size wrap policy only (auto_wrap_policy is {self.auto_wrap_policy!r})")
        if self.transformer_layer_cls_to_wrap is not None and self.auto_wrap_policy != "transformer":
            raise ValueError(
                f"transformer_layer_cls_to_wrap is used by the transformer wrap policy only (auto_wrap_policy is {self.auto_wrap_policy!r})"
            )
        return self
