"""The collectives one simulated step issues, by kind: count and bytes.

Process-group calls reach the dispatcher as ``c10d`` ops (``_allgather_base_``,
``_reduce_scatter_base_``, ``allreduce_``...), and functional collectives as
``_c10d_functional`` ops, where a dispatch mode sees them with their tensors. Bytes are those of
the largest tensor each call takes: the gathered output of an all-gather, the input of a
reduce-scatter, the tensor of an all-reduce or broadcast.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["CollectiveCounter"]

#: dispatcher names -> the kind a person knows them by
KINDS = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather", "allgather_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "send": "send", "recv_": "recv", "barrier": "barrier",
}  # fmt: skip


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class CollectiveCounter:
    """Counts while its ``mode`` is on (push it inside the fake mode)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        self.counts: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                if func.namespace in ("c10d", "_c10d_functional"):
                    name = func._opname
                    kind = KINDS.get(name, name)
                    tensors = _tensors(list(args) + list((kwargs or {}).values()))
                    outer.counts[kind] += 1
                    outer.bytes[kind] += max((t.numel() * t.element_size() for t in tensors), default=0)
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()

    def summary(self) -> dict[str, dict[str, int]]:
        """``{kind: {"count": n, "bytes": b}}``."""
        return {kind: {"count": self.counts[kind], "bytes": self.bytes[kind]} for kind in sorted(self.counts)}
