"""Where config values come from: YAML files with the file:line of every key, ``--set`` items,
and the merge of layers (defaults < file < flags < ``--set``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from acc_train.errors import UserError
from acc_train.files.user_files import read_user_text
from acc_train.files.yaml_loader import Loader, YamlRefused, load_yaml

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


def _yaml_lines(node: yaml.Node | None, file: str) -> dict[str, str]:
    """dotted key -> "file:line" for every mapping key in a composed YAML document (the loader
    has bounded its aliases, so this walk is bounded too)."""
    out: dict[str, str] = {}

    def walk(n: yaml.Node, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                dotted = f"{prefix}{k.value}" if isinstance(k, yaml.ScalarNode) else f"{prefix}?"
                out.setdefault(dotted, f"{file}:{k.start_mark.line + 1}")
                walk(v, dotted + ".")

    if node is not None:
        walk(node, "")
    return out


def _yaml_problem(exc: yaml.YAMLError, file: str) -> tuple[str, str]:
    """(message, file:line:column) of a YAML error."""
    mark = getattr(exc, "problem_mark", None)
    loc = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else file
    problem = getattr(exc, "problem", None) or str(exc)
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start and not isinstance(exc, YamlRefused):  # "while parsing a flow sequence" opened here
        problem += f" ({context} at {file}:{start.line + 1})"
    return problem, loc


def read_yaml_file(path: str | Path, where: str = "--config", what: str = "config file") -> tuple[dict[str, Any], dict[str, str]]:
    """A YAML file of config sections and the file:line of each key; ``where`` names the flag or
    variable that named the file. Every problem is a :class:`UserError` naming the file."""
    text = read_user_text(path, what=what, where=where, hint="check the path, or run `acc-train --print-config > job.yaml` to start one")
    file = str(path)
    try:
        data, node = load_yaml(text, file)
    except yaml.YAMLError as exc:
        problem, loc = _yaml_problem(exc, file)
        hint = None if isinstance(exc, YamlRefused) else "fix the YAML syntax at that line"
        raise UserError(f"not valid YAML: {problem}" if hint else problem, where=loc, hint=hint) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"the file must hold a mapping of config keys, not a {type(data).__name__}", where=file)
    for key in data:
        if not isinstance(key, str):
            line = _yaml_lines(node, file).get(str(key), file)
            raise UserError(f"config keys are names, not {type(key).__name__} {key!r}", where=line)
    return data, _yaml_lines(node, file)


def parse_set(item: str) -> tuple[str, Any]:
    """``key.path=value`` -> (``key.path``, YAML-parsed value)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"--set expects key.path=value, got {item!r}", where="--set", hint="e.g. --set training.max_steps=50")
    try:
        value = load_yaml(raw, "--set")[0] if raw.strip() else ""
    except YamlRefused as exc:
        raise UserError(f"{exc.problem}", where=f"--set {item}") from None
    except yaml.YAMLError:
        value = raw  # not YAML: the text as given
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
