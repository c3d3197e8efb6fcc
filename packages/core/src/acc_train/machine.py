"""What the worker runs on: the device type and world size a strategy checks itself against,
and what ``mixed_precision: auto`` resolves to there. torch is imported only when asked."""

from __future__ import annotations

import os

from acc_train.errors import UserError
from acc_train.strategy import Machine

__all__ = ["current_machine", "cpu_has_native_bf16", "resolve_mixed_precision"]


def current_machine() -> Machine:
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    nodes = max(1, world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in {"1", "true", "yes"}:
        return Machine("cuda", world, nodes)
    return Machine("cpu", world, nodes)


def cpu_has_native_bf16() -> bool:
    import torch

    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((probe and probe()) or (amx and amx()))


def resolve_mixed_precision(requested: str, machine: Machine) -> str:
    """``auto``: bf16 where the device computes it natively, else fp32 (``no``)."""
    if requested != "auto":
        if requested == "fp16" and machine.device_type == "cpu":
            raise UserError(
                "fp16 mixed precision needs a GPU",
                where="training.mixed_precision",
                hint="use auto, bf16 or no on a CPU",
            )
        return requested
    import torch

    if machine.device_type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_native_bf16() else "no"
