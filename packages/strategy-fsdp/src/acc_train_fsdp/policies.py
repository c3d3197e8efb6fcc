"""Wrap policies: which submodules become separately sharded FSDP units.

A wrap policy's ``build(model, options)`` returns a predicate over modules. The built-in
``transformer`` and ``size`` policies are also expressed in Accelerate's own terms, so both
FSDP versions apply them natively.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from acc_train.api import UserError, WrapPolicy, closest

__all__ = ["TransformerLayerPolicy", "SizePolicy", "NoWrapPolicy", "layer_class_names", "check_units"]


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


def check_units(model: Any, policy: WrapPolicy, options: dict[str, Any]) -> None:
    """Refuse a wrap policy that leaves most of the model in the root unit with its layers in it:
    FSDP would gather all of them at once, in every forward and backward, and a model that needs
    sharding runs out of memory (on a cluster, after the queue and the download). ``none`` asks
    for one unit on purpose and is not checked; a layer is a class of the model's
    ``_no_split_modules`` (what the transformer policy wraps)."""
    if policy.name == "none":
        return
    predicate = policy.build(model, options)
    units = [m for m in model.modules() if m is not model and predicate(m)]
    covered = {id(p) for unit in units for p in unit.parameters()}
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    in_root = sum(p.numel() for p in params if id(p) not in covered)
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    left = [m for m in layers if any(id(p) not in covered for p in m.parameters())]
    if not total or in_root * 2 <= total or (layers and not left):
        return
    share = f"{in_root / total:.1%} of the parameters ({in_root:,} of {total:,})"
    what = f"{len(left)} of its {len(layers)} {type(left[0]).__name__} layers" if left else "every submodule"
    largest = max((sum(p.numel() for p in m.parameters()) for m in left), default=0)
    hint = (
        f"lower strategy.min_num_params to at most {largest:,} (one layer's parameters), or use auto_wrap_policy: transformer"
        if policy.name == "size"
        else "use auto_wrap_policy: transformer, or auto_wrap_policy: none to keep one unit on purpose"
    )
    raise UserError(
        f"wrap policy {policy.name!r} wraps {'nothing' if not units else f'{len(units)} units'} and leaves {what} in the root unit, "
        f"{share}: FSDP would gather them all at once in every step",
        where="strategy.auto_wrap_policy",
        hint=hint,
    )
