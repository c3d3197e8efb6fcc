"""``training.compile``: torch.compile's settings, as a job states them and as an accelerate
config file's ``dynamo_config`` states them, checked against the strategy before launch.

The section has the fields of Accelerate's ``TorchDynamoPlugin`` (backend, mode, fullgraph,
dynamic, regional compilation), which the worker hands to the ``Accelerator``
(:mod:`acc_train.loop.torch_compile`): Accelerate compiles the prepared model, after the strategy
has wrapped it. No torch or accelerate import here: resolving a config stays fast.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, BaseModel, ConfigDict, field_validator, model_validator

from acc_train.errors import UserError

__all__ = [
    "CompileConfig", "DYNAMO_BACKENDS", "COMPILE_MODES", "DYNAMO_ENV_VARS", "DynamoSection", "dynamo_keys",
    "compile_from_dynamo", "check_compile", "dynamo_env", "ignored_env_warning",
]  # fmt: skip

#: ``accelerate.utils.DynamoBackend`` less ``NO``, lower case as torch.compile names them
#: (a unit test holds this to Accelerate's enum).
DYNAMO_BACKENDS = (
    "eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser", "cudagraphs", "ofi", "fx2trt",
    "onnxrt", "tensorrt", "aot_torchxla_trace_once", "torchxla_trace_once", "tvm", "hpu_backend", "neuron",
)  # fmt: skip
#: torch.compile's ``mode``.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: What ``accelerate launch`` exports from a ``dynamo_config`` and ``TorchDynamoPlugin`` reads
#: when it is built without arguments, with the ``training.compile`` key each stands for.
#: acc-train's loop builds the plugin from ``training.compile`` alone, and ``acc-train launch``
#: exports them from it (:func:`dynamo_env`), so the shell's are ignored, with a warning.
DYNAMO_ENV_VARS = {
    "ACCELERATE_DYNAMO_BACKEND": "backend",
    "ACCELERATE_DYNAMO_MODE": "mode",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "fullgraph",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "dynamic",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "regional",
}


class CompileConfig(BaseModel):
    """``training.compile``: compile the model with torch.compile through Accelerate.

    ``training.compile: true`` is short for ``{enabled: true}``; naming any of its keys without
    ``enabled`` switches it on (as HF Trainer's ``torch_compile_backend`` does).
    """

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)

    enabled: bool = Field(
        False,
        description="Compile the model with torch.compile (naming any other key of this section switches it on).",
    )
    backend: Literal[DYNAMO_BACKENDS] = Field(  # type: ignore[valid-type]
        "inductor",
        description=(
            "torch.compile's backend: `inductor` (generates kernels; needs a C++ compiler on CPU), "
            "`aot_eager` / `eager` (capture the graph, run it with aten ops: for debugging), ..."
        ),
    )
    mode: Literal[COMPILE_MODES] = Field(  # type: ignore[valid-type]
        "default",
        description="torch.compile's mode: `default`, `reduce-overhead`, `max-autotune`, ...",
    )
    fullgraph: bool = Field(
        False,
        description="Refuse graph breaks: each compiled region is one graph, or an error. Needs `regional`.",
    )
    dynamic: bool | None = Field(
        None,
        description="Dynamic shapes: null lets torch decide (it recompiles dynamically when a shape changes).",
    )
    regional: bool = Field(
        False,
        description=(
            "Compile each repeated block (decoder layer) once and reuse it: much shorter compile time "
            "(Accelerate's `use_regional_compilation`)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return {"enabled": value}
        if isinstance(value, dict) and value and "enabled" not in value:
            return {**value, "enabled": True}
        return value

    @model_validator(mode="after")
    def _fullgraph_by_regions(self) -> CompileConfig:
        if self.enabled and self.fullgraph and not self.regional:
            raise ValueError(
                "training.compile.fullgraph: true needs regional: true: a whole causal LM's forward does not trace as one "
                "graph under acc-train's loop (transformers' own code and the strategy's wrapper break it; measured with "
                "torch 2.13), each decoder layer does. Set regional: true, or fullgraph: false"
            )
        return self

    @field_validator("backend", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value  # accelerate config files write INDUCTOR

    def settings(self) -> dict[str, Any]:
        """The settings as run.json records them."""
        return self.model_dump(mode="json")


class DynamoSection(BaseModel):
    """An accelerate config file's ``dynamo_config``, keys as ``accelerate config`` writes them."""

    model_config = ConfigDict(extra="forbid", strict=True)

    dynamo_backend: str | None = None
    dynamo_mode: str | None = None
    dynamo_use_fullgraph: bool | None = None
    dynamo_use_dynamic: bool | None = None
    dynamo_use_regional_compilation: bool | None = None


def dynamo_keys(data: dict[str, Any]) -> Any:
    """An accelerate config file's ``dynamo_config`` with every key ``dynamo_``-prefixed (``accelerate
    launch`` accepts them without), plus the old top-level ``dynamo_backend`` where it has none."""
    raw = data.get("dynamo_config") or {}
    if not isinstance(raw, dict):
        return raw  # refused by name when read
    raw = {(k if str(k).startswith("dynamo_") else f"dynamo_{k}"): v for k, v in raw.items()}
    if "dynamo_backend" not in raw and data.get("dynamo_backend") is not None:
        raw["dynamo_backend"] = data["dynamo_backend"]
    return raw


def compile_from_dynamo(section: DynamoSection) -> dict[str, Any] | None:
    """``training.compile`` from a ``dynamo_config``, or None when it names no backend;
    ``dynamo_backend: NO`` is compile off."""
    if section.dynamo_backend is None:
        return None
    if section.dynamo_backend.upper() == "NO":
        return {"enabled": False}
    out: dict[str, Any] = {"enabled": True, "backend": section.dynamo_backend.lower()}
    for key, ours in (("mode", "mode"), ("use_fullgraph", "fullgraph"), ("use_dynamic", "dynamic"), ("use_regional_compilation", "regional")):
        value = getattr(section, f"dynamo_{key}")
        if value is not None:
            out[ours] = value
    return out


def check_compile(compile_cfg: CompileConfig, strategy: Any, origin: str | None = None) -> None:
    """Refuse, before launch, ``training.compile`` under a strategy (with its options) that
    says it cannot run compiled (``Strategy.compile_problem``)."""
    if not compile_cfg.enabled:
        return
    problem = strategy.compile_problem(compile_cfg)
    if problem is None:
        return
    raise UserError(
        f'training.compile cannot run under strategy "{strategy.name}": {problem}',
        where="training.compile" + (f" ({origin})" if origin else ""),
        hint="set training.compile.enabled=false (--set training.compile=false), or choose a strategy that compiles",
    )


def dynamo_env(compile_cfg: CompileConfig) -> dict[str, str]:
    """``training.compile`` as the ``ACCELERATE_DYNAMO_*`` variables ``accelerate launch`` exports
    for a script (``acc-train launch``): its ``Accelerator`` reads them unless it is given
    ``dynamo_backend`` or ``dynamo_plugin`` itself."""
    env = {
        "ACCELERATE_DYNAMO_BACKEND": compile_cfg.backend.upper() if compile_cfg.enabled else "NO",
        "ACCELERATE_DYNAMO_MODE": compile_cfg.mode,
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": str(compile_cfg.fullgraph),
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": str(compile_cfg.regional),
    }
    if compile_cfg.dynamic is not None:
        env["ACCELERATE_DYNAMO_USE_DYNAMIC"] = str(compile_cfg.dynamic)
    return env


def ignored_env_warning(compile_cfg: CompileConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """The warning for ``ACCELERATE_DYNAMO_*`` variables set in ``environ`` (the process's own by
    default), which acc-train ignores: the job's ``training.compile`` decides. None when none is set."""
    environ = os.environ if environ is None else environ
    ignored = {name: environ[name] for name in DYNAMO_ENV_VARS if environ.get(name)}
    if not ignored:
        return None
    keys = ", ".join(f"{name}={value} (training.compile.{DYNAMO_ENV_VARS[name]})" for name, value in ignored.items())
    return (
        f"ignoring {keys} from the environment: acc-train compiles as training.compile says "
        f"(enabled: {str(compile_cfg.enabled).lower()}); set those keys in the config instead"
    )
