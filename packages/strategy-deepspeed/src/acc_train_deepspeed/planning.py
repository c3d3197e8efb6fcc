"""What ``acc-train plan``, ``plan --simulate`` and the conformance kit ask of DeepSpeed: the ZeRO
paper's accounting with the buffers DeepSpeed allocates beside it, how ZeRO splits the
parameters, the tracker that sees its flat buffers, and what it keeps of low-precision weights."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from acc_train.api import Machine, StrategyPlanner
from acc_train_deepspeed.options import zero_stage_of

if TYPE_CHECKING:
    from acc_train.api import MemoryPlan, PlanInput
    from acc_train_deepspeed.strategy import DeepSpeedStrategy

__all__ = ["DeepSpeedPlanner", "experts_pinned", "DEEPSPEED_REDUCE_BUCKET", "DEEPSPEED_MAX_LIVE_PARAMETERS"]

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


class DeepSpeedPlanner(StrategyPlanner["DeepSpeedStrategy"]):
    def equivalent_to_ddp(self) -> bool:
        return self.options.config_file is None  # a user's JSON may set its own precision or optimizer

    def memory_tracker(self, model: Any, optimizer: Any) -> Any | None:
        """``MemTracker`` with ZeRO's flat buffers (parameter, gradient and fp32 master
        partitions, reduction buckets) counted as what they are: torch's own sees none of them
        (:mod:`acc_train_deepspeed.simulate`). ``model`` is the ``DeepSpeedEngine``."""
        if getattr(model, "optimizer", None) is None or not hasattr(model, "zero_optimization_stage"):
            return None
        from acc_train_deepspeed.simulate import zero_memory_tracker

        return zero_memory_tracker(model)

    def low_precision_warning(self, dtype: str) -> str:
        """What ZeRO makes of parameters loaded in bf16/fp16 without its own bf16/fp16 mode
        (measured with DeepSpeed 0.19.8, see the plan's note)."""
        return (
            f"model.dtype: {dtype} under DeepSpeed ZeRO-{zero_stage_of(self.options)} is not pure {dtype} training: "
            + _LOW_PRECISION_WEIGHTS[zero_stage_of(self.options)].format(dtype=dtype)
            + ". For fp32 masters with bf16 compute use model.dtype: auto with training.mixed_precision: bf16 "
            "(DeepSpeed's bf16 mode); run.json's per-rank param_dtype and master_dtype show what was held and stepped"
        )

    def parameter_shards(self, machine: Machine) -> int:
        """ZeRO-3 partitions parameters over every rank; stages 0-2 keep them whole."""
        return machine.world_size if zero_stage_of(self.options) == 3 else 1

    def plan_memory(self, plan: PlanInput) -> MemoryPlan:
        """The ZeRO paper's accounting: parameters and gradients in the training precision
        (2 bytes each under bf16/fp16, 4 in fp32), and K = 12 bytes of optimizer state (fp32
        master partition, momentum, variance), which DeepSpeed keeps even in fp32 training.
        Measured in fp32: ZeRO-1 8psi + 12psi/N, ZeRO-2 4psi + 16psi/N, ZeRO-3 20psi/N."""
        from acc_train.api import MemoryPlan

        options = self.options
        psi, n = plan.parameters, plan.world_size
        stage = zero_stage_of(options)  # a config_file's own checks run when the job starts
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
        pinned, why = experts_pinned(plan, stage, p)
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
        (``pinned`` elements, :func:`experts_pinned`), the live parameters are the others."""
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


def experts_pinned(plan: PlanInput, stage: int, p: int) -> tuple[int, str]:
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
