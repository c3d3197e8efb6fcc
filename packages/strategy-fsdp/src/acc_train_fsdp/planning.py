"""What ``acc-train plan``, ``plan --simulate`` and the conformance kit ask of FSDP: the memory a
rank holds under each sharding, how the parameters are split, and FSDP2's memory tracker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from acc_train.api import Machine, StrategyPlanner
from acc_train_fsdp.mesh import Mesh
from acc_train_fsdp.options import FSDPOptions

if TYPE_CHECKING:
    from acc_train.api import MemoryPlan, PlanInput
    from acc_train_fsdp.strategy import FSDPStrategy

__all__ = ["FSDPPlanner", "sharding"]


def sharding(options: FSDPOptions) -> str:
    """FSDP1's sharding strategy, or what FSDP2's ``reshard_after_forward`` amounts to."""
    if options.version == 1:
        return options.sharding_strategy or "full_shard"
    return "full_shard" if options.reshard_after_forward in (None, True) else "shard_grad_op"


class FSDPPlanner(StrategyPlanner["FSDPStrategy"]):
    def equivalent_to_ddp(self) -> bool:
        options = self.options
        # its own casts change the arithmetic; context parallelism drops the packed rows' masks
        return options.mixed_precision_policy is None and options.cp in (None, 1)

    def memory_tracker(self, model: Any, optimizer: Any) -> Any | None:
        """``FSDPMemTracker`` for a model ``fully_shard`` prepared (FSDP2); the default otherwise."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule):
            return None
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, getattr(optimizer, "optimizer", optimizer))  # the torch optimizer inside Accelerate's wrapper

    def parameter_shards(self, machine: Machine) -> int:
        """The world size; the processes per machine under hybrid sharding; ``dp_shard`` x ``cp``
        x ``tp`` on a mesh (FSDP shards over dp_shard x cp); 1 under no_shard."""
        mesh = Mesh.of(self.options, machine.world_size)
        if mesh is not None:
            return mesh.shards
        how = sharding(self.options)
        if how == "no_shard":
            return 1
        if how.startswith("hybrid_shard"):
            return max(1, machine.world_size // max(1, machine.num_machines))
        return machine.world_size

    def plan_variants(self) -> dict[str, dict[str, Any]]:
        """The presets, and FSDP1's shard_grad_op (ZeRO-2-like), which has no preset."""
        return {**super().plan_variants(), "fsdp1-shard_grad_op": {"version": 1, "sharding_strategy": "shard_grad_op"}}

    def plan_memory(self, plan: PlanInput) -> MemoryPlan:
        """Parameters, gradients and Adam's moments, all fp32 (under bf16 FSDP casts the
        gathered copy only), sharded 1/N; shard_grad_op keeps the gathered parameters from
        forward to backward. Measured in fp32: 16psi/N (BENCHMARKS.md). Under ``model.dtype:
        bf16`` the shards, gradients and moments are 2 bytes (measured: 8psi/N)."""
        from acc_train.api import MemoryPlan, replicated

        options = self.options
        psi, n, b, o = plan.parameters, plan.world_size, plan.param_bytes, plan.optimizer_bytes
        how = sharding(options)
        if how == "no_shard":
            return replicated(plan, note="no_shard: a replica on every rank, as DDP")
        if how.startswith("hybrid_shard"):  # sharded within a machine, replicated across machines
            n = plan.local_world_size or n
            how = "shard_grad_op" if how == "hybrid_shard_zero2" else "full_shard"
        shape = Mesh.of(options, n) if (options.dp_replicate or options.dp_shard or options.tp or options.cp) else None
        mesh = shape.sizes if shape is not None else None
        if shape is not None:  # HSDP: each replica shards over dp_shard (x cp) processes; tp cuts each shard again
            n = shape.shards
        offload = {"params": "cpu", "grads": "cpu", "optimizer": "cpu"} if options.cpu_offload else {}
        notes = ["N = processes per machine (hybrid sharding)"] if n != plan.world_size and mesh is None else []
        if mesh is not None:
            cp = f" x cp={mesh['cp']}" if "cp" in mesh else ""
            tp = f" x tp={mesh['tp']}" if "tp" in mesh else ""
            factors = "dp_shard" + (" x cp" if cp else "") + (" x tp" if tp else "")
            whole = " (norm weights whole on each tp rank)" if tp else ""
            notes.append(f"mesh dp_replicate={mesh['dp_replicate']} x dp_shard={mesh['dp_shard']}{cp}{tp}: N = {factors}{whole}")
            if cp:
                notes.append("activations: each rank runs 1/cp of every row (s = seq_len / cp)")
        gathered = 2 if plan.low_precision or plan.low_precision_weights else 4
        if how == "shard_grad_op":
            params = b * psi // n + gathered * psi
            formula = f"({b}psi/N + {gathered}psi) + {b}psi/N + {o:g}psi/N = {gathered}psi + {2 * b + o:g}psi/N"
            notes.append(f"parameters: the {b}psi/N shard plus the gathered {gathered}psi kept from forward to backward")
        else:
            params = b * psi // n
            formula = f"{b}psi/N + {b}psi/N + {o:g}psi/N = {2 * b + o:g}psi/N"
            if not plan.largest_layer:  # the buffers below say it in bytes where the block is known
                notes.append("+ one wrapped unit's parameters, gathered while it computes")
        if plan.low_precision_weights:
            notes.append(f"model.dtype {plan.dtype}: shards, gradients and moments are {plan.dtype}, no fp32 master copy")
        if options.cpu_offload:
            notes.append("offload: parameters, gradients and optimizer steps in CPU memory")
        split = {"sequence_split": mesh.get("cp", 1), "tensor_split": mesh.get("tp", 1)} if mesh is not None else {}
        # the block that computes, gathered in the compute dtype, its all-gather buffer and the
        # reduce-scatter buffer of its gradients: FSDPMemTracker's Unsharded Param, All Gather and
        # Reduce Scatter at the peak of a simulated 7B step (plan --simulate, BENCHMARKS.md);
        # shard_grad_op keeps the gathered parameters in `params` already
        tp = mesh.get("tp", 1) if mesh is not None else 1
        units = 2 if how == "shard_grad_op" else 3
        buffers = units * gathered * plan.largest_layer // tp
        if buffers:
            what = "its all-gather buffer and" if how == "shard_grad_op" else "the block gathered, its all-gather buffer and"
            notes.append(f"buffers: for the largest block ({plan.largest_layer:,} elements, {gathered} bytes each), {what} the reduce-scatter buffer of its gradients")
        return MemoryPlan(
            params, b * psi // n, int(o * psi) // n, formula, offload=offload, note="; ".join(notes), recompute=options.activation_checkpointing,
            buffers=buffers, **split,
        )
