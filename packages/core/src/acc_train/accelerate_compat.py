"""The one place acc-train reaches into Accelerate's internals.

Accelerate refuses sharded strategies on CPU: ``AcceleratorState`` ignores an FSDP plugin on
``MULTI_CPU`` and only picks DeepSpeed off CPU, so a request for either silently runs as DDP.
The libraries themselves work on CPU over gloo, and Accelerate's prepare/save/load paths work
too once the state says so. This module flips the state after ``Accelerator(cpu=True)``; it is
checked against the Accelerate versions it was verified with and refuses others clearly.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "VERIFIED_ACCELERATE", "already_running", "check_accelerate", "for_a_later_accelerator", "undo_switch_after_reset", "run_sharded_on_cpu",
    "skip_unused_library_imports", "probe_libraries_once",
]  # fmt: skip

#: Accelerate versions (inclusive lower, exclusive upper) whose internals this was verified on.
VERIFIED_ACCELERATE = ("1.10.0", "1.17.0")


def check_accelerate(what: str) -> None:
    """Raise a clear error if the installed Accelerate is outside the verified range."""
    import accelerate
    from packaging.version import Version

    low, high = VERIFIED_ACCELERATE
    installed = Version(accelerate.__version__)
    if not (Version(low) <= installed < Version(high)):
        raise RuntimeError(
            f"running {what} on CPU relies on Accelerate internals verified for accelerate>={low},<{high}, "
            f"but {accelerate.__version__} is installed. Install a verified version "
            f'(pip install "accelerate>={low},<{high}") or run on GPUs, where Accelerate\'s own path is used.'
        )


def run_sharded_on_cpu(accelerator: Any, distributed_type: str, **state: Any) -> None:
    """Make a ``cpu=True`` Accelerator run ``distributed_type`` (``"FSDP"`` or ``"DEEPSPEED"``).

    ``state`` holds the attributes Accelerate would have set on its ``AcceleratorState`` for
    that type (``fsdp_plugin=...``, or ``deepspeed_plugins=...``).
    """
    from accelerate.utils import DistributedType

    check_accelerate(distributed_type)
    acc_state = accelerator.state
    target = DistributedType[distributed_type]
    if acc_state.distributed_type not in (DistributedType.MULTI_CPU, target):
        raise RuntimeError(f"expected Accelerate to start as MULTI_CPU before switching to {distributed_type}, got {acc_state.distributed_type}")
    for name in ("distributed_type", "mixed_precision", "device"):
        if not hasattr(acc_state, name):
            raise RuntimeError(f"AcceleratorState has no {name!r}: this Accelerate does not fit acc-train's CPU workaround")
    # AcceleratorState copies PartialState's fields each time it is constructed again, so the
    # type must be set on both or a later AcceleratorState() silently turns it back to MULTI_CPU
    from accelerate.state import PartialState

    import torch

    # MULTI_CPU names the device cpu:0; FSDP1 compares it with its compute device "cpu" and
    # refuses to wrap. Plain "cpu" is the same device for every other purpose.
    for target in (PartialState(), acc_state):
        target.distributed_type = DistributedType[distributed_type]
        target.device = torch.device("cpu")
    PartialState._shared_state[_SWITCHED] = True
    for key, value in state.items():
        # a later Accelerator of the same process shares the state: the first one's plugins
        # stay, as Accelerate keeps them on GPUs (after AcceleratorState._reset_state() there are none)
        if getattr(acc_state, key, None) is None:
            setattr(acc_state, key, value)


#: marks PartialState's shared state as switched by :func:`run_sharded_on_cpu`
_SWITCHED = "_acc_train_switched_on_cpu"


def undo_switch_after_reset() -> None:
    """Before an Accelerator is built: if ``AcceleratorState._reset_state()`` dropped the state
    that :func:`run_sharded_on_cpu` switched, while the process state (``PartialState``) still
    says FSDP or DeepSpeed, put the process state back to ``MULTI_CPU``. Accelerate then builds
    the new state as it built the first one (a DeepSpeed type without its plugin would fail in
    ``Accelerator.__init__``), and the strategy switches it again."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if AcceleratorState._shared_state == {} and PartialState._shared_state.pop(_SWITCHED, False):
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU


def already_running(accelerator: Any, distributed_type: str, plugin_attribute: str) -> bool:
    """Whether an earlier Accelerator of this process already switched the shared state to
    ``distributed_type`` with its plugin (``plugin_attribute`` of the state): a later one then
    runs the same way, as on GPUs, and must not switch again."""
    state = accelerator.state
    return state.distributed_type.name == distributed_type and getattr(state, plugin_attribute, None) is not None


def skip_unused_library_imports() -> None:
    """Keep Accelerate from importing libraries a job does not use (``datasets``, a strategy's).

    ``prepare`` asks "is this loader's dataset one of that library's datasets?" and unwrapping a
    model asks "is it that library's engine?"; to ask, Accelerate imports the library whenever it
    is installed (about 85 and 20 MiB of RSS per rank for the two it asks about today). An object
    can only be an instance of a class whose library is imported, so in the two modules that
    ask such questions, every ``is_<library>_available`` probe naming an installed library
    answers "is it imported", which answers the question exactly.
    """
    import importlib
    import importlib.util
    import sys

    for module_name in ("accelerate.data_loader", "accelerate.utils.other"):
        module = importlib.import_module(module_name)
        for attr in [a for a in vars(module) if a.startswith("is_") and a.endswith("_available")]:
            library = attr.removeprefix("is_").removesuffix("_available")
            if importlib.util.find_spec(library) is not None:
                setattr(module, attr, lambda library=library: library in sys.modules)


def probe_libraries_once() -> None:
    """Answer Accelerate's per-step "is this library installed?" probes once per process.

    ``AcceleratedOptimizer.step`` calls ``is_lomo_available()`` twice on every optimizer step,
    and each call searches ``sys.path`` for the package (``importlib.util.find_spec``): about
    0.5 ms of every step on this project's CPU, a third of the loop's own cost before issue 32
    (BENCHMARKS.md). Whether a library is installed does not change while a job runs, so in the
    modules that probe per step each ``is_<library>_available`` keeps its first answer.
    """
    import functools
    import importlib

    for module_name in ("accelerate.optimizer", "accelerate.accelerator"):
        module = importlib.import_module(module_name)
        for attr in [a for a in vars(module) if a.startswith("is_") and a.endswith("_available")]:
            probe = getattr(module, attr)
            if callable(probe) and not hasattr(probe, "cache_info"):
                setattr(module, attr, functools.cache(probe))


def for_a_later_accelerator(kwargs: dict[str, Any]) -> bool:
    """Fit ``kwargs`` (built for ``acc_train.Accelerator``) to an Accelerator that is not the
    process's first, and say whether it is. The state it shares keeps what the first one
    decided, as Accelerate keeps it on GPUs: its mixed precision (an unset or ``auto`` one is
    dropped rather than resolved again, which Accelerate would refuse if it differed) and its
    plugins (the strategy's are dropped: Accelerate refuses some passed to a later Accelerator
    and ignores the others)."""
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state == {}:
        return False
    if kwargs.get("mixed_precision") in (None, "auto"):
        kwargs.pop("mixed_precision", None)
    for key in [k for k in kwargs if k.endswith(("_plugin", "_plugins"))]:
        del kwargs[key]
    return True
