"""The command as a user meets it: fast help, listings, and bad input handled without tracebacks.

Commands run in this process (:func:`tests.conftest.cli_in_process`); what only a fresh
interpreter shows (which modules ``--help``, the listings and an early refusal import, and that
the in-process runner answers as the real command does) runs in one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_in_process, run_cli


def assert_user_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr)


@pytest.mark.parametrize("args", [["--help"], ["plan", "--help"], ["eval", "--help"], ["strategies"], ["plugins"], ["--print-config"]])
def test_listing_and_help_import_neither_torch_nor_accelerate(args: list[str]) -> None:
    code = (
        "import sys\n"
        "from acc_train_cli.main import cli\n"
        f"try:\n    cli.main({args!r}, prog_name='acc-train', standalone_mode=False)\n"
        "except SystemExit:\n    pass\n"
        "heavy = sorted(m for m in ('torch', 'accelerate', 'transformers', 'deepspeed', 'lm_eval') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


def test_help_imports_nothing_of_core() -> None:
    """--help stays fast: importing core (pydantic, pluggy) costs more than click and the CLI."""
    code = (
        "import sys\n"
        "from acc_train_cli.main import cli\n"
        "try:\n    cli.main(['--help'], prog_name='acc-train', standalone_mode=False)\nexcept SystemExit:\n    pass\n"
        "print('CORE', sorted(m for m in sys.modules if m == 'acc_train' or m.startswith('acc_train.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "CORE []" in proc.stdout, proc.stdout


def test_a_missing_data_file_is_refused_before_torch_loads() -> None:
    """The cheapest refusal stays cheap: checking the data files needs neither torch nor
    transformers (a second, where importing them took ten)."""
    code = (
        "import sys\n"
        "from acc_train_cli.main import cli\n"
        "try:\n    cli.main(['--set', 'data.train_files=[/nope/train.jsonl]'], prog_name='acc-train', standalone_mode=False)\n"
        "except SystemExit as exc:\n    print('EXIT', exc.code)\n"
        "print('HEAVY', sorted(m for m in ('torch', 'accelerate', 'transformers', 'deepspeed', 'datasets') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "EXIT 2" in proc.stdout and "HEAVY []" in proc.stdout, proc.stdout + proc.stderr
    assert "data file '/nope/train.jsonl' does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["strategies"],  # a listing
        ["--set", "training.seed"],  # a UserError
        ["--num-processes", "two", "--print-config"],  # click's own usage error
        ["--set", "training.seed=3", "--print-config"],  # an answer on stdout
        ["--set", "data.train_files=[/nope/train.jsonl]"],  # a refusal past resolving the job
    ],
    ids=["listing", "user-error", "usage-error", "print-config", "refusal"],
)
def test_the_in_process_runner_answers_as_the_command_does(args: list[str]) -> None:
    """What the tests run in process (exit code, stdout, stderr) is what a user's shell gets."""
    fresh, here = run_cli(*args), cli_in_process(*args)
    assert (here.returncode, here.stdout, here.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_the_in_process_runner_shows_an_escaped_exception_as_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug the command lets through is exit 1 with a traceback, as the interpreter prints it, so
    the tests' ``"Traceback" not in stderr`` sees it in process too."""
    import acc_train_cli.info

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(acc_train_cli.info.strategies, "callback", broken)
    proc = cli_in_process("strategies")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "RuntimeError: a bug" in proc.stderr


def test_help_lists_the_commands() -> None:
    proc = cli_in_process("--help")
    assert proc.returncode == 0
    for word in ("launch", "strategies", "plugins", "env", "--strategy", "--num-processes", "--resume", "--set"):
        assert word in proc.stdout


def test_strategies_lists_ddp_with_its_package() -> None:
    proc = cli_in_process("strategies")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ddp "))
    assert "acc-train-strategy-ddp" in line and "0.1.0" in line


def test_plugins_prints_json_with_hooks_and_registrations() -> None:
    proc = cli_in_process("plugins")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["ddp"]["hooks"] == ["acc_train_config_questions", "acc_train_register_strategies"]
    assert by_name["ddp"]["registered"] == {"strategies": ["ddp"]}
    assert by_name["builtin"]["registered"] == {
        "checkpoint_formats": ["dcp"], "data_kinds": ["chat", "prompt_completion", "text"], "optimizers": ["adafactor", "adamw", "adamw_8bit", "sgd"],
        "trackers": ["aim", "clearml", "comet_ml", "dvclive", "mlflow", "swanlab", "tensorboard", "trackio", "wandb"],
        "evaluators": ["eval_loss", "harness_tasks", "samples"],
    }  # fmt: skip


def test_env_reports_versions() -> None:
    proc = cli_in_process("env")
    assert proc.returncode == 0, proc.stderr
    for key in ("python", "torch", "accelerate", "acc-train-core", "acc-train-strategy-ddp", "cuda available"):
        assert key in proc.stdout


def test_print_config_resolves_defaults_file_flags_and_set(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("training:\n  max_steps: 30\n  seed: 1\nstrategy:\n  name: ddp\n  bucket_cap_mb: 50\n")
    proc = cli_in_process("--config", str(cfg), "--seed", "5", "--set", "training.seed=9", "--set", "optimizer.lr=0.002", "--print-config")
    assert proc.returncode == 0, proc.stderr
    import yaml

    resolved = yaml.safe_load(proc.stdout)
    assert resolved["training"]["max_steps"] == 30  # file over default
    assert resolved["training"]["seed"] == 9  # --set over flag over file
    assert resolved["optimizer"]["lr"] == 0.002
    assert resolved["strategy"]["bucket_cap_mb"] == 50
    assert resolved["strategy"]["find_unused_parameters"] is False  # strategy defaults filled in


def test_unknown_key_in_file_names_file_line_and_closest_key(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("training:\n  seed: 1\n  max_step: 30\n")
    proc = cli_in_process("--config", str(cfg), "--print-config")
    assert_user_error(proc, "training.max_step", f"{cfg}:3", 'did you mean "training.max_steps"')


def test_unknown_strategy_option_suggests_the_right_one() -> None:
    proc = cli_in_process("--set", "strategy.bucket_cap=10", "--print-config")
    assert_user_error(proc, "strategy.bucket_cap", 'did you mean "strategy.bucket_cap_mb"', "--set strategy.bucket_cap=10")


def test_wrong_types_and_ranges_are_reported_together() -> None:
    proc = cli_in_process("--set", "training.micro_batch_size=0", "--set", "optimizer.lr=fast", "--print-config")
    assert_user_error(proc, "training.micro_batch_size", "greater than or equal to 1", "optimizer.lr", "'fast'")


def test_conflicting_options() -> None:
    proc = cli_in_process("--max-steps", "10", "--epochs", "2", "--print-config")
    assert_user_error(proc, "max_steps or training.epochs, not both")


def test_missing_config_file() -> None:
    proc = cli_in_process("--config", "/nonexistent/job.yaml")
    assert_user_error(proc, "--config", "does not exist")


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("training:\n  seed: 1\n  max_steps: [1, 2\n")
    proc = cli_in_process("--config", str(cfg))
    assert_user_error(proc, "not valid YAML", f"{cfg}:")


def test_malformed_set() -> None:
    assert_user_error(cli_in_process("--set", "training.seed"), "--set expects key.path=value")


def test_strategy_not_installed_names_the_package() -> None:
    # as if only core and DDP were installed: the message must name what to install
    proc = cli_in_process("--strategy", "fsdp", env={"ACC_TRAIN_BLOCK_PLUGINS": "fsdp,deepspeed,local-sgd,ft"})
    assert_user_error(proc, 'strategy "fsdp" is not installed', "pip install acc-train-strategy-fsdp", "installed strategies: ddp)")


def test_unknown_strategy_lists_installed_ones() -> None:
    proc = cli_in_process("--strategy", "dpp")
    assert_user_error(proc, 'unknown strategy "dpp"', 'did you mean "ddp"')


def test_number_of_processes_below_one() -> None:
    assert_user_error(cli_in_process("--num-processes", "0", "--print-config"), "launch.num_processes", "--num-processes")


def test_existing_run_is_not_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    proc = cli_in_process("--output-dir", str(out), "--max-steps", "1")
    assert_user_error(proc, "already holds a run", "--resume latest", "--overwrite")
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def test_resume_latest_without_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli_in_process("--output-dir", str(out), "--resume", "latest")
    assert_user_error(proc, "no complete checkpoint")


def test_model_path_without_config(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    proc = cli_in_process("--set", f"model.name_or_path={tmp_path / 'model'}", "--output-dir", str(tmp_path / "out"))
    assert_user_error(proc, "has no config.json", "model.name_or_path")
    assert not (tmp_path / "out").exists()


def test_missing_data_file(tmp_path: Path) -> None:
    proc = cli_in_process("--set", "data.train_files=[/nope/train.jsonl]", "--output-dir", str(tmp_path / "out"))
    assert_user_error(proc, "data.train_files", "does not exist")


def test_broken_plugin_is_named_and_the_others_keep_working(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "broken_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[acc_train]\nbroken = broken_plugin_module\n")
    (tmp_path / "broken_plugin_module.py").write_text("raise ImportError('this plugin is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # where a fresh interpreter finds it through PYTHONPATH
    proc = cli_in_process("strategies")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].startswith("ddp ")
    assert 'plugin "broken" (distribution broken-plugin) was skipped' in proc.stderr
    assert "this plugin is broken" in proc.stderr


def test_unknown_tracker() -> None:
    assert_user_error(cli_in_process("--report-to", "tensorbord", "--print-config"), "training.report_to", "unknown tracker 'tensorbord'")


def test_model_directory_without_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    import shutil

    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(tiny_model_dir / "config.json", model / "config.json")
    proc = cli_in_process("--set", f"model.name_or_path={model}", "--output-dir", str(tmp_path / "out"))
    assert_user_error(proc, "holds no tokenizer", "model.tokenizer")


def test_yaml_floats_as_people_write_them(tmp_path: Path) -> None:
    import yaml

    cfg = tmp_path / "job.yaml"
    cfg.write_text("optimizer:\n  lr: 1e-4\n  eps: 1e-8\n")
    proc = cli_in_process("--config", str(cfg), "--set", "optimizer.weight_decay=5e-2", "--print-config")
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)["optimizer"]
    assert (resolved["lr"], resolved["eps"], resolved["weight_decay"]) == (1e-4, 1e-8, 0.05)


def test_accelerate_config_file_for_ddp_is_accepted(tmp_path: Path) -> None:
    import yaml

    cfg = tmp_path / "default_config.yaml"
    cfg.write_text(
        "compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: MULTI_CPU\ndowncast_bf16: 'no'\n"
        "enable_cpu_affinity: false\nmachine_rank: 0\nmain_training_function: main\nmixed_precision: 'no'\n"
        "num_machines: 1\nnum_processes: 2\nrdzv_backend: static\nsame_network: true\ntpu_env: []\n"
        "tpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: true\n"
    )
    proc = cli_in_process("--config", str(cfg), "--print-config")
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["launch"]["num_processes"] == 2
    assert resolved["training"]["mixed_precision"] == "no"
    assert resolved["strategy"]["name"] == "ddp"


def test_accelerate_config_for_a_strategy_not_installed(tmp_path: Path) -> None:
    cfg = tmp_path / "fsdp.yaml"
    cfg.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n")
    proc = cli_in_process("--config", str(cfg), "--print-config", env={"ACC_TRAIN_BLOCK_PLUGINS": "fsdp"})
    assert_user_error(proc, 'strategy "fsdp" is not installed', "acc-train-strategy-fsdp")


def test_launch_refuses_options_of_the_training_loop(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("print('never runs')\n")
    proc = cli_in_process("launch", "--max-steps", "5", str(script))
    assert_user_error(proc, "--max-steps applies to acc-train's own training loop")


def test_several_machines_need_the_main_address() -> None:
    proc = cli_in_process("--num-machines", "2", "--print-config")
    assert_user_error(proc, "--main-process-ip")
