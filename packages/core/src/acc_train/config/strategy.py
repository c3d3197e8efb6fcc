"""A strategy name (or alias, or preset) and raw options -> a configured strategy.

The one place where a preset's options are merged under the user's and validated by the
strategy's own schema: the job, the worker, ``acc-train launch``, the wizard and the
conformance kit all resolve a strategy through :func:`resolve_strategy`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from acc_train.config.problems import format_validation_error, problem_lines
from acc_train.config.sources import Sources, deep_merge
from acc_train.errors import UserError
from acc_train.plugins import strategies
from acc_train.strategy import Strategy

__all__ = ["resolve_strategy", "strategy_problems", "split_strategy_section"]


def split_strategy_section(section: dict[str, Any], sources: Sources | None = None) -> tuple[str, dict[str, Any]]:
    """``{"name": ..., **options}`` -> (name, options); a missing name is an error."""
    options = dict(section)
    name = options.pop("name", None)
    if not isinstance(name, str) or not name:
        where = (sources.where("strategy.name") if sources else None) or "strategy.name"
        raise UserError("strategy.name must be set to a strategy name", where=where)
    return name, options


def _parse(name: str, raw_options: dict[str, Any]) -> tuple[Strategy[Any], Any]:
    """The registered strategy and its parsed options (preset < ``raw_options``); raises
    pydantic's ValidationError."""
    strategy = strategies().get(name)
    return strategy, strategy.parse_options(deep_merge(strategy.presets.get(name, {}), raw_options))


def resolve_strategy(name: str, raw_options: dict[str, Any] | None = None, sources: Sources | None = None) -> Strategy[Any]:
    """The strategy registered as ``name``, configured with the preset's options (when ``name``
    is a preset) overridden by ``raw_options``. An unknown name or a bad option is a
    :class:`UserError` naming the key path (and its file:line, given ``sources``)."""
    try:
        strategy, options = _parse(name, raw_options or {})
    except ValidationError as exc:
        schema = strategies().get(name).options_schema
        raise format_validation_error(exc, schema, sources or Sources(), prefix="strategy.") from None
    return strategy.configure(options)


def strategy_problems(section: dict[str, Any], sources: Sources) -> list[str]:
    """Every problem of a ``strategy:`` section, one line each (for ``config validate``)."""
    origin = sources.where("strategy.name")
    at = f" ({origin})" if origin else ""
    options = dict(section)
    name = options.pop("name", None)
    if not isinstance(name, str) or not name:
        return [f"strategy.name{at}: must be set to a strategy name"]
    try:
        _parse(name, options)
    except UserError as exc:
        return [f"strategy.name{at}: {exc.message}" + (f" ({exc.hint})" if exc.hint else "")]
    except ValidationError as exc:
        return problem_lines(exc, strategies().get(name).options_schema, sources, prefix="strategy.")
    return []
