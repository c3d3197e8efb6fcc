"""Wrap policies: which submodules become separately sharded FSDP units.

A wrap policy's ``build(model, options)`` returns a predicate over modules. The built-in
``transformer`` and ``size`` policies are also expressed in Accelerate's own terms, so both
FSDP versions apply them natively.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from acc_train.api import UserError, WrapPolicy, closest

__all__ = ["TransformerLayerPolicy", "SizePolicy", "NoWrapPolicy", "layer_class_names", "check_units", "apply_wrap_policy", "DEFAULT_MIN_NUM_PARAMS"]

#: the size policy's unit size when ``min_num_params`` is unset
DEFAULT_MIN_NUM_PARAMS = 100_000_000


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
    """Refuse a wrap policy that puts most of the model's layers (its ``_no_split_modules``
    classes, what the transformer policy wraps one by one) into one unit: the root (a policy
    that wraps nothing, or too little) or a unit around them all (a size policy whose minimum
    is above one layer and below the whole stack). FSDP gathers a unit at once, in every
    forward and backward: a model that needs sharding runs out of memory (on a cluster, after
    the queue and the download). ``none`` asks for one unit on purpose and is not checked."""
    if policy.name == "none":
        return
    predicate = policy.build(model, options)
    units = [m for m in model.modules() if m is not model and predicate(m)]
    owner: dict[int, Any] = {}  # each parameter's innermost unit (the model: the root unit)
    for unit in [model, *units]:  # modules() is outer before inner: the innermost wins
        for p in unit.parameters():
            owner[id(p)] = unit
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not total or len(layers) < 2:
        return
    held: dict[int, set[int]] = {}  # unit -> the layers some of whose parameters it holds
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            held.setdefault(id(owner[id(p)]), set()).add(i)
    by_id = {id(u): u for u in [model, *units]}
    for unit_id, index in held.items():
        if len(index) < 2:
            continue
        unit = by_id[unit_id]
        in_unit = sum(p.numel() for p in params if owner[id(p)] is unit)
        if in_unit * 2 <= total:
            continue
        where = "the root unit" if unit is model else f"one {type(unit).__name__} unit"
        share = f"{in_unit / total:.1%} of the parameters ({in_unit:,} of {total:,})"
        largest = max(sum(p.numel() for p in layers[i].parameters()) for i in index)
        hint = (
            f"set strategy.min_num_params below {largest:,} (one layer's parameters), or use auto_wrap_policy: transformer"
            if policy.name == "size"
            else "use auto_wrap_policy: transformer, or auto_wrap_policy: none to keep one unit on purpose"
        )
        raise UserError(
            f"wrap policy {policy.name!r} puts {len(index)} of the model's {len(layers)} {type(layers[next(iter(index))]).__name__} layers "
            f"into {where}, {share}: FSDP would gather them all at once in every step",
            where="strategy.auto_wrap_policy",
            hint=hint,
        )


def apply_wrap_policy(plugin: Any, model: Any, options: Any) -> None:
    """Resolve the registered wrap policy ``options.auto_wrap_policy`` against ``model``, in
    Accelerate's terms, on its FSDP ``plugin``."""
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

    from acc_train.api import wrap_policies

    policy = wrap_policies().get(options.auto_wrap_policy)
    if policy.name == "transformer":
        plugin.transformer_cls_names_to_wrap = layer_class_names(model, options.transformer_layer_cls_to_wrap)
        plugin.auto_wrap_policy = transformer_auto_wrap_policy
    elif policy.name == "size":
        plugin.min_num_params = options.min_num_params or DEFAULT_MIN_NUM_PARAMS
        plugin.auto_wrap_policy = size_based_auto_wrap_policy
    elif policy.name == "none":
        plugin.auto_wrap_policy = None
    else:  # a plugin's policy: a predicate over modules
        predicate = policy.build(model, options.model_dump())
        if options.version == 1:
            plugin.auto_wrap_policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=predicate)
        else:  # Accelerate's FSDP2 path wraps by layer class: the predicate must select whole classes
            modules = [m for m in model.modules() if m is not model]
            chosen = {type(m) for m in modules if predicate(m)}
            if any(type(m) in chosen and not predicate(m) for m in modules):
                raise UserError(
                    f"wrap policy {policy.name!r} selects some modules of a class but not others; FSDP2 here wraps by layer class",
                    where="strategy.auto_wrap_policy",
                    hint="use it with version: 1, or make it select whole classes",
                )
            plugin.transformer_cls_names_to_wrap = sorted(c.__name__ for c in chosen)
            plugin.auto_wrap_policy = transformer_auto_wrap_policy if chosen else None
