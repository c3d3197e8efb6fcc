"""The one YAML loader for configs, ``--set`` values, accelerate config files and the wizard's
answers: YAML as people write it (``1e-4`` is a float), refusing what a person never means.

Refused, as a ``yaml.MarkedYAMLError`` (so every caller that handles a syntax error handles these
too, with the file and line of the mark):

- a key given twice in one mapping (PyYAML keeps the last silently), naming both lines;
- aliases that expand the document beyond :data:`MAX_ALIAS_EXPANSION` nodes ("billion laughs":
  a few lines that would build, print or walk billions of values), and an alias inside its own
  anchor (a structure that contains itself);
- nesting deeper than :data:`MAX_DEPTH`, which no config needs and which would otherwise end in
  a ``RecursionError`` somewhere downstream.

The checks walk the composed node graph once, counting each anchored node once, so they cost
time linear in the text, never in its expansion.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

__all__ = ["Loader", "YamlRefused", "MAX_ALIAS_EXPANSION", "MAX_DEPTH", "load_yaml"]

#: nodes that aliases may add to a document (a config has hundreds of nodes)
MAX_ALIAS_EXPANSION = 10_000
#: nesting depth of collections (a config nests four or five levels)
MAX_DEPTH = 64


class YamlRefused(yaml.MarkedYAMLError):
    """Valid YAML that acc-train refuses: a duplicate key, an alias bomb, absurd nesting."""


def _where(mark: yaml.Mark | None) -> str:
    return f"{mark.name}:{mark.line + 1}" if mark is not None else "?"


class _Walk:
    """One pass over a composed document: duplicate keys, alias expansion, depth."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}  # id(node) -> expanded size, for nodes already walked
        self.open: set[int] = set()  # nodes being walked: an alias to one of them is a cycle
        self.distinct = 0

    def size(self, node: yaml.Node, depth: int = 0) -> int:
        known = self.sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in self.open:
            raise YamlRefused(problem="an alias refers to the anchor that contains it (the value would contain itself)", problem_mark=node.start_mark)
        if depth > MAX_DEPTH:
            raise YamlRefused(problem=f"values nest more than {MAX_DEPTH} levels deep", problem_mark=node.start_mark)
        self.distinct += 1
        total = 1
        if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            self.open.add(id(node))
            if isinstance(node, yaml.MappingNode):
                _refuse_duplicate_keys(node)
                children = [n for pair in node.value for n in pair]
            else:
                children = list(node.value)
            for child in children:
                total += self.size(child, depth + 1)
            self.open.discard(id(node))
        self.sizes[id(node)] = total
        if total - self.distinct > MAX_ALIAS_EXPANSION:
            raise YamlRefused(
                problem=f"aliases (*name) expand this document by more than {MAX_ALIAS_EXPANSION:,} values "
                "(an alias bomb?); write the values out, or use fewer nested aliases",
                problem_mark=node.start_mark,
            )
        return total


def _refuse_duplicate_keys(node: yaml.MappingNode) -> None:
    seen: dict[tuple[str, str], yaml.Node] = {}
    for key, _value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.value == "<<" and key.tag.endswith(":merge"):
            continue
        first = seen.setdefault((key.tag, key.value), key)
        if first is not key:
            raise YamlRefused(
                context=f"key {key.value!r} first given at {_where(first.start_mark)}",
                context_mark=first.start_mark,
                problem=f"key {key.value!r} is given twice ({_where(first.start_mark)} and {_where(key.start_mark)}); keep one",
                problem_mark=key.start_mark,
            )


class Loader(yaml.SafeLoader):
    """YAML as people write it (``1e-4`` is a float, where PyYAML's YAML 1.1 rules read text),
    refusing duplicate keys, alias bombs and absurd nesting."""

    def compose_document(self) -> Any:
        try:
            node = super().compose_document()
        except RecursionError:
            raise YamlRefused(problem=f"values nest too deeply (more than {MAX_DEPTH} levels)", problem_mark=self.get_mark()) from None
        if node is not None:
            _Walk().size(node)
        return node


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml(text: str, name: str = "<string>") -> tuple[Any, yaml.Node | None]:
    """The value of a one-document YAML ``text`` and its node graph (for line numbers); marks in
    errors carry ``name`` (the file). Raises ``yaml.YAMLError``."""
    loader = Loader(text)
    loader.name = name
    try:
        node = loader.get_single_node()
        try:
            value = loader.construct_document(node) if node is not None else None
        except RecursionError:
            raise YamlRefused(problem="values nest too deeply", problem_mark=node.start_mark if node else None) from None
        return value, node
    finally:
        loader.dispose()
