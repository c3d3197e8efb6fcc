"""``acc-train config``: a wizard that saves the default config, the config's JSON Schema, and
a checker that lists every problem of a file.

The wizard validates each answer through the config's own pydantic schemas (core's sections
and the chosen strategy's options), so it cannot write a file ``acc-train`` would reject, and it
writes nothing until the last answer: an interrupted wizard leaves the previous file as it was.
Only click is imported at module level; nothing here loads torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click

from acc_train_cli.errors import user_errors

__all__ = ["config_group", "run_wizard", "save_config"]

EXIT_INTERRUPTED = 1

HEADER = "# acc-train config, written by `acc-train config`; `acc-train` reads it when no --config is given.\n"




# ----------------------------------------------------------------------------------------
# The wizard
# ----------------------------------------------------------------------------------------


def _several_machines(answers: Mapping[str, Any]) -> bool:
    machines = answers.get("launch.num_machines")
    return isinstance(machines, int) and machines > 1


def _core_questions(registry: Any) -> list[Any]:
    """Machine set-up, precision and strategy: keyed by full dotted config paths."""
    from acc_train.contracts.questions import Question
    from acc_train.strategy import DEFAULT_STRATEGY

    names = registry.names()
    default = DEFAULT_STRATEGY if DEFAULT_STRATEGY in names else registry.primary()[0][0].name
    listing = "; ".join(
        s.name + (f" ({', '.join([*s.aliases, *s.presets])})" if s.aliases or s.presets else "") for s, _ in registry.primary()
    )
    return [
        Question("launch.num_machines", "How many machines take part (1: only this one)", default=1),
        Question("launch.machine_rank", "This machine's rank (0 on the main machine)", default=0, when=_several_machines),
        Question("launch.main_process_ip", "Address of the main machine (rank 0)", default="127.0.0.1", when=_several_machines),
        Question("launch.main_process_port", "Rendezvous port on the main machine", default=29500, when=_several_machines),
        Question(
            "launch.num_processes",
            "Processes per machine (auto: one per GPU, or 1 without GPUs)",
            default=None,
            none_text="auto",
        ),
        Question(
            "training.mixed_precision",
            "Mixed precision",
            default="auto",
            choices=("auto", "no", "bf16", "fp16"),
            help="auto: bf16 where the device computes it natively, fp32 elsewhere",
        ),
        Question("strategy.name", "Strategy", default=default, choices=tuple(names), help=f"installed: {listing}"),
    ]


def _to_config(answers: Mapping[str, Any]) -> dict[str, Any]:
    from acc_train.config import set_dotted

    config: dict[str, Any] = {}
    for dotted, value in answers.items():
        set_dotted(config, dotted, value, "acc-train config")
    return config


def _ask(question: Any, default: Any, check: Callable[[Any], list[str]], assume_yes: bool) -> Any:
    """One answer: parsed, validated, asked again with the reason until it is valid."""
    from acc_train.errors import UserError
    from acc_train.contracts.questions import parse_answer, show_answer

    shown = show_answer(question, default)

    def convert(text: str) -> Any:
        try:
            value = parse_answer(question, text)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        problems = check(value)
        if problems:
            raise click.BadParameter("; ".join(problems))
        return value

    if assume_yes:
        try:
            return convert(shown)
        except click.BadParameter as exc:
            raise UserError(
                f"the default answer to {question.prompt!r} ({shown}) is invalid: {exc.message}",
                hint="answer it without --yes, or report it to the plugin that asks it",
            ) from None
    if question.help:
        click.echo(click.style(f"  {question.help}", dim=True))
    label = question.prompt
    if question.choices and len(question.choices) <= 6:
        label += f" ({'/'.join(show_answer(question, c) for c in question.choices)})"
    return click.prompt(label, default=shown, value_proc=convert)


def _ask_all(
    questions: list[Any], answers: dict[str, Any], prefix: str, defaults: Mapping[str, Any], assume_yes: bool
) -> None:
    """Ask ``questions`` (keyed under ``prefix``) in order, adding to ``answers``.

    Each answer is checked as part of the whole config: the answers so far, this one, and the
    defaults of the questions still to come, so a combination only later answers could fix
    never blocks the wizard, and defaults stay valid."""
    from acc_train.config import config_problems

    def in_section(given: Mapping[str, Any]) -> dict[str, Any]:
        return {k[len(prefix) :]: v for k, v in given.items() if k.startswith(prefix)}

    def default_of(question: Any) -> Any:
        return defaults.get(question.key, question.default)

    def checker(index: int) -> Callable[[Any], list[str]]:
        def check(value: Any) -> list[str]:
            trial = {**answers, prefix + questions[index].key: value}
            for later in questions[index + 1 :]:
                if later.applies(in_section(trial)):
                    trial.setdefault(prefix + later.key, default_of(later))
            return config_problems(_to_config(trial))

        return check

    for index, question in enumerate(questions):
        if question.applies(in_section(answers)):
            answers[prefix + question.key] = _ask(question, default_of(question), checker(index), assume_yes)


def run_wizard(assume_yes: bool = False) -> dict[str, Any]:
    """Ask every question; the answers as config sections (valid by construction)."""
    from acc_train.errors import PluginError, UserError
    from acc_train.plugins import get_plugin_manager, strategies
    from acc_train.contracts.questions import Question

    registry = strategies()
    if not registry.primary():
        raise UserError("no strategy is installed, so there is nothing to configure", hint="pip install acc-train-strategy-ddp")
    answers: dict[str, Any] = {}
    _ask_all(_core_questions(registry), answers, "", {}, assume_yes)
    chosen = answers["strategy.name"]
    strategy = registry.get(chosen)
    questions = get_plugin_manager().hook.acc_train_config_questions(strategy_name=strategy.name) or []
    if not (isinstance(questions, list) and all(isinstance(q, Question) for q in questions)):
        raise PluginError(
            f"acc_train_config_questions for {strategy.name!r} returned {questions!r:.200}, not a list of acc_train.Question",
            hint=f'report it to the authors of plugin "{registry.owner(chosen)}"',
        )
    _ask_all(questions, answers, "strategy.", strategy.presets.get(chosen, {}), assume_yes)
    return _to_config(answers)


def save_config(config: dict[str, Any], target: Path) -> None:
    """Write ``config`` to ``target`` atomically: a temp file beside it, checked, then renamed."""
    import yaml

    from acc_train.config import check_config_file
    from acc_train.errors import UserError

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise UserError(f"cannot write {target}: {exc.strerror or exc}", hint="choose another place with --config-file") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(HEADER + yaml.safe_dump(config, sort_keys=False))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, target.stat().st_mode & 0o777 if target.exists() else 0o644)  # mkstemp's is 0600
        _, problems = check_config_file(tmp)
        if problems:  # the answers were validated one by one; this would be a bug
            raise UserError("the answers do not make a valid config:\n  " + "\n  ".join(problems))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------


@click.group("config", invoke_without_command=True)
@click.option("--yes", "-y", "assume_yes", is_flag=True, help="Take every default without asking (for scripts).")
@click.option(
    "--config-file",
    type=click.Path(dir_okay=False),
    help="Where to save (default: $ACC_TRAIN_CONFIG_FILE, else $XDG_CONFIG_HOME/acc-train/default_config.yaml).",
)
@click.pass_context
def config_group(ctx: click.Context, assume_yes: bool, config_file: str | None) -> None:
    """Ask about this machine and strategy, and save the answers as the default config.

    `acc-train` (and `launch` and `plan`) reads the saved file when no --config is given:
    defaults < this file < --config FILE (instead of it) < flags < --set.

    \b
      acc-train config                          the questions, then saved
      acc-train config --yes                    every default, no questions
      acc-train config schema > acc-train.json  JSON Schema for editors
      acc-train config validate job.yaml        every problem of a file
    """
    if ctx.invoked_subcommand is not None:
        return
    _wizard(assume_yes, config_file)


@user_errors
def _wizard(assume_yes: bool, config_file: str | None) -> None:
    from acc_train.config import default_config_file, existing_default_config_file

    target = Path(config_file).expanduser() if config_file else existing_default_config_file() or default_config_file()
    try:
        config = run_wizard(assume_yes)
    except click.Abort:  # Ctrl-C or end of input: click's prompt raises Abort for both
        state = "is unchanged" if target.exists() else "was not created"
        click.echo(f"\nacc-train config: interrupted; nothing was written ({target} {state})", err=True)
        sys.exit(EXIT_INTERRUPTED)
    save_config(config, target)
    click.echo(f"saved {target}")
    click.echo("acc-train uses it when no --config is given; `acc-train --print-config` shows the resolved job")


@config_group.command("schema")
@user_errors
def config_schema() -> None:
    """Print a JSON Schema of the whole config, with every installed strategy's options."""
    from acc_train.config.json_schema import job_json_schema

    click.echo(json.dumps(job_json_schema(), indent=2))


@config_group.command("validate")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@user_errors
def config_validate(file: str | None) -> None:
    """Check FILE (default: the default config file) and list every problem; exit 2 if any."""
    from acc_train.config import check_config_file, default_config_file, existing_default_config_file
    from acc_train.errors import UserError

    path = Path(file) if file else existing_default_config_file()
    if path is None:
        raise UserError(f"no FILE given and no default config file at {default_config_file()}", hint="run `acc-train config` to write one")
    job, problems = check_config_file(path)
    if problems:
        count = f"{len(problems)} problem" + ("s" if len(problems) > 1 else "")
        raise UserError(f"invalid config {path}: {count}\n  " + "\n  ".join(problems))
    assert job is not None
    click.echo(f"{path}: OK (strategy {job.config.strategy['name']})")
