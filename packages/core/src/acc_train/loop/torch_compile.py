"""torch.compile in a run: Accelerate's ``TorchDynamoPlugin`` built from ``training.compile``
alone, and what ``run.json`` says was compiled.

Accelerate does the compiling: ``prepare`` calls ``torch.compile`` on the model once the strategy
has wrapped it (DDP), or on the model before ``fully_shard`` (FSDP2), so the strategy's own
wrapping and compile stay in the order Accelerate and torch test. The job's config is the one
source: ``ACCELERATE_DYNAMO_*`` variables in the environment, which ``TorchDynamoPlugin`` would
otherwise read, are ignored by acc-train's loop, with a warning naming the key to set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from acc_train.config.compile import ignored_env_warning
from acc_train.machine import warn_once_per_machine

if TYPE_CHECKING:
    from accelerate.utils import TorchDynamoPlugin

    from acc_train.config.compile import CompileConfig

__all__ = ["dynamo_plugin", "compile_summary"]


def dynamo_plugin(compile_cfg: CompileConfig) -> TorchDynamoPlugin:
    """The plugin for ``Accelerator(dynamo_plugin=...)``: every field set from ``compile_cfg``, so
    nothing is read from the environment (backend ``no`` when compile is off)."""
    from accelerate.utils import TorchDynamoPlugin

    warning = ignored_env_warning(compile_cfg)
    if warning:
        warn_once_per_machine(warning)
    cfg = compile_cfg
    plugin = TorchDynamoPlugin(
        backend=cfg.backend if cfg.enabled else "no",
        mode=cfg.mode,
        fullgraph=cfg.fullgraph,
        dynamic=cfg.dynamic,
        use_regional_compilation=cfg.regional,
    )
    plugin.dynamic = cfg.dynamic  # None reads ACCELERATE_DYNAMO_USE_DYNAMIC in __post_init__
    return plugin


def compile_summary(model: Any, compile_cfg: CompileConfig) -> dict[str, Any]:
    """``run.json``'s ``compile``: the settings, and on this rank whether the prepared model is
    compiled (whole, its repeated blocks, or by its engine), how many graphs dynamo captured and how many
    graph breaks it met."""
    if not compile_cfg.enabled:
        return {"enabled": False}
    from accelerate.utils import has_compiled_regions, is_compiled_module
    from torch._dynamo.utils import counters

    return {
        **compile_cfg.settings(),
        # a library that compiles inside its own engine (DeepSpeed's engine.compile) says so itself
        "compiled": bool(is_compiled_module(model) or has_compiled_regions(model) or getattr(model, "is_compiled", False)),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }
