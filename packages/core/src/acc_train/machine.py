"""What the worker runs on: the device type and world size a strategy checks itself against,
what ``mixed_precision: auto`` resolves to there, and which process speaks for the machine
(warnings once per machine, not once per rank). torch is imported only when asked."""

from __future__ import annotations

import os
import sys
from typing import Any

from acc_train.errors import UserError
from acc_train.strategy import Machine, Strategy

__all__ = [
    "current_machine", "bound_here", "cpu_has_native_bf16", "resolve_mixed_precision", "is_local_main_process", "warn_once_per_machine",
    "quiet_other_local_ranks",
]  # fmt: skip


def current_machine() -> Machine:
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    nodes = max(1, world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in {"1", "true", "yes"}:
        return Machine("cuda", world, nodes)
    return Machine("cpu", world, nodes)


def bound_here(strategy: Strategy[Any]) -> Strategy[Any]:
    """``strategy`` bound to the machine this process runs on (a worker's: the world its launcher
    started, which the launch section described), unless it is bound to that machine already."""
    here = current_machine()
    return strategy if strategy.is_bound and strategy.machine == here else strategy.bind(here)


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


def is_local_main_process() -> bool:
    """Whether this process speaks for its machine: local rank 0 under the launcher
    (``LOCAL_RANK``), or a process that was not launched (the command itself)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def warn_once_per_machine(message: str) -> None:
    """``warning: MESSAGE`` on stderr from the local main process only: what every rank would
    print is shown once per machine, not once per rank."""
    if is_local_main_process():
        sys.stderr.write(f"warning: {message}\n")


#: loggers of the libraries a worker runs, whose warnings every rank repeats
_LIBRARY_LOGGERS = ("accelerate", "datasets", "transformers", "torch")


def quiet_other_local_ranks() -> None:
    """On a worker that is not its machine's local main process, silence the warnings every rank
    would repeat: Python warnings and the libraries' log records below ERROR. Errors and
    tracebacks still print on every rank. Called first thing in a worker."""
    if is_local_main_process():
        return
    import logging
    import warnings

    warnings.simplefilter("ignore")
    os.environ["TRANSFORMERS_VERBOSITY"] = os.environ["DATASETS_VERBOSITY"] = "error"  # read when they set their levels
    for name in _LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
