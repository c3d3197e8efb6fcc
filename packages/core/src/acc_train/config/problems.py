"""pydantic's validation errors as lines a person can act on: key path, origin, what is wrong,
and the closest valid key for a misspelt one."""

from __future__ import annotations

import re
import reprlib
from typing import Any

from pydantic import BaseModel, ValidationError

from acc_train.config.sources import Sources
from acc_train.errors import UserError, closest

__all__ = ["format_validation_error", "problem_lines", "short_repr"]

_REPR = reprlib.Repr()  # keyword arguments need Python 3.12
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 6, 6, 60, 60, 40


def short_repr(value: Any, limit: int = 120) -> str:
    """A value as a message shows it: never longer than ``limit`` however big the value is."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _model_fields_at(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    """Valid keys of the section at ``path`` (for "did you mean")."""
    current: Any = model
    for part in path:
        fld = getattr(current, "model_fields", {}).get(part)
        if fld is None:
            return []
        current = fld.annotation
    return list(getattr(current, "model_fields", {}))


def format_validation_error(
    exc: ValidationError, schema: type[BaseModel], sources: Sources, prefix: str = ""
) -> UserError:
    """One message listing every problem with its key path and origin."""
    lines = problem_lines(exc, schema, sources, prefix)
    head = "invalid config" if len(lines) > 1 else "invalid config: " + lines[0]
    body = "\n  " + "\n  ".join(lines) if len(lines) > 1 else ""
    return UserError(head + body, hint="fix the value(s) above; `acc-train --print-config` shows the resolved config")


def problem_lines(exc: ValidationError, schema: type[BaseModel], sources: Sources, prefix: str = "") -> list[str]:
    """``key.path (file:line): what is wrong``, one per problem pydantic found."""
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        dotted = prefix + ".".join(str(p) for p in loc) if loc else prefix.rstrip(".") or "config"
        origin = sources.where(dotted)
        at = f" ({origin})" if origin else ""
        if err["type"] == "extra_forbidden":
            near = closest(str(loc[-1]), _model_fields_at(schema, loc[:-1]))
            suggestion = f'; did you mean "{prefix}{".".join(str(p) for p in loc[:-1] + (near,))}"?' if near else ""
            valid = ", ".join(_model_fields_at(schema, loc[:-1]))
            lines.append(f"{dotted}{at}: unknown key{suggestion} (valid keys here: {valid})")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "value_error":  # a rule across keys: say where each key it names came from
                named = (sources.origins.get(key) for key in re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+\b", msg))
                origins = [o for o in dict.fromkeys(named) if o and o != origin]
                at += f" ({', '.join(origins)})" if origins else ""
            got = ""
            if err["type"] not in {"missing"} and "input" in err and not isinstance(err["input"], dict):
                got = f" (got {short_repr(err['input'])})"
            lines.append(f"{dotted}{at}: {msg}{got}")
    return lines
