"""The module FSDP generates with (``eval.samples``), on every rank in lockstep.

FSDP2's ``fully_shard`` makes the model's own modules gather their parameters in their forward:
the unwrapped model is the model. FSDP1 keeps the parameters of the modules no unit of the wrap
policy holds (embeddings, final norm, output head) in the root unit, gathered only in the root
wrapper's forward, which ``generate`` does not call: those are gathered for as long as it runs
(``summon_full_params(recurse=False)``, as TRL generates under FSDP1), and the inner units
gather their own in their forward. Under FSDP2 the units are sharded again afterwards (the root
keeps its parameters gathered after a forward, for a backward that generation never runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["generation_model", "reshard"]


@contextlib.contextmanager
def generation_model(accelerator: Any, model: Any) -> Iterator[Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if not isinstance(model, FullyShardedDataParallel):  # FSDP2 (or one process without a wrapper)
        try:
            yield unwrapped
        finally:
            reshard(unwrapped)
        return
    with FullyShardedDataParallel.summon_full_params(model, recurse=False, writeback=False):
        yield unwrapped


def reshard(model: Any) -> None:
    """FSDP2 leaves the root module's parameters gathered after its forward (it expects the
    backward to need them); generation has no backward, so they would stay whole on every rank
    until the next training step: shard them again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
