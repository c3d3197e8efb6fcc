"""``acc-train eval RUN_OR_CHECKPOINT --tasks NAME[,NAME...]``: benchmark tasks through
lm-evaluation-harness on what a run trained (:mod:`acc_train.evaluation.harness`). Only click is imported
at module level."""

from __future__ import annotations

import click

from acc_train_cli.errors import user_errors

__all__ = ["eval_command"]


@click.command("eval")
@click.argument("path", metavar="RUN_OR_CHECKPOINT")
@click.option("--tasks", required=True, metavar="NAME[,NAME...]", help="lm-evaluation-harness tasks, groups or tags, or paths of task YAML files, comma-separated.")
@click.option("--include-path", type=click.Path(file_okay=False), metavar="DIR", help="A directory of task YAML files, searched for the --tasks names.")
@click.option("--limit", type=click.IntRange(1), metavar="N", help="Examples per task at most (all by default).")
@click.option("--batch-size", type=click.IntRange(1), default=8, show_default=True, metavar="N", help="Requests per forward pass.")
@click.option("--num-fewshot", type=click.IntRange(0), metavar="N", help="Few-shot examples per prompt (each task's own default otherwise).")
@click.option("--output", type=click.Path(dir_okay=False, writable=True), metavar="FILE", help='Also write the scores as JSON: {"model": what was read, "scores": {task: {metric: value}}}.')
@user_errors
def eval_command(path: str, tasks: str, include_path: str | None, limit: int | None, batch_size: int, num_fewshot: int | None, output: str | None) -> None:
    """Score the model of RUN_OR_CHECKPOINT on lm-evaluation-harness tasks, one line per task
    and metric (TASK METRIC VALUE): a run's output directory (its final/, else its latest
    checkpoint), a checkpoint written under any strategy and world size (LoRA adapters
    applied), or a save_pretrained directory; the demo model's text is bytes, as for generate.
    Needs pip install 'acc-train-core[eval]'."""
    import json
    from pathlib import Path

    from acc_train.evaluation.harness import evaluate_tasks, harness_tasks, require_lm_eval, score_lines
    from acc_train.evaluation.trained import load_trained_model

    require_lm_eval("acc-train eval")
    names = [name.strip() for name in tasks.split(",") if name.strip()]
    resolved = harness_tasks(names, include_path, "--tasks", include_path_where="--include-path")  # before the model loads
    model, tokenizer, source = load_trained_model(path)
    click.echo(f"model: {source}", err=True)
    import torch

    model = model.to("cuda" if torch.cuda.is_available() else "cpu")  # as acc-train generate: the GPU when there is one
    scores = evaluate_tasks(model, tokenizer, resolved, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size)
    for line in score_lines(scores):
        click.echo(line)
    if output:
        Path(output).write_text(json.dumps({"model": source, "scores": scores}, indent=2) + "\n")
