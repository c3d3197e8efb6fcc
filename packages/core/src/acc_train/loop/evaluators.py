"""Core's three evaluators, registered by core's own plugin through ``acc_train_register_evaluators``
as a plugin registers its own: the eval loss (whenever the job has eval data), generation
samples (``eval.samples``) and lm-evaluation-harness tasks (``eval.harness_tasks``). Each keeps
the config keys and ``run.json`` keys it had before evaluators were plugins."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from acc_train.contracts.evaluator import EvaluatorKind

if TYPE_CHECKING:
    from acc_train.run import RunContext

__all__ = ["EvalLoss", "GenerationSamples", "HarnessScores", "builtin_evaluator_kinds"]

Step = Callable[[int], "Mapping[str, Any] | None"]


class EvalLoss(EvaluatorKind):
    """``eval_loss``: the mean loss per token over the eval data, all ranks together."""

    @property
    def where(self) -> str:
        return "data.eval_files / data.eval_fraction"

    def asked(self, config: Any) -> bool:
        return True  # whenever there is eval data (start says)

    def start(self, run: RunContext, eval_dataloader: Any = None) -> Step | None:
        if eval_dataloader is None:
            return None
        from acc_train.loop.loss import eval_loss, packed_mask_kind

        accelerator, model = run.accelerator, run.model
        mask = packed_mask_kind(accelerator.unwrap_model(model))
        attention_config = getattr(accelerator.unwrap_model(model), "config", None) if mask == "bool" else None
        return lambda step: {"eval_loss": eval_loss(accelerator, model, eval_dataloader, mask, attention_config)}

    def summary(self, run: RunContext, step: int | None, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
        return {"final_eval_loss": (metrics or {}).get("eval_loss")}


class _SamplesStep:
    def __init__(self, samples: Any) -> None:
        self.samples = samples

    def __call__(self, step: int) -> None:
        self.samples.at_evaluation(step)  # rows go to samples.jsonl and the trackers that take text, not to metrics

    def close(self) -> None:
        self.samples.close()


class GenerationSamples(EvaluatorKind):
    """``eval.samples``: every prompt completed (:mod:`acc_train.loop.samples`); no metrics."""

    @property
    def where(self) -> str:
        return "eval.samples"

    def asked(self, config: Any) -> bool:
        return True  # a resumed run without prompts still trims samples.jsonl to its step (start)

    def start(self, run: RunContext, eval_dataloader: Any = None) -> Step | None:
        from acc_train.loop.samples import Samples

        samples = Samples(run, run.step)
        return _SamplesStep(samples) if samples.active else None

    def summary(self, run: RunContext, step: int | None, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
        from acc_train.loop.samples import samples_summary

        return {"samples": samples_summary(run)}


class HarnessScores(EvaluatorKind):
    """``eval.harness_tasks``: ``harness``, ``{task: {metric: value}}`` (:func:`acc_train.evaluation.harness.run_harness`)."""

    @property
    def where(self) -> str:
        return "eval.harness_tasks"

    def asked(self, config: Any) -> bool:
        return bool(config.eval.harness_tasks)

    def check(self, config: Any) -> None:
        from acc_train.evaluation.harness import check_job_harness

        check_job_harness(config)  # lm-eval installed, every task known and loadable

    def start(self, run: RunContext, eval_dataloader: Any = None) -> Step | None:
        from acc_train.evaluation.harness import run_harness

        return lambda step: {"harness": run_harness(run, step)}

    def summary(self, run: RunContext, step: int | None, metrics: Mapping[str, Any] | None) -> dict[str, Any]:
        return {"harness": (metrics or {}).get("harness"), "harness_step": step}


def builtin_evaluator_kinds() -> list[EvaluatorKind]:
    """Core's evaluators, in the order a run calls them."""
    return [
        EvalLoss("eval_loss", description="the mean loss per token over the eval data"),
        GenerationSamples("samples", description="completions of eval.samples, into samples.jsonl"),
        HarnessScores("harness_tasks", requires=("lm_eval",), description="lm-evaluation-harness tasks"),
    ]
