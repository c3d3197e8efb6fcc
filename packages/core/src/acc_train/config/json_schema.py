"""A JSON Schema of the whole config, for editors that complete and check YAML files.

Core's sections come from the pydantic models; the ``strategy`` section is one choice per
installed strategy, told apart by ``name`` (its name, aliases and presets), each with that
strategy's own options schema; the ``eval`` section has a key per installed evaluator a plugin
registered (``eval.NAME``: its options schema, or ``true``). Cross-field rules (``stage`` 3 for ``offload_param``, ...) are
not expressible here: ``acc-train config validate`` checks those.
"""

from __future__ import annotations

from typing import Any

from acc_train.config.schema import JobConfig
from acc_train.plugins import evaluators, strategies
from acc_train.strategy import DEFAULT_STRATEGY

__all__ = ["job_json_schema", "SCHEMA_DIALECT"]

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def job_json_schema() -> dict[str, Any]:
    """The schema, for the strategies installed here."""
    schema = JobConfig.model_json_schema()
    defs: dict[str, Any] = schema.setdefault("$defs", {})
    choices: list[dict[str, Any]] = []
    all_names: list[str] = []
    for strategy, _owner in strategies().primary():
        prefix = f"strategy-{strategy.name}-"
        options = strategy.options_schema.model_json_schema(ref_template=f"#/$defs/{prefix}{{model}}")
        for name, sub in options.pop("$defs", {}).items():
            defs[prefix + name] = sub
        names = strategy.all_names()
        all_names += names
        choice = {
            "title": f"strategy {strategy.name}",
            "description": strategy.description,
            "type": "object",
            "properties": {"name": {"enum": names, "description": "strategy, alias or preset name"}, **options.get("properties", {})},
            "additionalProperties": False,
        }
        if strategy.name != DEFAULT_STRATEGY:  # a section without a name means the default
            choice["required"] = ["name"]
        choices.append(choice)
    shorthand = {"type": "string", "enum": sorted(all_names), "description": "`strategy: NAME`, the strategy's defaults"}
    schema["properties"]["strategy"] = {
        "title": "Strategy",
        "description": "`name` plus the options whose schema the strategy owns",
        "default": {"name": DEFAULT_STRATEGY},
        "anyOf": [*choices, shorthand],
    }
    _evaluator_keys(defs)
    return {"$schema": SCHEMA_DIALECT, **schema, "title": "acc-train config"}


def _evaluator_keys(defs: dict[str, Any]) -> None:
    """The ``eval`` section's keys of the installed evaluators plugins registered (core's are its settings)."""
    section = defs["EvalConfig"]
    for kind, _owner in evaluators().registered():
        if kind.where != f"eval.{kind.name}" or kind.name in section["properties"]:
            continue
        prefix = f"evaluator-{kind.name}-"
        options: dict[str, Any] = {"type": "object", "additionalProperties": False}
        if kind.options_schema is not None:
            options = kind.options_schema.model_json_schema(ref_template=f"#/$defs/{prefix}{{model}}")
            for name, sub in options.pop("$defs", {}).items():
                defs[prefix + name] = sub
        section["properties"][kind.name] = {
            "title": f"evaluator {kind.name}",
            "description": kind.description or f"the evaluator {kind.name!r}: its options, or true for its defaults",
            "anyOf": [options, {"const": True}],
        }
    section["additionalProperties"] = False
