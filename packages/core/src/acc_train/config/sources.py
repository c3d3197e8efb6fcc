"""Where config values come from: YAML files with the file:line of every key, ``--set`` items,
and the merge of layers (defaults < file < flags < ``--set``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from acc_train.errors import UserError
from acc_train.yaml_loader import Loader

__all__ = ["Loader", "Sources", "read_yaml_file", "parse_set", "set_dotted", "deep_merge"]


@dataclass
class Sources:
    """Where each dotted key's value came from, for error messages."""

    origins: dict[str, str] = field(default_factory=dict)

    def where(self, dotted: str) -> str | None:
        key = dotted
        while key:
            if key in self.origins:
                return self.origins[key]
            key = key.rpartition(".")[0]
        return None


def _yaml_lines(text: str, file: str) -> dict[str, str]:
    """dotted key -> "file:line" for every mapping key in a YAML document."""
    out: dict[str, str] = {}
    try:
        node = yaml.compose(text, Loader=Loader)
    except yaml.YAMLError:
        return out

    def walk(n: yaml.Node, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                dotted = f"{prefix}{k.value}"
                out[dotted] = f"{file}:{k.start_mark.line + 1}"
                walk(v, dotted + ".")

    if node is not None:
        walk(node, "")
    return out


def read_yaml_file(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    p = Path(path)
    if not p.is_file():
        raise UserError(
            f"config file {str(p)!r} does not exist" if not p.exists() else f"config file {str(p)!r} is not a file",
            where="--config",
            hint="check the path, or run `acc-train --print-config > job.yaml` to start one",
        )
    text = p.read_text(encoding="utf-8")
    try:
        data = yaml.load(text, Loader=Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        loc = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        problem = getattr(exc, "problem", None) or str(exc)
        raise UserError(f"not valid YAML: {problem}", where=loc, hint="fix the YAML syntax at that line") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"the file must hold a mapping of config keys, not a {type(data).__name__}", where=str(p))
    return data, _yaml_lines(text, str(p))


def parse_set(item: str) -> tuple[str, Any]:
    """``key.path=value`` -> (``key.path``, YAML-parsed value)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set expects key.path=value, got {item!r}", where="--set", hint="e.g. --set training.max_steps=50")
    try:
        value = yaml.load(raw, Loader=Loader) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(tree: dict[str, Any], dotted: str, value: Any, where: str) -> None:
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"{'.'.join(parts[: i + 1])} is not a section, so {dotted} cannot be set", where=where)
        node = child
    node[parts[-1]] = value


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out
