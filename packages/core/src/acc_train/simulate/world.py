"""A fake world: this one CPU process joins torch's fake process group as one rank of the
target world, and every tensor is a fake one (shapes, dtypes and sizes, no storage).

Collectives on the fake group return at once; the strategy's own code (Accelerate's prepare,
``fully_shard``, DeepSpeed's partitioning) runs as on the cluster and allocates what it would,
which torch's memory trackers count. Six things torch and the libraries do not expect under
fake tensors are stepped around here, each narrowly:

- a ``DeviceMesh`` reads its rank map (``tolist``): it is built from a real tensor;
- ``Module.to`` swaps each fake parameter for itself (FakeTensorMode keeps a weak reference
  that forbids the swap): a swap that changes nothing (same shape, dtype and device type) is skipped;
- a fake value read back to the host (``aten._local_scalar_dense``) has no data: an integer or a flag
  reads as 0 (an overflow check finds none), a float as 1.0 (an optimizer's step count, from
  which bias corrections divide; a gradient norm at the clipping threshold);
- Accelerate matches the optimizer's parameters to the sharded ones by data pointer, which is 0
  for every fake tensor (as for meta tensors, which it keys by identity): fake ones, and DTensors
  over fake ones, are keyed by identity too (else every parameter of a tensor-parallel model
  maps to one, and the optimizer steps only it);
- torch's ``DistributedDataParallel`` checks every rank's parameters against the others' by
  their data, and its reducer asserts on what the fake group's all-reduce returns
  (:func:`_replicas_on_the_fake_group`);
- transformers reads the position ids to tell packed rows (which need a block mask) from rows
  that never restart (which SDPA masks by ``is_causal``, with no mask at all); on a fake tensor it
  cannot read them, so it assumes packing and builds a b x s x s mask a run never builds
  (:func:`_positions_read_as_in_a_run`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

__all__ = ["fake_world", "ScalarReads", "HELD_OUTSIDE"]


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
    see the module's docstring), counting them. A real tensor's value is read as it is: a
    ``DeviceMesh`` finds this rank's row of its rank map by indexing with one (answering 0 put
    the last rank of a tp group outside its own group, with empty shards)."""

    def __init__(self) -> None:
        import torch
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:

                if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
                    outer.count += 1
                    dtype = args[0].dtype
                    return False if dtype is torch.bool else 1.0 if dtype.is_floating_point else 0
                return func(*args, **(kwargs or {}))

        self.count = 0
        self.mode = _Mode()


def _answered_all_reduce(state: Any, bucket: Any) -> Any:
    """DDP's gradient bucket all-reduced on the fake group, its future answered with the bucket
    (the fake group's own future carries no tensor, which DDP's reducer asserts on)."""
    import torch
    import torch.distributed as dist

    buffer = bucket.buffer()
    if not any(held is buffer for held in HELD_OUTSIDE):
        HELD_OUTSIDE.append(buffer)
    dist.all_reduce(buffer)  # counted among the step's collectives
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


#: tensors an engine holds outside the model and the optimizer, seen while simulating (DDP's
#: gradient buckets): the step's tracker is told of them (:mod:`acc_train.simulate.step`)
HELD_OUTSIDE: list[Any] = []


class _BucketsKept:
    """DDP's reducer, keeping the buckets it was built with: rebuilding them (in the second
    step's forward, in the order gradients arrived) swaps rank 0's bucket order through a real
    integer tensor the reducer writes. The rebuilt buckets are as large in all."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def _replicas_on_the_fake_group(stack: ExitStack) -> None:
    """torch's ``DistributedDataParallel`` on the fake group: its two start-up exchanges with the
    other ranks skipped (the shapes check reads every parameter's data, which fake tensors have
    none of; rank 0's weights broadcast, which changes nothing a tracker counts), and its bucket
    all-reduce answered (:func:`_answered_all_reduce`) in place of any communication hook the
    job names (a compression hook's smaller bucket copy is not counted). Its C++ reducer runs
    as in a run: it allocates and rebuilds its buckets, and copies the gradients into them."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.parallel import distributed as ddp_module

    import torch
    import torch.distributed as dist

    # the signature register_comm_hook checks (this module's annotations are strings)
    _answered_all_reduce.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    init = DistributedDataParallel.__init__

    def init_answered(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        DistributedDataParallel.register_comm_hook.__wrapped__(self, None, _answered_all_reduce)
        self.reducer = _BucketsKept(self.reducer)

    def hook_not_registered(self: Any, state: Any, hook: Any) -> None:
        pass  # _answered_all_reduce stands for it (the docstring above)

    hook_not_registered.__wrapped__ = DistributedDataParallel.register_comm_hook  # type: ignore[attr-defined]
    stack.enter_context(_patched(ddp_module, "_verify_param_shape_across_processes", lambda *args, **kwargs: None))
    stack.enter_context(_patched(ddp_module, "_sync_module_states", lambda *args, **kwargs: None))
    stack.enter_context(_patched(DistributedDataParallel, "register_comm_hook", hook_not_registered))
    stack.enter_context(_patched(DistributedDataParallel, "__init__", init_answered))


def _positions_read_as_in_a_run(stack: ExitStack) -> None:
    """transformers' packed-sequence check (``masking_utils.find_packed_sequence_indices``)
    answered as in a run. Under fake tensors its ``is_tracing`` is true, so it returns the packed
    mask unread: the model then materialises a b x s x s causal mask and SDPA computes with it
    (measured: simulated minus real activations = b*s^2*4*L bytes at seq 256 and 512, BENCHMARKS.md),
    where a run skips the mask and passes ``is_causal=True``. The simulated step passes no position
    ids (:mod:`acc_train.simulate.step`), so the model makes them, 0 to s-1 in every row: transformers'
    own check is run on real position ids of that shape, and where it finds no packing, neither does
    the simulation. Real tensors (a real step measured by the same code) go through unchanged."""
    import torch
    import transformers.masking_utils as masking
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    find = masking.find_packed_sequence_indices

    def find_as_in_a_run(position_ids: Any) -> Any:
        if not isinstance(position_ids, FakeTensor):
            return find(position_ids)
        with unset_fake_temporarily():
            made = torch.arange(position_ids.shape[-1]).expand(position_ids.shape)  # as the model makes them
            packed = find(made)
        return None if packed is None else find(position_ids)

    stack.enter_context(_patched(masking, "find_packed_sequence_indices", find_as_in_a_run))


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
            t1.fake_device = t2.device  # "cpu" to "cpu:0" (DDP's device on a CPU): one device, as fake tensors compare them

    import accelerate.accelerator

    parameter_id = accelerate.accelerator._get_parameter_id

    def fake_by_identity(param: Any) -> int:
        local = getattr(param, "_local_tensor", param)  # a DTensor (tensor parallelism) is keyed by its local tensor's pointer
        return id(param) if isinstance(local, FakeTensor) else parameter_id(param)

    reads = ScalarReads()
    HELD_OUTSIDE.clear()  # (one world per process, but a second one must not see the first one's)
    try:
        with ExitStack() as stack:
            _replicas_on_the_fake_group(stack)
            _positions_read_as_in_a_run(stack)
            stack.enter_context(_patched(DeviceMesh, "__init__", real_mesh))
            stack.enter_context(_patched(torch.utils, "swap_tensors", swap_unless_same))
            stack.enter_context(_patched(accelerate.accelerator, "_get_parameter_id", fake_by_identity))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(reads.mode)
            yield reads
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
