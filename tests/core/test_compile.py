"""training.compile: its shape, an accelerate config file's dynamo_config read as it, the
Accelerate plugin built from the config alone, and a strategy that cannot compile refused before launch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from acc_train import UserError
from acc_train.config import load_job
from acc_train.config.compile import COMPILE_MODES, DYNAMO_BACKENDS, DYNAMO_ENV_VARS
from acc_train.config.resolve import check_config_file
from acc_train.loop.torch_compile import dynamo_plugin
from tests.cli.test_cli import assert_user_error
from tests.conftest import run_cli
from tests.core.test_plugin_contracts import Install, install  # noqa: F401 - the fixture

ACCELERATE_FILE = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
dynamo_config:
  dynamo_backend: INDUCTOR
  dynamo_mode: max-autotune
  dynamo_use_dynamic: false
  dynamo_use_fullgraph: true
  dynamo_use_regional_compilation: true
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""


def test_the_backends_are_accelerates() -> None:
    from accelerate.utils import DynamoBackend

    assert set(DYNAMO_BACKENDS) == {b.value.lower() for b in DynamoBackend} - {"no"}
    assert "max-autotune" in COMPILE_MODES


def test_compile_is_off_by_default_and_true_is_inductor() -> None:
    assert load_job().config.training.compile.enabled is False
    on = load_job(sets=["training.compile=true"]).config.training.compile
    assert (on.enabled, on.backend, on.mode, on.fullgraph, on.dynamic, on.regional) == (True, "inductor", "default", False, None, False)


def test_naming_a_backend_switches_compile_on_unless_enabled_says_otherwise() -> None:
    on = load_job(sets=["training.compile.backend=aot_eager"]).config.training.compile
    assert (on.enabled, on.backend) == (True, "aot_eager")
    off = load_job(sets=["training.compile={enabled: false, backend: eager}"]).config.training.compile
    assert (off.enabled, off.backend) == (False, "eager")


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ("training.compile.backend=torchscript", "training.compile.backend"),
        ("training.compile.mode=fast", "training.compile.mode"),
        ("training.compile.fullgrph=true", "fullgraph"),
        ("training.compile={enabled: true, fullgraph: true}", "needs regional: true"),
    ],
)
def test_a_wrong_compile_key_or_value_is_refused_by_name(item: str, fragment: str) -> None:
    with pytest.raises(UserError) as err:
        load_job(sets=[item])
    assert fragment in str(err.value)


def test_an_accelerate_config_files_dynamo_config_becomes_training_compile(tmp_path: Path) -> None:
    path = tmp_path / "default_config.yaml"
    path.write_text(ACCELERATE_FILE)
    c = load_job(path).config.training.compile
    assert (c.enabled, c.backend, c.mode, c.fullgraph, c.dynamic, c.regional) == (True, "inductor", "max-autotune", True, False, True)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ("dynamo_config:\n  dynamo_backend: 'NO'\n", (False, "inductor")),
        ("dynamo_config: {}\n", (False, "inductor")),
        ("dynamo_config:\n  backend: AOT_EAGER\n", (True, "aot_eager")),  # accelerate launch takes keys without the prefix
        ("dynamo_backend: EAGER\n", (True, "eager")),  # the old top-level key
    ],
)
def test_dynamo_config_variants(tmp_path: Path, section: str, expected: tuple[bool, str]) -> None:
    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n" + section)
    c = load_job(path).config.training.compile
    assert (c.enabled, c.backend) == expected


def test_an_unknown_dynamo_config_key_names_file_line_and_the_known_keys(tmp_path: Path) -> None:
    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: MULTI_CPU\ndynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_use_fulgraph: true\n")
    with pytest.raises(UserError) as err:
        load_job(path)
    text = str(err.value)
    assert "dynamo_config.dynamo_use_fulgraph" in text and "dynamo_use_fullgraph" in text and f"{path}:4" in text


def test_the_plugin_comes_from_the_config_alone(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from accelerate.utils import DynamoBackend

    for name, value in zip(DYNAMO_ENV_VARS, ("inductor", "max-autotune", "true", "true", "true"), strict=True):
        monkeypatch.setenv(name, value)
    off = dynamo_plugin(load_job().config.training.compile)
    assert (off.backend, off.mode, off.fullgraph, off.dynamic, off.use_regional_compilation) == (DynamoBackend.NO, "default", False, None, False)
    err = capsys.readouterr().err
    assert "ignoring ACCELERATE_DYNAMO_BACKEND=inductor (training.compile.backend)" in err and "enabled: false" in err
    on = dynamo_plugin(load_job(sets=["training.compile.backend=aot_eager"]).config.training.compile)
    assert (on.backend, on.dynamic, on.to_kwargs()["backend"]) == (DynamoBackend.AOT_EAGER, None, "aot_eager")


NO_COMPILE = """
class NoCompile(Strategy):
    name = "nocompile"
    def accelerator_kwargs(self, job):
        return {}
    def compile_problem(self, settings):
        return "its engine traces the model itself; use its own compile option"

@hookimpl
def acc_train_register_strategies(register):
    register(NoCompile())
"""


def test_a_strategy_that_cannot_compile_is_refused_before_launch(install: Install, tmp_path: Path) -> None:  # noqa: F811
    path = install("nocompile", NO_COMPILE)
    load_job(sets=["strategy=nocompile"])  # without compile it runs
    with pytest.raises(UserError) as err:
        load_job(sets=["strategy=nocompile", "training.compile=true"])
    assert 'training.compile cannot run under strategy "nocompile": its engine traces' in str(err.value)
    assert "--set training.compile=true" in str(err.value)  # where it was asked for
    config = tmp_path / "job.yaml"
    config.write_text("strategy: nocompile\ntraining:\n  compile: true\n")
    job, problems = check_config_file(config)
    assert job is None and any("training.compile cannot run" in p for p in problems)
    pythonpath = os.pathsep.join(p for p in (str(path), os.environ.get("PYTHONPATH", "")) if p)
    proc = run_cli("--strategy", "nocompile", "--set", "training.compile.backend=eager", "--print-config", env={"PYTHONPATH": pythonpath})
    assert_user_error(proc, "training.compile cannot run under strategy", "training.compile.enabled=false")


SCRIPT = """
import json, os
import torch
from accelerate.utils import has_compiled_regions, is_compiled_module
from acc_train import Accelerator

acc = Accelerator()
model = acc.prepare(torch.nn.Linear(4, 2))
model(torch.ones(3, 4)).sum().backward()
plugin = acc.state.dynamo_plugin
with open(os.environ["OUT"], "w") as f:
    json.dump({"backend": plugin.backend.value, "dynamic": plugin.dynamic, "fullgraph": plugin.fullgraph,
               "regional": plugin.use_regional_compilation, "compiled": is_compiled_module(model) or has_compiled_regions(model)}, f)
"""


@pytest.mark.launch
def test_a_launched_script_compiles_as_the_files_dynamo_config_says_not_the_shell(tmp_path: Path) -> None:
    import json

    script, out, config = tmp_path / "s.py", tmp_path / "out.json", tmp_path / "acc.yaml"
    script.write_text(SCRIPT)
    config.write_text(
        "distributed_type: MULTI_CPU\nnum_processes: 1\nmixed_precision: 'no'\n"
        "dynamo_config:\n  dynamo_backend: AOT_EAGER\n"
    )
    shell = {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true", "ACCELERATE_DYNAMO_USE_DYNAMIC": "true", "OUT": str(out)}
    proc = run_cli("--config", str(config), "launch", str(script), env=shell)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == {"backend": "AOT_EAGER", "dynamic": None, "fullgraph": False, "regional": False, "compiled": True}
    assert "ignoring ACCELERATE_DYNAMO_BACKEND=INDUCTOR (training.compile.backend), ACCELERATE_DYNAMO_USE_FULLGRAPH=true" in proc.stderr


def test_dynamo_env_is_what_accelerate_launch_exports() -> None:
    from acc_train.config.compile import dynamo_env

    assert dynamo_env(load_job().config.training.compile) == {
        "ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DYNAMO_MODE": "default",
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
    }  # fmt: skip
    on = load_job(sets=["training.compile={backend: inductor, dynamic: true, regional: true}"]).config.training.compile
    assert dynamo_env(on)["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR" and dynamo_env(on)["ACCELERATE_DYNAMO_USE_DYNAMIC"] == "True"
