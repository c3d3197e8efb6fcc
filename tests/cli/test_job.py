"""One resolution for every command that runs a job: training, `launch` and `plan` read the same
sources (defaults < the default config file or --config < flags < --set), through
``acc_train_cli.job``; job options given before a subcommand reach it."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from acc_train_cli.job import FLAG_KEYS, merge_parent_params
from tests.conftest import run_cli


@pytest.mark.parametrize("command", ["train", "launch", "plan"])
def test_every_command_reads_the_default_config_file(tmp_path: Path, command: str) -> None:
    default = tmp_path / "default_config.yaml"
    default.write_text("training:\n  seed: 1\n  max_step: 30\n")  # a typo: each command must report it
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('never runs')\n")
    args = {"train": ["--print-config"], "launch": ["launch", str(script)], "plan": ["plan"]}[command]
    proc = run_cli(*args, env={"ACC_TRAIN_CONFIG_FILE": str(default)})
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert f"{default}:3" in proc.stderr and 'did you mean "training.max_steps"' in proc.stderr
    assert "Traceback" not in proc.stderr and "never runs" not in proc.stderr


def test_options_before_a_subcommand_fill_in_those_not_given_after_it() -> None:
    ctx = click.Context(click.Command("acc-train"), obj={"strategy": "zero3", "micro_batch_size": 2, "sets": ("a.b=1",), "seed": None})
    merged = merge_parent_params(ctx, {"micro_batch_size": 4, "sets": (), "seed": None, "model": None})
    assert merged == {"strategy": "zero3", "micro_batch_size": 4, "sets": ("a.b=1",), "seed": None, "model": None}


def test_every_flag_key_is_a_job_option_of_the_root_command() -> None:
    from acc_train_cli.main import cli

    params = {p.name for p in cli.params}
    assert set(FLAG_KEYS) <= params and {"config_file", "sets"} <= params
