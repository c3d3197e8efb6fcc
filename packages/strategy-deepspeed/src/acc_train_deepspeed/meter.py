"""Model-state bytes of one rank under ZeRO, read from DeepSpeed's own buffers."""

from __future__ import annotations

from typing import Any

from acc_train.api import ModelStateMeter, dtype_name, local_nbytes

__all__ = ["ZeroMeter"]


class ZeroMeter(ModelStateMeter):
    """Model-state bytes of one rank under ZeRO, counted from DeepSpeed's own buffers.

    - parameters: the module's trainable parameters (under stage 3, this rank's partition
      ``ds_tensor``); frozen ones (LoRA's base) are counted apart, by ``frozen_param_bytes``;
    - gradients: the most held at once. Stage 1 and 2 are looked at when the engine starts
      reducing them (stage 1 still holds every parameter's full ``.grad`` there) and when the
      ZeRO optimizer steps (the partition in ``averaged_gradients``); stage 3 keeps its
      partition in ``grad_partitions_flat_buffer``. Accelerate runs the step inside
      ``backward``, so the engine's methods are wrapped to look before they free anything;
    - optimizer: the fp32 master partitions and the torch optimizer's state (Adam moments).
      A master partition that shares storage with the parameters is counted once.

    ``dtypes()`` reads the same tensors: the parameters as held (bf16 under DeepSpeed's bf16
    mode, which casts the module) and the master partitions the optimizer steps (fp32 there).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.zero = engine.optimizer
        self.stage = engine.zero_optimization_stage()
        self.grads = 0
        self._watch(engine, "allreduce_gradients")
        self._watch(self.zero, "step")

    def _watch(self, owner: Any, method: str) -> None:
        original = getattr(owner, method)

        def watched(*args: Any, **kwargs: Any) -> Any:
            self.grads = max(self.grads, self._gradient_bytes())
            return original(*args, **kwargs)

        setattr(owner, method, watched)

    def _gradient_bytes(self) -> int:
        if self.stage == 3:
            return local_nbytes(getattr(self.zero, "grad_partitions_flat_buffer", None))
        on_params = sum(local_nbytes(p.grad) for p in self.engine.module.parameters())
        averaged = getattr(self.zero, "averaged_gradients", None) or {}
        partitions = [t for v in averaged.values() if v is not None for t in (v if isinstance(v, list) else [v])]
        return on_params + sum(local_nbytes(t) for t in partitions)

    def _held(self, trainable: bool = True) -> list[Any]:
        """The module's trainable (or frozen) parameters as this rank holds them (stage 3: its
        partitions)."""
        module_params = [p for p in self.engine.module.parameters() if p.requires_grad == trainable]
        return [p.ds_tensor for p in module_params] if self.stage == 3 else module_params

    def frozen_param_bytes(self, model: Any) -> int:
        """The frozen parameters (LoRA's base model) as this rank holds them (stage 3: partitions)."""
        return sum(local_nbytes(p) for p in self._held(trainable=False))

    def _masters(self) -> list[Any]:
        """The weights the optimizer steps: ZeRO-3's and ZeRO-1/2's master partitions, or the
        bf16 optimizer's (what DeepSpeed runs ZeRO-1 with under bf16)."""
        for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
            masters = getattr(self.zero, name, None)
            if masters:
                return list(masters)
        return [p for group in self.zero.param_groups for p in group["params"]]

    def dtypes(self) -> dict[str, str | None]:
        return {"param_dtype": dtype_name(self._held()), "master_dtype": dtype_name(self._masters())}

    def result(self) -> dict[str, int]:
        import torch

        held = self._held()
        storages = {t.untyped_storage().data_ptr() for t in held}
        masters = self._masters()
        master_bytes = sum(local_nbytes(t) for t in masters if t.untyped_storage().data_ptr() not in storages)
        state = self.zero.optimizer.state
        moments = sum(local_nbytes(v) for s in state.values() for v in s.values() if isinstance(v, torch.Tensor))
        return {"params": sum(local_nbytes(t) for t in held), "grads": self.grads, "optimizer": master_bytes + moments}
