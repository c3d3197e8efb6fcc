"""The memory tracker of a ZeRO step for ``acc-train plan --simulate``: torch's ``MemTracker``,
with DeepSpeed's own flat buffers put in the categories they are.

ZeRO keeps its state where ``MemTracker`` does not look: under ZeRO-3 the module's parameters are
empty placeholders and each rank's partition (``ds_tensor``), the fp32 master partitions and the
gradient partitions live in flat buffers built before the tracker starts and reachable from no
module or torch optimizer state; under ZeRO-1/2 the fp32 master partition is missed and the
gradient buckets and partitions DeepSpeed allocates in backward and step are counted as
activations or temporaries. The tracker here walks the ZeRO optimizer (as
:class:`acc_train_deepspeed.meter.ZeroMeter` does for a run) when it starts, whenever the total
reaches a new high and when the torch optimizer has stepped, and files each buffer it finds:

- parameters: ``ds_tensor`` partitions, ZeRO-3 parameters gathered at that moment,
  ``fp16_partitioned_groups_flat`` / ``lp_param_buffer`` (ZeRO-3), ``bit16_groups_flat`` (ZeRO-1/2);
- optimizer: ``fp32_partitioned_groups_flat`` (ZeRO-3), ``single_partition_of_fp32_groups``
  (ZeRO-1/2), ``fp32_groups_flat_partition`` (bf16 stage 0), and the torch optimizer's state;
- gradients: ``grad_partitions_flat_buffer``, ``averaged_gradients``, ``grads_in_partition``,
  ``fp32_groups_gradients_flat``, the reduction buckets (``ipg_buckets[dtype].buffer``), and the
  ``.grad`` of the masters and of the module's parameters.

One thing DeepSpeed does cannot be rehearsed in a fake world, and is stepped around for the
tracker's lifetime where the process group is torch's fake one: at the end of each ZeRO-3
forward and backward, the parameter coordinator checks that every rank recorded the same module
and parameter order (``assert_ints_same_as_other_ranks``: rank 0's list broadcast, then read
back). The fake group exchanges nothing and the value read back is no rank's, so the check would
find a disagreement where there is none; it is skipped (every rank of a rehearsal is this
process, running the same code).

Imported only while simulating (``DeepSpeedPlanner.memory_tracker``): torch is imported when the
tracker is built, not with the strategy.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

__all__ = ["zero_memory_tracker", "PARAMETER_BUFFERS", "OPTIMIZER_BUFFERS", "GRADIENT_BUFFERS"]

#: the ZeRO optimizer's attributes holding parameters (the rank's copy or partition the module computes with)
PARAMETER_BUFFERS = ("fp16_partitioned_groups_flat", "lp_param_buffer", "bit16_groups_flat", "bf16_groups_flat")
#: ... holding the fp32 master partitions the torch optimizer steps
OPTIMIZER_BUFFERS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")
#: ... holding gradients or their partitions
GRADIENT_BUFFERS = (
    "grad_partitions_flat_buffer", "averaged_gradients", "grads_in_partition", "fp32_groups_gradients_flat",
    "fp32_groups_gradient_flat_partition",
)  # fmt: skip


def _tensors(obj: Any, depth: int = 0) -> Iterator[Any]:
    """The tensors in ``obj`` and its lists, tuples and dicts (three levels: ZeRO's are per group
    and per parameter), skipping meta tensors (DeepSpeed's shape-only copies)."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta":
            yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def _skip_rank_agreement_check() -> Any:
    """In a fake process group, skip ZeRO-3's cross-rank order check (the module's docstring);
    returns what restores it, or None where the group is a real one."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "fake":
        return None
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    check = coordinator.assert_ints_same_as_other_ranks
    coordinator.assert_ints_same_as_other_ranks = lambda ints: None

    def restore() -> None:
        coordinator.assert_ints_same_as_other_ranks = check

    return restore


@cache
def _tracker_class() -> type:
    """``MemTracker`` subclassed once torch is imported (see the module's docstring)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

    class ZeroMemTracker(MemTracker):
        """``MemTracker`` that files DeepSpeed's buffers (the module's docstring) before each
        snapshot that can become the peak, so the peak's categories are ZeRO's."""

        def __init__(self, engine: Any) -> None:
            super().__init__()
            self.engine = engine
            self.zero = engine.optimizer
            self.torch_optimizer = self.zero.optimizer
            self._params = list(engine.module.parameters())
            self._level = 0  # the highest total filed outside the torch optimizer's step
            self._hook: Any = None
            self._restore: Any = None
            self.track_external(engine, self.torch_optimizer)

        def file_buffers(self) -> None:
            """Put each of ZeRO's tensors in its category (untracked ones start being tracked)."""

            def tag(tensors: Any, reftype: Any) -> None:
                for t in tensors:
                    if t.untyped_storage().nbytes():
                        self._update_and_maybe_create_winfos(t, reftype)

            params = self._params
            tag((p.ds_tensor for p in params if hasattr(p, "ds_tensor")), _MemRefType.PARAM)
            tag((p for p in params if hasattr(p, "ds_tensor") and p.numel()), _MemRefType.PARAM)  # gathered (ZeRO-3)
            zero = self.zero
            for name, value in vars(zero).items():
                if name in PARAMETER_BUFFERS:
                    tag(_tensors(value), _MemRefType.PARAM)
                elif name in OPTIMIZER_BUFFERS:
                    tag(_tensors(value), _MemRefType.OPT)
                elif name in GRADIENT_BUFFERS:
                    tag(_tensors(value), _MemRefType.GRAD)
            buckets = getattr(zero, "ipg_buckets", None) or {}
            tag((t for bucket in buckets.values() for t in _tensors(getattr(bucket, "buffer", None))), _MemRefType.GRAD)
            masters = (p for group in self.torch_optimizer.param_groups for p in group["params"])
            tag((p.grad for p in masters if p.grad is not None), _MemRefType.GRAD)
            tag((p.grad for p in params if p.grad is not None), _MemRefType.GRAD)

        def _update_peak_stats(self, peak_state: Any) -> None:
            total = sum(snap[_TOTAL_KEY] for snap in self._curr_mem_snap.values())
            if total > self._level:
                self.file_buffers()
                if not self._in_opt:  # a step's transients are not a level to beat (acc_train.simulate.step)
                    self._level = total
            super()._update_peak_stats(peak_state)

        def __enter__(self) -> ZeroMemTracker:
            if self._depth == 0:
                self.file_buffers()
                # the state at the step's end filed before anyone reads it (hooks run in registration order)
                self._hook = self.torch_optimizer.register_step_post_hook(lambda *_: self.file_buffers())
                self._restore = _skip_rank_agreement_check()
            super().__enter__()
            return self

        def __exit__(self, *args: Any) -> None:
            super().__exit__(*args)
            if self._depth == 0 and self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self._depth == 0 and self._restore is not None:
                self._restore()
                self._restore = None

    return ZeroMemTracker


def zero_memory_tracker(engine: Any) -> Any:
    """A ``MemTracker`` over ``engine`` (the ``DeepSpeedEngine`` prepare returned) and its ZeRO
    optimizer that counts DeepSpeed's flat buffers where they belong."""
    return _tracker_class()(engine)
