"""FSDP's device mesh as one value: the sizes of its dimensions for a world, validated once
(torchtitan's ``ParallelDims``), what Accelerate builds from them, and the live mesh as
``run.json`` records it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from acc_train.api import UserError
from acc_train_fsdp.options import FSDPOptions

__all__ = ["Mesh", "FSDP_ONLY", "live_mesh_summary"]

#: FSDP's own options, which tensor parallelism alone (no FSDP) would not use
FSDP_ONLY = ("activation_checkpointing", "mixed_precision_policy", "reshard_after_forward", "cpu_ram_efficient_loading", "cpu_offload")


@dataclass(frozen=True)
class Mesh:
    """The mesh's sizes: data-parallel replicas x shards x context- x tensor-parallel groups,
    whose product is the world size."""

    dp_replicate: int
    dp_shard: int
    cp: int = 1
    tp: int = 1

    @classmethod
    def of(cls, options: FSDPOptions, world_size: int) -> Mesh | None:
        """The mesh for a run of ``world_size`` processes when the options ask for one (an unset
        data-parallel size is the world size divided by cp x tp and the other); None for plain
        FSDP. Sizes whose product is not the world size, and combinations that cannot run, are
        a UserError naming the option."""
        replicate, shard, tp, cp = options.dp_replicate, options.dp_shard, options.tp or 1, options.cp or 1
        if replicate is None and shard is None and tp == 1 and cp == 1:
            return None
        for name, size in (("tp", tp), ("cp", cp)):
            if world_size % size:
                raise UserError(
                    f"{name}: {size} does not divide the world size ({world_size} processes)",
                    where=f"strategy.{name}",
                    hint=f"choose a divisor of {world_size}, or change --num-processes / --num-machines",
                )
        if world_size % (tp * cp):
            raise UserError(
                f"cp x tp = {cp} x {tp} = {cp * tp} does not divide the world size ({world_size} processes)",
                where="strategy.cp",
                hint=f"make cp x tp a divisor of {world_size}",
            )
        data = world_size // (tp * cp)  # processes that read different batches
        inner = " x ".join(n for n, size in (("cp", cp), ("tp", tp)) if size > 1)
        per = f"the world size / {inner} ({world_size} / {tp * cp} = {data})" if tp * cp > 1 else f"the world size ({world_size} processes)"
        if replicate is None and shard is None:
            replicate, shard = 1, data
        elif replicate is None or shard is None:
            given, size = ("dp_replicate", replicate) if shard is None else ("dp_shard", shard)
            if data % size:  # type: ignore[operator]
                raise UserError(
                    f"{given}: {size} does not divide {per}",
                    where=f"strategy.{given}",
                    hint=f"choose a divisor of {data}, or change --num-processes / --num-machines",
                )
            other = data // size  # type: ignore[operator]
            replicate, shard = (size, other) if shard is None else (other, size)
        if replicate * shard * cp * tp != world_size:
            dims = [("dp_replicate", replicate), ("dp_shard", shard), ("cp", cp), ("tp", tp)]
            dims = [(n, size) for n, size in dims if n.startswith("dp") or size > 1]
            names, sizes = " x ".join(n for n, _ in dims), " x ".join(str(size) for _, size in dims)
            raise UserError(
                f"{names} = {sizes} = {replicate * shard * cp * tp}, and the run has {world_size} processes",
                where="strategy.dp_replicate",
                hint=f"make the product {world_size} (processes per machine x machines), or set only one of them",
            )
        if tp > 1 and replicate > 1 and shard == 1:
            raise UserError(
                "dp_replicate above 1 with tp and no dp_shard replicates tensor-parallel models without syncing their "
                "gradients (Accelerate wraps no DDP around a tensor-parallel model)",
                where="strategy.dp_replicate",
                hint=f"use dp_shard: {replicate} instead (FSDP x TP), or dp_replicate with dp_shard above 1 (HSDP x TP)",
            )
        if tp > 1 and options.version == 2 and options.cpu_offload:
            raise UserError("cpu_offload with tp (FSDP x TP offloading) was not tried", where="strategy.tp", hint="drop cpu_offload or tp")
        if cp > 1 and replicate > 1 and shard == 1:
            raise UserError(
                "dp_replicate above 1 with cp and no dp_shard: Accelerate refuses context parallelism with pure data parallelism",
                where="strategy.dp_replicate",
                hint=f"use dp_shard: {replicate} instead (FSDP x CP), or dp_replicate with dp_shard above 1 (HSDP x CP)",
            )
        return cls(replicate, shard, cp, tp)

    @property
    def sizes(self) -> dict[str, int]:
        """``{"dp_replicate": R, "dp_shard": S}``, and ``"cp": C``, ``"tp": T`` when above 1."""
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, **{n: size for n, size in (("cp", self.cp), ("tp", self.tp)) if size > 1}}

    @property
    def pure_tp(self) -> bool:
        """Tensor parallelism alone (``tp`` is the world size): no FSDP, Accelerate's plain
        multi-process type with the mesh (Accelerate refuses FSDP with nothing to shard over)."""
        return self.tp > 1 and self.cp == 1 and self.dp_replicate == self.dp_shard == 1

    @property
    def shards(self) -> int:
        """Into how many parts each replica's parameters are cut: FSDP shards over dp_shard x cp,
        and tp cuts each shard again."""
        return self.dp_shard * self.cp * self.tp

    def refuse_fsdp_options(self, options: FSDPOptions, world_size: int) -> None:
        """Refuse FSDP's own options (:data:`FSDP_ONLY`) set where tensor parallelism runs alone."""
        if not self.pure_tp:
            return
        for name in FSDP_ONLY:
            if getattr(options, name) != type(options).model_fields[name].default:  # set to anything but "unset"
                raise UserError(
                    f"{name} is an FSDP option, and tp: {options.tp} on {world_size} processes is tensor parallelism alone (no FSDP), which would not use it",
                    where=f"strategy.{name}",
                    hint="drop it, or add dp_shard (FSDP x TP) so FSDP runs",
                )

    def parallelism_config(self, cp_comm_strategy: str | None) -> Any:
        """Accelerate's ``ParallelismConfig`` for the mesh."""
        from accelerate.parallelism_config import ParallelismConfig

        cp: dict[str, Any] = {}
        if self.cp > 1:  # torch's context_parallel; the exchange Accelerate's default (not the shell's PARALLELISM_CONFIG_*) unless set
            from accelerate.utils import TorchContextParallelConfig

            cp = {"cp_size": self.cp, "cp_handler": TorchContextParallelConfig(cp_comm_strategy=cp_comm_strategy or "allgather")}
        return ParallelismConfig(dp_replicate_size=self.dp_replicate, dp_shard_size=self.dp_shard, tp_size=self.tp, **cp)


def live_mesh_summary(accelerator: Any) -> dict[str, Any] | None:
    """The device mesh the model was sharded over: its dimensions, and each rank's coordinates
    in it (rank -> {dimension: index}), from the live mesh."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None or not mesh.mesh_dim_names:
        return None
    names = [n for n in mesh.mesh_dim_names]
    grid = mesh.mesh.tolist()
    coordinates: dict[str, dict[str, int]] = {}

    def walk(node: Any, index: list[int]) -> None:
        if isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, [*index, i])
        else:
            coordinates[str(node)] = dict(zip(names, index))

    walk(grid, [])
    return {"shape": dict(zip(names, mesh.mesh.shape)), "coordinates": coordinates}
