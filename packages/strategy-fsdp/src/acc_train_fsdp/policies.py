"""Wrap policies: which submodules become separately sharded FSDP units.

A wrap policy's ``build(model, options)`` returns a predicate over modules. The built-in
``transformer`` and ``size`` policies are also expressed in Accelerate's own terms, so both
FSDP versions apply them natively.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from acc_train.api import UserError, WrapPolicy, closest

__all__ = ["TransformerLayerPolicy", "SizePolicy", "NoWrapPolicy", "layer_class_names"]


def _class_names(model: Any) -> set[str]:
    return {type(m).__name__ for m in model.modules()}


def layer_class_names(model: Any, requested: list[str] | None) -> list[str]:
    """The layer classes to wrap: as requested (each must exist in the model), or the model's
    ``_no_split_modules`` that it actually contains."""
    present = _class_names(model)
    if requested is None:
        names = [n for n in (getattr(model, "_no_split_modules", None) or []) if n in present]
        if not names:
            raise UserError(
                f"{type(model).__name__} declares no _no_split_modules, so the transformer wrap policy cannot pick its layers",
                where="strategy.transformer_layer_cls_to_wrap",
                hint="name the layer classes, or use auto_wrap_policy: size",
            )
        return names
    for name in requested:
        if name not in present:
            near = closest(name, sorted(present))
            raise UserError(
                f"the model has no layer class {name!r}",
                where="strategy.transformer_layer_cls_to_wrap",
                hint=f'did you mean "{near}"?' if near else f"its classes are: {', '.join(sorted(present))}",
            )
    return list(requested)


class TransformerLayerPolicy(WrapPolicy):
    name = "transformer"
    description = "each transformer layer (by class name; default: the model's _no_split_modules) is a unit"

    def build(self, model: Any, options: dict[str, Any]) -> Callable[[Any], bool]:
        names = set(layer_class_names(model, options.get("transformer_layer_cls_to_wrap")))
        return lambda module: type(module).__name__ in names


class SizePolicy(WrapPolicy):
    name = "size"
    description = "every submodule with at least min_num_params parameters is a unit"

    def build(self, model: Any, options: dict[str, Any]) -> Callable[[Any], bool]:
        minimum = options.get("min_num_params") or 100_000_000
        return lambda module: sum(p.numel() for p in module.parameters()) >= minimum


class NoWrapPolicy(WrapPolicy):
    name = "none"
    description = "no submodule is wrapped: the whole model is one unit"

    def build(self, model: Any, options: dict[str, Any]) -> Callable[[Any], bool]:
        return lambda module: False
