"""`acc-train config` as a user meets it: the wizard in a real terminal and with piped answers,
the default config file it saves and `acc-train` then reads, the JSON Schema, and `validate`.

The wizard in a terminal (pexpect) and the import weight of ``config --help`` and ``config schema``
run in a fresh interpreter; every other command in this process
(:func:`tests.conftest.cli_in_process`: piped answers are its ``input``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pexpect
import pytest
import yaml

from tests.conftest import cli_in_process


@pytest.fixture
def default_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the wizard saves and `acc-train` reads, for this test (the runners pass the env on)."""
    path = tmp_path / "cfg" / "default_config.yaml"
    monkeypatch.setenv("ACC_TRAIN_CONFIG_FILE", str(path))
    return path


def piped(answers: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``acc-train config ARGS`` with ``answers`` piped to its stdin (click's test runner echoes
    each answer read to stdout, as a terminal would)."""
    return cli_in_process("config", *args, input=answers, timeout=120)


def resolved(*args: str) -> tuple[dict, str]:
    proc = cli_in_process(*args, "--print-config")
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout), proc.stderr


def spawn(*args: str) -> pexpect.spawn:
    return pexpect.spawn(
        sys.executable, ["-m", "acc_train_cli", "config", *args], env=dict(os.environ), encoding="utf-8", timeout=60
    )


def test_help_and_schema_import_neither_torch_nor_accelerate(default_file: Path) -> None:
    for args in (["config", "--help"], ["config", "schema"], ["config", "--yes"]):
        code = (
            "import sys\nfrom acc_train_cli.main import cli\n"
            f"try:\n    cli.main({args!r}, prog_name='acc-train', standalone_mode=False)\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'accelerate', 'transformers', 'deepspeed') if m in sys.modules))\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert "HEAVY []" in proc.stdout, args
    assert "config" in cli_in_process("--help").stdout


def test_yes_saves_every_default_and_acc_train_then_uses_the_file(default_file: Path) -> None:
    proc = cli_in_process("config", "--yes")
    assert proc.returncode == 0, proc.stderr
    assert str(default_file) in proc.stdout
    saved = yaml.safe_load(default_file.read_text())
    assert saved == {
        "launch": {"num_machines": 1, "num_processes": None},
        "training": {"mixed_precision": "auto"},
        "strategy": {"name": "ddp", "bucket_cap_mb": 25, "comm_hook": "none", "find_unused_parameters": False},
    }
    config, stderr = resolved()
    assert config["strategy"]["name"] == "ddp"
    assert f"using the default config file {default_file}" in stderr


def test_default_location_follows_xdg_config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACC_TRAIN_CONFIG_FILE")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert cli_in_process("config", "--yes").returncode == 0
    assert (tmp_path / "acc-train" / "default_config.yaml").is_file()
    assert "using the default config file" in resolved()[1]


def test_config_file_option_saves_elsewhere(default_file: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    assert cli_in_process("config", "--yes", "--config-file", str(other)).returncode == 0
    assert other.is_file() and not default_file.exists()


def test_wizard_in_a_terminal_asks_again_with_the_reason_and_saves(default_file: Path) -> None:
    child = spawn()
    child.expect_exact("How many machines take part")
    child.sendline("")
    child.expect_exact("Processes per machine")
    child.sendline("two")
    child.expect_exact("launch.num_processes: Input should be a valid integer (got 'two')")  # asked again
    child.expect_exact("Processes per machine")
    child.sendline("2")
    child.expect_exact("Mixed precision (auto/no/bf16/fp16)")
    child.sendline("fp8")
    child.expect_exact("'fp8' is not one of: auto, no, bf16, fp16")
    child.sendline("no")
    child.expect_exact("Strategy")
    child.sendline("fsdp")
    child.expect_exact("FSDP version (2/1)")
    child.sendline("1")
    child.expect_exact("Sharding strategy")  # FSDP1 only: asked because of the answer above
    child.sendline("shard_grad_op")
    child.expect_exact("Wrap policy")
    child.sendline("none")
    child.expect_exact("Recompute activations in backward?")
    child.sendline("true")  # needs a wrap policy: the options schema refuses it
    child.expect_exact("activation_checkpointing needs a wrap policy")
    child.sendline("false")
    child.expect_exact("Checkpoint state (sharded/full)")
    child.sendline("full")
    child.expect_exact("Offload parameters to CPU memory")
    child.sendline("")
    child.expect_exact("saved")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    config, _ = resolved()
    assert config["launch"]["num_processes"] == 2
    assert config["training"]["mixed_precision"] == "no"
    strategy = config["strategy"]
    assert (strategy["name"], strategy["version"], strategy["sharding_strategy"]) == ("fsdp", 1, "shard_grad_op")
    assert (strategy["auto_wrap_policy"], strategy["state_dict_type"], strategy["cpu_offload"]) == ("none", "full", False)
    assert strategy["reshard_after_forward"] is None  # an FSDP2 option: not asked under FSDP1


def test_ctrl_c_leaves_the_previous_file_untouched(default_file: Path) -> None:
    assert cli_in_process("config", "--yes").returncode == 0
    before = default_file.read_text()
    child = spawn()
    child.expect_exact("How many machines take part")
    child.sendline("")
    child.expect_exact("Processes per machine")
    child.sendline("4")
    child.expect_exact("Mixed precision")
    child.sendintr()
    child.expect_exact("interrupted; nothing was written")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus not in (0, None)
    assert default_file.read_text() == before
    assert sorted(p.name for p in default_file.parent.iterdir()) == [default_file.name]  # no temp file left


def test_end_of_input_writes_nothing(default_file: Path) -> None:
    proc = piped("1\n4\n")
    assert proc.returncode != 0
    assert "interrupted; nothing was written" in proc.stderr and "Traceback" not in proc.stderr
    assert not default_file.parent.exists() or not any(default_file.parent.iterdir())


def test_piped_answers_for_several_machines_and_a_preset(default_file: Path) -> None:
    # 2 machines, rank 2 (refused: below 2), rank 1, address, port, 8 processes, bf16, zero3-offload,
    # then its questions with the preset's answers as defaults
    proc = piped("2\n2\n1\n10.0.0.1\n29501\n8\nbf16\nzero3-offload\n\n\n\n\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Error: launch: launch.machine_rank (2) must be below launch.num_machines (2)" in proc.stdout  # asked again
    config, _ = resolved()
    launch = config["launch"]
    assert (launch["num_machines"], launch["machine_rank"], launch["main_process_ip"], launch["main_process_port"]) == (2, 1, "10.0.0.1", 29501)
    assert launch["num_processes"] == 8 and config["training"]["mixed_precision"] == "bf16"
    strategy = config["strategy"]
    assert (strategy["name"], strategy["stage"], strategy["offload_optimizer"], strategy["offload_param"]) == ("zero3-offload", 3, "cpu", "cpu")


@pytest.mark.parametrize("name", ["fsdp", "fsdp1", "fsdp-offload", "deepspeed", "zero1", "zero2-offload", "data-parallel"])
def test_every_strategy_s_default_answers_make_a_valid_config(default_file: Path, name: str) -> None:
    proc = piped(f"\n\n\n{name}\n" + "\n" * 12)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Error" not in proc.stdout + proc.stderr
    config, _ = resolved()
    assert config["strategy"]["name"] == name


def test_precedence_defaults_file_then_config_then_flags_then_set(default_file: Path, tmp_path: Path) -> None:
    assert piped("\n2\nbf16\n\n\n\n\n").returncode == 0  # 2 processes, bf16, ddp
    config, _ = resolved("--num-processes", "3", "--set", "strategy.bucket_cap_mb=50")
    assert (config["launch"]["num_processes"], config["training"]["mixed_precision"]) == (3, "bf16")
    assert config["strategy"]["bucket_cap_mb"] == 50
    job = tmp_path / "job.yaml"
    job.write_text("training:\n  seed: 7\n")
    config, stderr = resolved("--config", str(job))  # --config replaces the default file
    assert (config["training"]["seed"], config["training"]["mixed_precision"], config["launch"]["num_processes"]) == (7, "auto", None)
    assert "default config file" not in stderr


def test_schema_accepts_good_configs_and_rejects_bad_ones(default_file: Path) -> None:
    proc = cli_in_process("config", "schema")
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert cli_in_process("config", "--yes").returncode == 0
    good = [
        yaml.safe_load(default_file.read_text()),
        {"training": {"max_steps": 10}, "strategy": {"name": "zero3-offload", "stage": 3}},
        {"strategy": {"name": "fsdp", "version": 1, "mixed_precision_policy": {"param_dtype": "bf16"}}},
        {"strategy": "fsdp2"},
        {"strategy": {"bucket_cap_mb": 10}},  # no name: ddp
    ]
    for config in good:
        assert not list(validator.iter_errors(config)), config
    bad = [
        {"training": {"max_step": 10}},  # misspelt key
        {"training": {"mixed_precision": "fp8"}},
        {"strategy": {"name": "fsdp", "bucket_cap_mb": 10}},  # a ddp option under fsdp
        {"strategy": {"name": "fsdp", "mixed_precision_policy": {"param_dtype": "int8"}}},
        {"strategy": {"name": "not-installed"}},
        {"launch": {"main_process_port": 70000}},
    ]
    for config in bad:
        assert list(validator.iter_errors(config)), config


def test_validate_lists_every_problem_with_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("training:\n  max_step: 10\n  seed: x\nlaunch:\n  num_processes: 0\nstrategy:\n  name: fsdp\n  version: 3\n")
    proc = cli_in_process("config", "validate", str(bad))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "4 problems" in proc.stderr
    for line in (
        f'training.max_step ({bad}:2): unknown key; did you mean "training.max_steps"?',
        f"training.seed ({bad}:3):",
        f"launch.num_processes ({bad}:5):",
        f"strategy.version ({bad}:8):",
    ):
        assert line in proc.stderr, (line, proc.stderr)
    good = tmp_path / "good.yaml"
    good.write_text("training:\n  max_steps: 10\nstrategy: zero2\n")
    proc = cli_in_process("config", "validate", str(good))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{good}: OK (strategy zero2)"


def test_validate_without_a_file_checks_the_default_one(default_file: Path) -> None:
    proc = cli_in_process("config", "validate")
    assert proc.returncode == 2 and "run `acc-train config`" in proc.stderr
    assert cli_in_process("config", "--yes").returncode == 0
    assert cli_in_process("config", "validate").returncode == 0
