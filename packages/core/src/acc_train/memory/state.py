"""Counting the model state a rank holds: parameters, gradients and optimizer state, in bytes.

This is what sharding divides (the ZeRO paper's "model states"), counted from the tensors
themselves rather than from a formula, so ``run.json`` and ``bench/bench_memory.py`` can hold
each strategy to its formula. A strategy whose library keeps state outside the torch optimizer
(DeepSpeed's flat partitions) supplies its own :class:`ModelStateMeter`.

The meter also says which dtypes those tensors have (``run.json``'s ``param_dtype`` and
``master_dtype``), read from the same live objects, never from the config.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ModelStateMeter", "TorchOptimizerMeter", "local_nbytes", "dtype_name"]


def local_nbytes(tensor: Any) -> int:
    """Bytes of ``tensor`` stored on this rank (a DTensor's local shard)."""
    if tensor is None:
        return 0
    if hasattr(tensor, "to_local"):  # DTensor: count this rank's shard
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def dtype_name(tensors: Any) -> str | None:
    """The dtype of ``tensors`` (a DTensor's local shard) as torch names it without ``torch.``:
    ``float32``; several joined by ``+`` (``bfloat16+float32``); None for none."""
    names = set()
    for t in tensors:
        if t is not None:
            names.add(str((t.to_local() if hasattr(t, "to_local") else t).dtype).removeprefix("torch."))
    return "+".join(sorted(names)) or None


class ModelStateMeter:
    """Measures one rank's model state. The loop calls :meth:`at_gradient_sync` after each
    backward pass that synchronised gradients (before the optimizer steps, where the strategy
    lets it) and :meth:`result` once at the end of training."""

    def at_gradient_sync(self) -> None:
        """Record what needs recording while gradients exist (they are freed after the step)."""

    def result(self) -> dict[str, int]:
        """``{"params": ..., "grads": ..., "optimizer": ...}`` in bytes held by this rank."""
        raise NotImplementedError

    def frozen_param_bytes(self, model: Any) -> int:
        """Bytes of the frozen parameters (LoRA's base model) this rank holds: no gradients and
        no optimizer state, so not in :meth:`result`. The default counts each frozen
        parameter's local tensor (a DTensor's shard); a strategy that keeps parameters
        elsewhere (partitions) overrides it."""
        return sum(local_nbytes(p) for p in model.parameters() if not p.requires_grad)

    def dtypes(self) -> dict[str, str | None]:
        """``{"param_dtype": ..., "master_dtype": ...}`` (:func:`dtype_name`): the trainable
        parameters as this rank holds them, and the weights its optimizer steps (the parameters
        themselves for a torch optimizer; a library's fp32 master copy under its mixed
        precision). None where the meter cannot tell."""
        return {"param_dtype": None, "master_dtype": None}


class TorchOptimizerMeter(ModelStateMeter):
    """For strategies whose state lives in the torch optimizer's parameters and state (DDP,
    FSDP1's flat parameters, FSDP2's DTensors)."""

    def __init__(self, optimizer: Any) -> None:
        self.torch_optimizer = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
        self.grads: int | None = None

    def _params(self) -> list[Any]:
        return [p for group in self.torch_optimizer.param_groups for p in group["params"]]

    def at_gradient_sync(self) -> None:
        if self.grads is None:  # once: the gradient memory held at a step
            self.grads = sum(local_nbytes(p.grad) for p in self._params())

    def result(self) -> dict[str, int]:
        import torch

        params = self._params()
        state = self.torch_optimizer.state
        optimizer = sum(local_nbytes(v) for p in params for v in state.get(p, {}).values() if isinstance(v, torch.Tensor))
        return {"params": sum(local_nbytes(p) for p in params), "grads": self.grads or 0, "optimizer": optimizer}

    def dtypes(self) -> dict[str, str | None]:
        """A torch optimizer steps the parameters themselves: FSDP's sharded parameters, DDP's
        replica. Their dtype is both."""
        held = dtype_name(self._params())
        return {"param_dtype": held, "master_dtype": held}
