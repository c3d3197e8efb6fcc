"""A plugin that breaks a hook's contract is reported by name with the reason, and the rest of
acc-train keeps working. The plugins here are real distributions (a dist-info with an
``acc_train`` entry point on ``sys.path``), found the way installed ones are."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from acc_train import UserError, plugins
from tests.conftest import run_cli

Install = Callable[[str, str], Path]


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Install]:
    """``install(name, source)``: a distribution ``NAME-plugin`` whose entry point ``NAME`` is a
    module with ``source``. Returns the folder to put on ``PYTHONPATH`` for a subprocess."""
    monkeypatch.syspath_prepend(str(tmp_path))
    modules: list[str] = []

    def make(name: str, source: str) -> Path:
        module = f"contract_plugin_{name.replace('-', '_')}"
        dist = tmp_path / f"{name}_plugin-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-plugin\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text(f"[acc_train]\n{name} = {module}\n")
        (tmp_path / f"{module}.py").write_text("from acc_train import *\nfrom acc_train import hookimpl\n" + textwrap.dedent(source))
        modules.append(module)
        return tmp_path

    plugins.reset()
    yield make
    plugins.reset()
    for module in modules:
        sys.modules.pop(module, None)


def failure(name: str) -> str:
    found = [str(f) for f in plugins.plugin_failures() if f.name == name]
    assert found, f"plugin {name} was not reported; failures: {[str(f) for f in plugins.plugin_failures()]}"
    return found[0]


ECHO = """
class Echo(Strategy):
    name = "echo"
    def accelerator_kwargs(self, job):
        return {}
"""


def test_an_implementation_with_an_argument_the_hook_lacks_is_skipped_by_name(install: Install) -> None:
    install("wrongsig", ECHO + "@hookimpl\ndef acc_train_register_strategies(register, extra):\n    register(Echo())\n")
    assert "echo" not in plugins.strategies().names() and "ddp" in plugins.strategies().names()
    text = failure("wrongsig")
    assert 'plugin "wrongsig" (distribution wrongsig-plugin) was skipped' in text
    assert "does not match its spec" in text and "acc_train_register_strategies" in text and "extra" in text
    assert "wrongsig" not in [i.name for i in plugins.plugin_infos()]


def test_an_unknown_hook_is_named_with_the_closest_real_one(install: Install) -> None:
    install("typo", ECHO + "@hookimpl\ndef acc_train_regster_strategies(register):\n    register(Echo())\n")
    text = failure("typo")
    assert 'unknown hook "acc_train_regster_strategies"; did you mean "acc_train_register_strategies"?' in text
    assert "ddp" in plugins.strategies().names()


def test_a_hook_function_without_hookimpl_is_reported_instead_of_silently_ignored(install: Install) -> None:
    install("undecorated", ECHO + "def acc_train_register_strategies(register):\n    register(Echo())\n")
    assert "acc_train_register_strategies is defined without @acc_train.hookimpl" in failure("undecorated")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("register(Echo)", "registered the class Echo instead of an instance; call register(Echo())"),
        ("register(object())", "which is not a acc_train.strategy.Strategy"),
        ("register(Echo()); register(Echo())", 'registered the strategy name "echo" twice'),
        ("return [Echo()]", "acc_train_register_strategies returned list; its return value is ignored"),
        ("raise RuntimeError('boom')", "acc_train_register_strategies raised RuntimeError('boom')"),
    ],
    ids=["class", "wrong-type", "twice", "returns", "raises"],
)
def test_a_registration_that_breaks_the_contract_is_dropped_and_reported(install: Install, body: str, reason: str) -> None:
    install("badreg", ECHO + f"@hookimpl\ndef acc_train_register_strategies(register):\n    {body}\n")
    names = plugins.strategies().names()
    assert "echo" not in names and {"ddp", "fsdp"} <= set(names)
    text = failure("badreg")
    assert text.startswith('plugin "badreg" (distribution badreg-plugin) had its strategy registrations rejected')
    assert reason in text


LEGACY = """
class Legacy(Strategy):
    name = "legacy"
    def accelerator_kwargs(self, options, job):
        return {}
"""


def test_a_strategy_written_against_the_first_contract_is_refused_naming_the_change(install: Install) -> None:
    install("legacy", LEGACY + "@hookimpl\ndef acc_train_register_strategies(register):\n    register(Legacy())\n")
    assert "legacy" not in plugins.strategies().names() and "ddp" in plugins.strategies().names()
    text = failure("legacy")
    assert text.startswith('plugin "legacy" (distribution legacy-plugin) had its strategy registrations rejected')
    assert "Legacy.accelerator_kwargs takes an `options` argument" in text and "read self.options" in text


SECOND = """
class Second(Strategy):
    name = "second"
    def accelerator_kwargs(self, job):
        return {}
"""


@pytest.mark.parametrize(
    ("member", "says"),
    [
        ("    def plan_memory(self, plan):\n        return None\n", "`plan_memory` moved to the strategy's planner(): Second defines it on the strategy"),
        ("    def equivalent_to_ddp(self):\n        return True\n", "`equivalent_to_ddp` moved to the strategy's planner()"),
        ("    def parameter_shards(self, machine):\n        return 1\n", "`parameter_shards` moved to the strategy's planner()"),
        ("    launch_variables = ('MINE_',)\n", "`launch_variables` moved to the strategy's launch_protocol()"),
        ("    def launch_env(self, machine, scratch):\n        return {}\n", "`launch_env` moved to the strategy's launch_protocol()"),
        ("    def check_environment(self, machine):\n        pass\n", "Second.check_environment takes a `machine` argument"),
        ("    def expected_distributed_types(self, machine):\n        return set()\n", "Second.expected_distributed_types takes a `machine` argument"),
    ],
    ids=["plan_memory", "equivalent_to_ddp", "parameter_shards", "launch_variables", "launch_env", "check_environment", "expected_types"],
)
def test_a_strategy_written_against_the_second_contract_is_refused_naming_the_rename(install: Install, member: str, says: str) -> None:
    install("second", SECOND + member + "@hookimpl\ndef acc_train_register_strategies(register):\n    register(Second())\n")
    assert "second" not in plugins.strategies().names() and "ddp" in plugins.strategies().names()
    text = failure("second")
    assert text.startswith('plugin "second" (distribution second-plugin) had its strategy registrations rejected')
    assert says in text, text
    assert ("acc_train.api.StrategyPlanner" in text) == ("planner()" in says)
    assert ("acc_train.api.LaunchProtocol" in text) == ("launch_protocol()" in says)
    assert ("read self.machine" in text) == ("`machine` argument" in says)


def test_the_new_contract_registers() -> None:
    """Every installed strategy passes; the default planner and launch protocol serve one that defines neither."""
    from acc_train.strategy import legacy_contract_problem

    for strategy, _ in plugins.strategies().primary():
        assert legacy_contract_problem(strategy) is None, strategy.name


def test_a_taken_name_belongs_to_neither_plugin_and_the_rest_keeps_working(install: Install) -> None:
    install("zz-ddp", ECHO.replace('"echo"', '"ddp"') + "@hookimpl\ndef acc_train_register_strategies(register):\n    register(Echo())\n")
    reg = plugins.strategies()
    assert "ddp" not in reg.names() and "fsdp" in reg.names() and reg.get("data-parallel").name == "ddp"
    with pytest.raises(UserError, match='strategy name "ddp" is claimed by both plugin "ddp" and plugin "zz-ddp"'):
        reg.get("ddp")
    assert 'claimed by both plugin "ddp" and plugin "zz-ddp"' in failure("zz-ddp")


def test_the_command_reports_a_broken_plugin_and_keeps_working(install: Install) -> None:
    path = install("wrongsig", ECHO + "@hookimpl\ndef acc_train_register_strategies(register, extra):\n    register(Echo())\n")
    proc = run_cli("plugins", env={"PYTHONPATH": str(path)})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [f["name"] for f in data["failures"]] == ["wrongsig"]
    assert "does not match its spec" in data["failures"][0]["reason"]
    assert "ddp" in [p["name"] for p in data["plugins"]]
    listing = run_cli("strategies", env={"PYTHONPATH": str(path)})
    assert listing.returncode == 0 and "ddp" in listing.stdout
    assert 'warning: plugin "wrongsig" (distribution wrongsig-plugin) was skipped' in listing.stderr


def test_tracing_prints_registration_and_lifecycle_hook_calls(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(plugins.ENV_TRACE, "1")
    plugins.reset()
    try:
        plugins.strategies().names()
        plugins.call_lifecycle("acc_train_step_end", run=None, step=3, metrics={})
    finally:
        plugins.reset()
    err = capsys.readouterr().err
    assert "[acc_train hook] acc_train_register_strategies [plugin ddp]" in err
    assert "acc_train_step_end [hook]" in err and "step: 3" in err


def test_a_wrong_answer_to_the_accelerate_config_hook_is_an_error_naming_the_plugin(install: Install, tmp_path: Path) -> None:
    from acc_train.config import load_job

    install("badmap", "@hookimpl\ndef acc_train_accelerate_config(distributed_type, config):\n    return ['mine'] if distributed_type == 'MEGATRON_LM' else None\n")
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text("distributed_type: MEGATRON_LM\nnum_processes: 2\n")
    with pytest.raises(UserError, match='plugin "badmap" answered acc_train_accelerate_config for MEGATRON_LM with list'):
        load_job(cfg)
