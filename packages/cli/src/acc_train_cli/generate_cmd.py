"""``acc-train generate RUN_OR_CHECKPOINT --prompt TEXT``: a quick look at what a run trained
(:mod:`acc_train.evaluation.generate`). Only click is imported at module level."""

from __future__ import annotations

import click

from acc_train_cli.errors import user_errors

__all__ = ["generate"]


@click.command()
@click.argument("path", metavar="RUN_OR_CHECKPOINT")
@click.option("--prompt", "prompts", multiple=True, required=True, metavar="TEXT", help="The prompt (repeatable: each is completed in turn).")
@click.option("--chat", is_flag=True, help="Render each prompt as a user turn with the tokenizer's chat template.")
@click.option("--max-new-tokens", type=click.IntRange(1, 100_000), default=64, show_default=True, help="Tokens to generate at most.")
@click.option("--temperature", type=click.FloatRange(0, 100), default=0.0, show_default=True, help="0: greedy decoding; above: sampling.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True, help="Nucleus sampling's mass (with --temperature).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampling.")
@user_errors
def generate(path: str, prompts: tuple[str, ...], chat: bool, max_new_tokens: int, temperature: float, top_p: float, seed: int) -> None:
    """Complete each --prompt with the model of RUN_OR_CHECKPOINT, streaming the tokens: a run's
    output directory (its final/, else its latest checkpoint), a checkpoint written under any
    strategy and world size (LoRA adapters applied), or a save_pretrained directory."""
    import sys

    from acc_train.evaluation.generate import generate as complete
    from acc_train.evaluation.trained import load_trained_model

    model, tokenizer, source = load_trained_model(path)
    click.echo(f"model: {source}", err=True)

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    for prompt in prompts:
        click.echo(f"> {prompt}", err=True)
        done = complete(model, tokenizer, prompt, chat=chat, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, emit=emit)
        sys.stdout.write("\n")
        rate = f", {done['tokens_per_s']:.1f} tokens/s" if done["tokens_per_s"] else ""
        click.echo(f"({done['tokens']} tokens{rate})", err=True)
