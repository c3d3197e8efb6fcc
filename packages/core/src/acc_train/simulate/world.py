"""A fake world: this one CPU process joins torch's fake process group as one rank of the
target world, and every tensor is a fake one (shapes, dtypes and sizes, no storage).

Collectives on the fake group return at once; the strategy's own code (Accelerate's prepare,
``fully_shard``, DeepSpeed's partitioning) runs as on the cluster and allocates what it would,
which torch's memory trackers count. Four things torch and the libraries do not expect under
fake tensors are stepped around here, each narrowly:

- a ``DeviceMesh`` reads its rank map (``tolist``): it is built from a real tensor;
- ``Module.to`` swaps each fake parameter for itself (FakeTensorMode keeps a weak reference
  that forbids the swap): a swap that changes nothing (same shape, dtype and device type) is skipped;
- a value read back to the host (``aten._local_scalar_dense``) has no data: an integer or a flag
  reads as 0 (an overflow check finds none), a float as 1.0 (an optimizer's step count, from
  which bias corrections divide; a gradient norm at the clipping threshold);
- Accelerate matches the optimizer's parameters to the sharded ones by data pointer, which is 0
  for every fake tensor (as for meta tensors, which it keys by identity): fake ones are keyed by
  identity too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

__all__ = ["fake_world", "ScalarReads"]


def _env(rank: int, world_size: int, local_world_size: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(rank // local_world_size),
        "NODE_RANK": str(rank // local_world_size),
        "MASTER_ADDR": "127.0.0.1",  # never reached: the fake group has no rendezvous
        "MASTER_PORT": "29500",
        "ACCELERATE_USE_CPU": "1",
    }


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class ScalarReads:
    """A dispatch mode (inside the fake mode) that answers host reads of a fake value (0 or 1.0,
    see the module's docstring), counting them."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                import torch

                if func is torch.ops.aten._local_scalar_dense.default:
                    outer.count += 1
                    dtype = args[0].dtype
                    return False if dtype is torch.bool else 1.0 if dtype.is_floating_point else 0
                return func(*args, **(kwargs or {}))

        self.count = 0
        self.mode = _Mode()


@contextmanager
def fake_world(rank: int, world_size: int, local_world_size: int) -> Iterator[ScalarReads]:
    """Join the fake process group as ``rank`` of ``world_size`` (``local_world_size`` per
    machine) with fake tensors on; yields the counter of host reads answered (0 or 1.0). The
    process's environment says what a launcher would (``RANK``, ``WORLD_SIZE``...), so
    ``current_machine()`` and Accelerate see the target world."""
    import torch
    import torch.distributed as dist
    import torch.utils
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(_env(rank, world_size, local_world_size))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    mesh_init = DeviceMesh.__init__

    def real_mesh(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            rank_map = kwargs.get("_rank_map")
            if isinstance(rank_map, FakeTensor):  # init_device_mesh's identity map, made under the fake mode
                kwargs["_rank_map"] = torch.arange(rank_map.numel(), dtype=rank_map.dtype).view(rank_map.shape)
            mesh_init(self, *args, **kwargs)

    swap = torch.utils.swap_tensors

    def swap_unless_same(t1: Any, t2: Any) -> None:
        try:
            swap(t1, t2)
        except RuntimeError:
            if not (isinstance(t1, FakeTensor) and t1.device.type == t2.device.type and t1.dtype == t2.dtype and t1.shape == t2.shape):
                raise

    import accelerate.accelerator

    parameter_id = accelerate.accelerator._get_parameter_id

    def fake_by_identity(param: Any) -> int:
        return id(param) if isinstance(param, FakeTensor) else parameter_id(param)

    reads = ScalarReads()
    try:
        with ExitStack() as stack:
            stack.enter_context(_patched(DeviceMesh, "__init__", real_mesh))
            stack.enter_context(_patched(torch.utils, "swap_tensors", swap_unless_same))
            stack.enter_context(_patched(accelerate.accelerator, "_get_parameter_id", fake_by_identity))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(reads.mode)
            yield reads
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
