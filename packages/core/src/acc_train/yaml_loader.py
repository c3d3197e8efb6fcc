"""YAML as people write it: ``1e-4`` is a float (PyYAML's YAML 1.1 rules read it as text).
The one loader for configs, ``--set`` values and the wizard's answers."""

from __future__ import annotations

import re

import yaml

__all__ = ["Loader"]


class Loader(yaml.SafeLoader):
    """YAML as people write it: ``1e-4`` is a float (PyYAML's YAML 1.1 rules read it as text)."""


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
