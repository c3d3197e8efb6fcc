"""The settings of benchmark tasks run through lm-evaluation-harness during training
(:mod:`acc_train.evaluation.harness`): which tasks, where local task YAMLs are, how many examples."""

from __future__ import annotations

from pydantic import Field

from acc_train.config.base import Count, NonEmptyStr, NonNegativeCount, Section

__all__ = ["HarnessSettings"]


class HarnessSettings(Section):
    """``eval.harness_*``: lm-evaluation-harness tasks run at every evaluation step and after the
    last step (needs ``pip install 'acc-train-core[eval]'``)."""

    harness_tasks: list[NonEmptyStr] = Field(
        default_factory=list,
        description=(
            "lm-evaluation-harness tasks run at each evaluation (every `training.eval_every` steps) and after the "
            "last step: task or group names, or paths to task YAML files. Results go to `metrics.jsonl` "
            "(`harness` rows), `run.json` (`harness`) and `acc-train report`. Empty: none."
        ),
    )
    harness_include_path: str | None = Field(
        None, description="A directory of task YAML files, searched for the names in `harness_tasks` (lm-eval's `--include_path`)."
    )
    harness_limit: Count | None = Field(None, description="Examples per task at most (all when unset).")
    harness_num_fewshot: NonNegativeCount | None = Field(None, description="Few-shot examples per prompt (each task's own default when unset).")
    harness_batch_size: Count = Field(8, description="Requests per forward pass.")
