"""``acc-train launch`` under FSDP: Accelerate's FSDP variables for the options, and the refusal
of a program's own plugin written for the other FSDP version."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from acc_train.api import LaunchProtocol, UserError
from acc_train_fsdp.policies import DEFAULT_MIN_NUM_PARAMS

if TYPE_CHECKING:
    from acc_train_fsdp.strategy import FSDPStrategy

__all__ = ["FSDPLaunch"]


class FSDPLaunch(LaunchProtocol["FSDPStrategy"]):
    launch_variables = ("ACCELERATE_USE_FSDP", "FSDP_", "ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_")
    accelerator_arguments = ("fsdp_plugin",)

    def launch_env(self, scratch: Any) -> dict[str, str]:
        """``accelerate launch``'s FSDP variables for the options (Accelerate's
        ``prepare_multi_gpu_env``). No variable carries ``mixed_precision_policy``, a wrap policy
        a plugin registered, or the mesh (``dp_replicate``, ``dp_shard``, ``tp``, ``cp``): each is
        refused by name, with what to do in the program instead."""
        options = self.strategy.options
        for name in ("dp_replicate", "dp_shard", "tp", "cp"):
            if getattr(options, name) is not None:
                raise UserError(
                    f"strategy.{name} (the device mesh) has no `accelerate launch` variable that acc-train exports, "
                    "and a program launched unchanged builds its own mesh",
                    where=f"strategy.{name}",
                    hint="pass accelerate's ParallelismConfig to Accelerator(parallelism_config=...) in your program, "
                    "or train through a job config (acc-train --config JOB.yaml), where the mesh options apply",
                )
        if options.mixed_precision_policy is not None:
            raise UserError(
                "strategy.mixed_precision_policy has no `accelerate launch` variable",
                where="strategy.mixed_precision_policy",
                hint="drop it (--mixed-precision sets FSDP's casts), or pass FullyShardedDataParallelPlugin("
                "mixed_precision_policy=...) to Accelerator(fsdp_plugin=...) in your program",
            )
        from acc_train.api import wrap_policies

        policy = wrap_policies().get(options.auto_wrap_policy).name
        if policy not in ("transformer", "size", "none"):
            raise UserError(
                f"wrap policy {policy!r} is a plugin's, which no `accelerate launch` variable can name",
                where="strategy.auto_wrap_policy",
                hint="use transformer, size or none with acc-train launch, or pass the policy to "
                "FullyShardedDataParallelPlugin(auto_wrap_policy=...) in your program",
            )
        kwargs = self.strategy.plugin_kwargs(self.strategy.machine.device_type == "cpu", None)

        def flag(value: Any) -> str:
            return str(bool(value)).lower()

        env = {
            "ACCELERATE_USE_FSDP": "true",
            "FSDP_VERSION": str(kwargs["fsdp_version"]),
            "FSDP_OFFLOAD_PARAMS": flag(kwargs["cpu_offload"]),
            "FSDP_ACTIVATION_CHECKPOINTING": flag(kwargs["activation_checkpointing"]),
            "FSDP_STATE_DICT_TYPE": kwargs["state_dict_type"],
            "FSDP_CPU_RAM_EFFICIENT_LOADING": flag(kwargs["cpu_ram_efficient_loading"]),
        }
        if options.version == 1:
            env["FSDP_SHARDING_STRATEGY"] = kwargs["sharding_strategy"]
            env["FSDP_BACKWARD_PREFETCH"] = kwargs["backward_prefetch"] or "NO_PREFETCH"
            env["FSDP_FORWARD_PREFETCH"] = flag(kwargs["forward_prefetch"])
            env["FSDP_SYNC_MODULE_STATES"] = flag(kwargs["sync_module_states"])
            env["FSDP_USE_ORIG_PARAMS"] = flag(kwargs["use_orig_params"])
        else:
            env["FSDP_RESHARD_AFTER_FORWARD"] = flag(kwargs["reshard_after_forward"])
        if policy == "transformer":
            env["FSDP_AUTO_WRAP_POLICY"] = "TRANSFORMER_BASED_WRAP"  # no classes: the model's _no_split_modules
            if options.transformer_layer_cls_to_wrap:
                env["FSDP_TRANSFORMER_CLS_TO_WRAP"] = ",".join(options.transformer_layer_cls_to_wrap)
        elif policy == "size":
            env["FSDP_AUTO_WRAP_POLICY"] = "SIZE_BASED_WRAP"
            env["FSDP_MIN_NUM_PARAMS"] = str(options.min_num_params or DEFAULT_MIN_NUM_PARAMS)
        else:
            env["FSDP_AUTO_WRAP_POLICY"] = "NO_WRAP"
        return env

    def before_program(self) -> None:
        """A program that builds its own ``FullyShardedDataParallelPlugin`` for the other FSDP
        version than the one launched is refused as the plugin is built (Accelerate would raise
        a ValueError from inside it, or, given ``fsdp_version`` itself, run the other version):
        the program's plugin is followed otherwise, so a silent switch of version is the only
        alternative, and the launch asked for this one."""
        from accelerate.utils import dataclasses as accelerate_dataclasses

        from acc_train_fsdp.program_plugin import refuse_other_version

        plugin_class = accelerate_dataclasses.FullyShardedDataParallelPlugin
        original = plugin_class.__post_init__
        launched = self.strategy.options.version
        name = self.strategy.name if launched == 2 else "fsdp1"

        @functools.wraps(original)
        def __post_init__(plugin: Any) -> None:
            refuse_other_version(plugin, launched, name)
            original(plugin)

        plugin_class.__post_init__ = __post_init__
