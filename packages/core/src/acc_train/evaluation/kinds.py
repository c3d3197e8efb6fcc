"""The evaluators a run calls: those the job asks for among the registered ones
(:class:`~acc_train.contracts.evaluator.EvaluatorKind`, registered by plugins through
``acc_train_register_evaluators``: core's three, the eval loss, ``eval.samples`` and
``eval.harness_tasks``, registered by core's own plugin, and any a plugin brings, asked for as
``eval.NAME`` in the job's config), what they may return, and what ``run.json`` keeps of them.

An evaluator is a function of the model as it stands: at every evaluation (``training.eval_every``
steps and after the last) the loop calls each evaluator the job asks for with an
:class:`EvalContext` and records the named metrics it returns, by one path for all of them: a row
of ``metrics.jsonl`` (``{"step": N, **metrics}``), every tracker, ``run.json``'s ``evaluations``,
``acc-train report`` and the model card. The kind and the context it is called with are a
contract plugins implement, in :mod:`acc_train.contracts.evaluator` (re-exported here and by
``acc_train.api``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from acc_train.contracts.evaluator import EvalContext, EvaluatorKind
from acc_train.outputs.metrics import TRAINING_KEYS

if TYPE_CHECKING:
    from acc_train.run import RunContext

__all__ = [
    "EvalContext", "EvaluatorKind", "job_evaluators", "evaluation_summary", "metrics_problem",
]  # fmt: skip


def job_evaluators(config: Any) -> list[EvaluatorKind]:
    """The registered evaluators the job asks for, in the order they registered (core's first)."""
    from acc_train.plugins import evaluators

    return [kind for kind, _ in evaluators().registered() if kind.asked(config)]


def evaluation_summary(run: RunContext, evaluations: dict[str, dict[str, Any]], taken: Any = ()) -> dict[str, Any]:
    """``run.json``'s ``evaluations`` (each evaluator's last metrics and their step, by name) and
    the keys each evaluator the job asks for keeps of its own (:meth:`EvaluatorKind.summary`);
    one that ``taken`` (core's keys) or another evaluator holds is left out, with a warning."""
    out: dict[str, Any] = {}
    for kind in job_evaluators(run.config):
        last = evaluations.get(kind.name)
        for key, value in kind.summary(run, last["step"] if last else None, last["metrics"] if last else None).items():
            if key in taken or key in out or key == "evaluations":
                sys.stderr.write(f"warning: evaluator {kind.name!r}'s run.json key {key!r} is taken; left out\n")
                continue
            out[key] = value
    return {"evaluations": evaluations, **out}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _value_problem(value: Any, key: str) -> str | None:
    if value is None or _is_number(value):
        return None
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{key} has a key {k!r} that is not a string"
            problem = _value_problem(v, f"{key}.{k}")
            if problem:
                return problem
        return None
    return f"{key} is {type(value).__name__} {value!r:.40}, not a number (or a mapping of names to numbers)"


def metrics_problem(metrics: Any) -> str | None:
    """What is wrong with what an evaluator returned (None: a mapping of metric names to
    numbers or nested mappings of them, none a training row's key)."""
    if not isinstance(metrics, Mapping):
        return f"returned {type(metrics).__name__}, not a mapping of metric names to values"
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            return f"returned a metric name {key!r} that is not a string"
        if key in TRAINING_KEYS:
            return f"returned a metric named {key!r}, a key of metrics.jsonl's training rows; name it after the evaluator"
        problem = _value_problem(value, key)
        if problem:
            return f"returned {problem}"
    return None
