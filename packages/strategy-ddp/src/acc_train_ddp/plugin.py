"""The ``ddp`` strategy: every rank holds the whole model; gradients are all-reduced.

No torch or accelerate import at module level: listing strategies stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from acc_train.api import LaunchProtocol, Question, Strategy, StrategyOptions, StrategyPlanner, UserError, hookimpl, warn_once_per_machine

__all__ = ["DDPOptions", "DDPStrategy", "DDPPlanner", "DDPLaunch"]


class DDPOptions(StrategyOptions):
    bucket_cap_mb: int = Field(25, ge=1, description="Gradient bucket size in MiB (DDP's `bucket_cap_mb`).")
    find_unused_parameters: bool = Field(
        False,
        description="DDP's `find_unused_parameters`: needed when some parameters get no gradient in a step.",
    )
    gradient_as_bucket_view: bool = Field(
        False,
        description=(
            "DDP's `gradient_as_bucket_view`: gradients are views into the all-reduce buckets (saves one "
            "copy)."
        ),
    )
    static_graph: bool = Field(False, description="DDP's `static_graph`: the set of used parameters is the same every step.")
    broadcast_buffers: bool = Field(
        True,
        description="DDP's `broadcast_buffers`: rank 0's buffers are broadcast at every forward.",
    )
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none",
        description="Gradient communication hook: compress gradients before the all-reduce.",
    )
    powersgd_rank: int = Field(1, ge=1, description="PowerSGD's matrix approximation rank.")
    powersgd_start_iter: int = Field(2, ge=1, description="Steps of plain all-reduce before PowerSGD compression starts.")


class DDPStrategy(Strategy[DDPOptions]):
    name = "ddp"
    aliases = ("data-parallel",)
    description = "PyTorch DistributedDataParallel: full replica per rank, all-reduced gradients"
    options_schema = DDPOptions
    checkpoint_format = "dcp"
    accelerate_distributed_types = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU")

    def check_environment(self) -> None:
        options, machine = self.options, self.machine
        if options.comm_hook == "fp16" and machine.device_type == "cpu" and machine.world_size > 1:
            raise UserError(
                "the fp16 compression hook needs GPUs (gloo cannot all-reduce fp16 on CPU)",
                where="strategy.comm_hook",
                hint="use comm_hook: bf16 or none on CPU",
            )

    def planner(self) -> DDPPlanner:
        return DDPPlanner(self)

    def launch_protocol(self) -> DDPLaunch:
        return DDPLaunch(self)

    def after_accelerator(self, accelerator: Any) -> None:
        """In a program ``acc-train launch`` runs unchanged, the options (if any differs from
        DDP's defaults) become the Accelerator's ``DistributedDataParallelKwargs``, unless the
        program passed its own: then the program's win, with a warning."""
        if not getattr(accelerator, "acc_launched", False) or self.options == DDPOptions():
            return
        if accelerator.ddp_handler is not None:
            warn_once_per_machine(
                "the program's own DistributedDataParallelKwargs replaces the ddp strategy's options "
                f"({', '.join(k for k, v in self.options if v != getattr(DDPOptions(), k))}) given to acc-train launch"
            )
            return
        (accelerator.ddp_handler,) = self.accelerator_kwargs(None)["kwargs_handlers"]

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

        options = self.options
        hook = {
            "none": DDPCommunicationHookType.NO,
            "fp16": DDPCommunicationHookType.FP16,
            "bf16": DDPCommunicationHookType.BF16,
            "powersgd": DDPCommunicationHookType.POWER_SGD,
        }[options.comm_hook]
        state = (
            {"matrix_approximation_rank": options.powersgd_rank, "start_powerSGD_iter": options.powersgd_start_iter}
            if options.comm_hook == "powersgd"
            else {}
        )
        handler = DistributedDataParallelKwargs(
            bucket_cap_mb=options.bucket_cap_mb,
            find_unused_parameters=options.find_unused_parameters,
            gradient_as_bucket_view=options.gradient_as_bucket_view,
            static_graph=options.static_graph,
            broadcast_buffers=options.broadcast_buffers,
            comm_hook=hook,
            comm_state_option=state,
        )
        return {"kwargs_handlers": [handler]}


class DDPPlanner(StrategyPlanner[DDPStrategy]):
    """A replica on every rank (the default plan)."""

    def equivalent_to_ddp(self) -> bool:
        return self.options.comm_hook == "none"  # compression changes the all-reduced gradients


class DDPLaunch(LaunchProtocol[DDPStrategy]):
    def launch_env(self, scratch: Any) -> dict[str, str]:
        """None: ``accelerate launch`` runs DDP with no variable of its own, and no variable
        carries DDP's options; :meth:`DDPStrategy.after_accelerator` applies them in the worker."""
        return {}


@hookimpl
def acc_train_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(DDPStrategy())


@hookimpl
def acc_train_config_questions(strategy_name: str) -> list[Question] | None:
    if strategy_name != DDPStrategy.name:
        return None
    return [
        Question("bucket_cap_mb", "Gradient bucket size in MiB", default=25),
        Question(
            "comm_hook",
            "Compress gradients before the all-reduce",
            default="none",
            choices=("none", "fp16", "bf16", "powersgd"),
            help="fp16 needs GPUs; bf16 and powersgd work on CPU too",
        ),
        Question("powersgd_rank", "PowerSGD approximation rank", default=1, when=lambda a: a.get("comm_hook") == "powersgd"),
        Question("find_unused_parameters", "Does the model have parameters that get no gradient some steps?", default=False, choices=(False, True)),
    ]
