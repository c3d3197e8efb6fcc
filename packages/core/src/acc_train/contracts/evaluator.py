"""What an evaluator is, as a plugin registers it through ``acc_train_register_evaluators``: an
:class:`EvaluatorKind` (its name under the config's ``eval`` section, its options schema, the
function called at each evaluation) and the :class:`EvalContext` that function gets. The run
side (which evaluators a job asks for, what is recorded of them) is :mod:`acc_train.evaluation.kinds`.
Nothing here imports torch, or a plugin's evaluator, at import time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from acc_train.errors import UserError

if TYPE_CHECKING:
    from pydantic import BaseModel

    # an evaluator is handed an acc_train.run.RunContext; typed by its protocol, as run.py sits above
    from acc_train.contracts.protocols import RunView as RunContext

__all__ = ["EvalContext", "EvaluatorKind", "Evaluate"]


@dataclass
class EvalContext:
    """What an evaluator gets at each evaluation, on every rank."""

    #: the run: job, accelerator, output directory, ``extras`` (a plugin's per-run state)
    run: RunContext
    #: the optimizer step after which the evaluation runs
    step: int
    #: the evaluator's options (``eval.NAME``), validated by its ``options_schema``; None without one
    options: Any = None
    #: the job's eval data (``data.eval_files``/``data.eval_fraction``), as the loop reads it; None without any
    eval_dataloader: Any = None

    @property
    def model(self) -> Any:
        """The model as it trains (prepared by the strategy); to generate with it, use
        ``run.job.strategy.generation_model(accelerator, model)`` (what ``eval.samples`` does)."""
        return self.run.model

    @property
    def accelerator(self) -> Any:
        return self.run.accelerator

    @property
    def is_main_process(self) -> bool:
        return self.run.is_main_process


#: an evaluation: the named metrics of one evaluation (numbers, or mappings of them to any depth,
#: such as ``{task: {metric: value}}``), or None for none
Evaluate = Callable[[EvalContext], "Mapping[str, Any] | None"]


@dataclass(frozen=True)
class EvaluatorKind:
    """An evaluation a job can ask for, as ``eval.NAME`` (``eval: {NAME: {OPTIONS}}``, or
    ``eval: {NAME: true}`` for its defaults).

    ``evaluate``: the function called at each evaluation with an :class:`EvalContext`, on every
    rank in step (it may use collectives), returning the named metrics; or ``"module:function"``,
    imported only when a run starts it (registering costs no import). ``options_schema``: a
    pydantic model of ``eval.NAME``'s options (strict: unknown keys refused, as everywhere in the
    config); None: it takes none. ``requires``: modules any one of which must import for it to run.

    The metrics the main process returns are recorded: a row of ``metrics.jsonl`` per evaluator
    and evaluation, every tracker (nested names joined by ``/``), ``run.json``'s
    ``evaluations[NAME]`` (the last ones, and their step), ``acc-train report`` and the model
    card (metrics shaped ``{dataset: {metric: value}}`` also as its ``model-index``). Name them
    after the evaluator (``probe_acc``, or ``{"probe": {...}}``): a row's keys are shared by
    every evaluator, and a training row's (``loss``, ``lr``, ...) are refused.

    Subclasses may override :meth:`asked` (what in the config asks for it), :meth:`check` (a
    problem found before launch) and :meth:`start` (per-run setup), as core's own do.
    """

    name: str
    evaluate: Evaluate | str | None = None
    options_schema: type[BaseModel] | None = None
    requires: tuple[str, ...] = ()
    description: str = ""

    @property
    def where(self) -> str:
        """The config key that asks for it (named in its errors)."""
        return f"eval.{self.name}"

    def asked(self, config: Any) -> bool:
        """Whether the job ``config`` asks for it (``eval.NAME`` is given)."""
        return self.name in (config.eval.model_extra or {})

    def options(self, config: Any) -> Any:
        """``eval.NAME``'s options, validated (None where it takes none)."""
        if self.options_schema is None:
            return None
        value = (config.eval.model_extra or {}).get(self.name)
        return self.options_schema.model_validate(value if isinstance(value, dict) else {})

    def check(self, config: Any) -> None:
        """Before launch: raise a :class:`~acc_train.errors.UserError` for what would fail at
        the first evaluation (a missing library, a file that is not there). By default: one of
        ``requires`` imports."""
        import importlib.util

        if self.requires and not any(importlib.util.find_spec(m) for m in self.requires):
            raise UserError(f"evaluator {self.name!r} needs {self.requires[0]}, which is not installed", where=self.where, hint=f"pip install {self.requires[0]}")

    def function(self) -> Evaluate:
        if isinstance(self.evaluate, str):
            module, _, attr = self.evaluate.partition(":")
            return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
        if self.evaluate is None:
            raise NotImplementedError(f"evaluator {self.name!r} has no evaluate function")
        return self.evaluate

    def start(self, run: RunContext, eval_dataloader: Any = None) -> Callable[[int], Mapping[str, Any] | None] | None:
        """This run's evaluation, called with the step at each evaluation (every rank); None
        when it has nothing to do in this run. May have a ``close()``, called after the loop."""
        function, options = self.function(), self.options(run.config)
        return lambda step: function(EvalContext(run, step, options, eval_dataloader))

    def summary(self, run: RunContext, step: int | None, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
        """``run.json`` keys of its own besides ``evaluations[NAME]``, from its last metrics and
        their step (None: it returned none in this launch); a key core writes itself is refused. None by default; core's built-ins keep
        the keys they had before evaluators were plugins (``final_eval_loss``, ``samples``,
        ``harness``, ``harness_step``)."""
        return {}
