"""The config reference, generated from the live pydantic schema (core's sections and every
installed strategy's options), so the page cannot drift from the code: a key added to the
schema appears on the next build. ``docs/_gen/pages.py`` writes it during ``mkdocs build``;
``tests/core/test_docs_site.py`` checks every key is there with its default and description.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = ["config_keys", "config_reference"]

SECTION_INTRO = {
    "": "Keys at the top level of the file.",
    "optimizer": "Defaults are the demo job's; a job naming `model.name_or_path` gets fine-tuning defaults for the keys it leaves unset (`lr` 2e-5, `weight_decay` 0, `betas` [0.9, 0.999]).",
    "eval": "When a run evaluates is `training.eval_every` (and after the last step); `training.eval_batches` is how much `eval_loss` reads. A chat message (`eval.samples`) is `{role, content}`. [Samples while it trains](../guides/look-at-what-you-trained.md#samples-while-it-trains). Any other key names an evaluator a plugin registered, `eval.NAME: {its options}` ([evaluators](../guides/evaluators.md)).",
    "launch": "Keys left unset fill themselves from Slurm's or torchrun's variables ([Clusters](../cluster.md)).",
}


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin in (list, tuple):
        return f"list[{_type(args[0])}]" if args else "list"
    if origin is dict:
        return f"mapping[{_type(args[0])}, {_type(args[1])}]" if args else "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field: FieldInfo) -> str:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}
    out = []
    for meta in field.metadata:
        for attr, word in words.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{word} {value}")
    return ", ".join(out)


def _default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return value


def _models(annotation: Any) -> list[type[BaseModel]]:
    args = typing.get_args(annotation) or (annotation,)
    return [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]


def config_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """Every key of ``model`` as a dotted path, nested sections included (depth first)."""
    out: list[tuple[str, FieldInfo]] = []
    for name, field in model.model_fields.items():
        path = prefix + name
        out.append((path, field))
        for sub in _models(field.annotation):
            out += config_keys(sub, path + ".")
    return out


def _entry(path: str, field: FieldInfo, level: str) -> list[str]:
    bits = [f"**type** `{_type(field.annotation)}`"]
    if (c := _constraints(field)):
        bits.append(c)
    if not _models(field.annotation) or field.default is not PydanticUndefined:
        bits.append(f"**default** `{json.dumps(_default(field))}`")
    return [f"{level} `{path}`", "", " · ".join(bits), "", field.description or "*(no description)*", ""]


def config_reference() -> str:
    """The whole page, as Markdown."""
    from acc_train.config.schema import JobConfig
    from acc_train.plugins import strategies

    lines = [
        "# Config reference",
        "",
        "<!-- generated from the pydantic schema by docs/_gen/reference.py -->",
        "",
        "Every key of a job file, generated from the schema `acc-train` validates against (the same",
        "text `acc-train config schema` gives editors). Values resolve in this order: defaults <",
        "config file (`--config`) < flags < `--set key.path=value`. Unknown keys are errors at every",
        "level. [Configuration](../concepts/config.md) explains the rules that span keys.",
        "",
    ]
    top = [(p, f) for p, f in config_keys(JobConfig) if "." not in p and not _models(f.annotation) and p != "strategy"]
    lines += ["## Top level", "", SECTION_INTRO[""], ""]
    for path, field in top:
        lines += _entry(path, field, "###")
    for name, field in JobConfig.model_fields.items():
        if not _models(field.annotation):
            continue
        lines += [f"## `{name}`", "", field.description or "", "", SECTION_INTRO.get(name, ""), ""]
        for path, sub in config_keys(_models(field.annotation)[0], name + "."):
            lines += _entry(path, sub, "###")
    lines += [
        "## `strategy`",
        "",
        "`strategy.name` picks a strategy, one of its aliases or a preset (`acc-train strategies` lists",
        "them); the other keys are that strategy's own options, validated by its schema. `strategy: NAME`",
        "is short for `{name: NAME}`.",
        "",
    ]
    for strategy, owner in strategies().primary():
        names = ", ".join(f"`{n}`" for n in strategy.all_names())
        lines += [f"## Strategy `{strategy.name}`", "", f"{strategy.description}. Names: {names}. Plugin: `{owner}`.", ""]
        if strategy.presets:
            lines += ["| preset | options |", "|---|---|"]
            lines += [f"| `{p}` | `{json.dumps(o)}` |" for p, o in strategy.presets.items()]
            lines.append("")
        for path, sub in config_keys(strategy.options_schema, "strategy."):
            lines += _entry(path, sub, "###")
    return "\n".join(lines)
