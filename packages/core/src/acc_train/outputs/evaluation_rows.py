"""How ``acc-train report`` shows the evaluators' metrics: every evaluator's alike, by the
names and shapes of its metrics (:func:`evaluation_rows`), never by which evaluator wrote them."""

from __future__ import annotations

import math
import reprlib
from typing import Any

__all__ = ["evaluation_rows"]


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother = 40, 40


def _fmt_number(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    return f"{value:.4f}" if abs(value) < 1e9 else f"{value:.4g}"


def _fmt_value(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return _fmt_number(value)
    return _REPR.repr(value)


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def evaluation_rows(evaluations: list[tuple[Any, dict[str, Any]]]) -> list[tuple[str, str]]:
    """The report's rows of the evaluators' last metrics (``evaluations``: (step, metrics) of
    each evaluator's row, in the order written), one path for every evaluator: each metric by its name
    (``_`` read as a space: ``eval loss``) with the step it was taken after; a metric that is a
    mapping of metrics is one row (``NAME  m v, m v (step N)``), one of mappings one row per
    entry (``harness TASK  acc 0.2500, ... (step N)``), with how its first metric moved over the
    run when it was taken more than once (standard errors, ``*_stderr``, are not shown)."""
    last: dict[str, tuple[Any, Any]] = {}
    history: dict[str, list[Any]] = {}
    for step, metrics in evaluations:
        for name, value in metrics.items():
            last[name] = (step, value)
            history.setdefault(name, []).append(value)
    out: list[tuple[str, str]] = []
    for name, (step, value) in last.items():
        label = name.replace("_", " ")
        if not isinstance(value, dict):
            out.append((label, f"{_fmt_value(value)} (step {step})"))
            continue
        nested = bool(value) and all(isinstance(v, dict) for v in value.values())
        parts = [(f"{label} {key}", value[key], [h.get(key) for h in history[name] if isinstance(h, dict)]) for key in value] if nested else [(label, value, history[name])]
        for row_label, metrics, earlier in parts:
            shown_metrics = {m: v for m, v in _flat(metrics).items() if not m.endswith("_stderr")}
            shown = ", ".join(f"{m} {_fmt_value(v)}" for m, v in shown_metrics.items()) + f" (step {step})"
            first = next(iter(shown_metrics), None)
            moves = [_flat(h)[first] for h in earlier if isinstance(h, dict) and first in _flat(h)]
            if len(moves) > 1:
                shown += f"; {first} by evaluation: " + " -> ".join(_fmt_value(v) for v in moves)
            out.append((row_label, shown))
    return out
