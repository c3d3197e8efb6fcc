"""``acc-train report OUTPUT_DIR``: a run's summary table and its ``report.png``.

The drawing lives in core (:mod:`acc_train.outputs.report`), which training also calls when it ends.
Only click is imported at module level.
"""

from __future__ import annotations

import click

from acc_train_cli.errors import user_errors

__all__ = ["report"]


@click.command()
@click.argument("output_dir", metavar="OUTPUT_DIR")
@click.option("--no-png", is_flag=True, help="Print the summary only; do not draw report.png.")
@click.option("--prompt", "prompt", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Which of eval.samples' prompts to show across steps (numbered from 0).")  # fmt: skip
@user_errors
def report(output_dir: str, no_png: bool, prompt: int) -> None:
    """Summarise a run (strategy, world size, steps, tokens/s, losses, checkpoints) and draw
    OUTPUT_DIR/report.png: loss and eval loss, learning rate and tokens/s against step. A run
    with generation samples (eval.samples) also shows the last evaluation's completions and one
    prompt's completions at each evaluation."""
    from acc_train.outputs.plot import draw_report
    from acc_train.outputs.report import format_samples, format_summary, read_run

    record = read_run(output_dir)
    click.echo(format_summary(record))
    if not no_png:
        click.echo(f"{'report'.ljust(len('training time'))}  {draw_report(record)}")
    if record.samples:
        click.echo("\n" + format_samples(record, prompt))
