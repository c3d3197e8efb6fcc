"""The plugin manager and registries, with in-test plugins registered in fixtures."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from acc_train import Strategy, StrategyOptions, UserError, hookimpl, hookspecs, plugins
from acc_train.config import load_job


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    plugins.reset()
    yield
    plugins.reset()


class EchoOptions(StrategyOptions):
    level: int = Field(1, ge=0)
    mode: typing.Literal["a", "b"] = "a"


class EchoStrategy(Strategy):
    name = "echo"
    aliases = ("echo-alias",)
    presets = {"echo-high": {"level": 9}}
    options_schema = EchoOptions

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        return {}


class EchoPlugin:
    @hookimpl
    def acc_train_register_strategies(self, register: Any) -> None:
        register(EchoStrategy())


def register(plugin: object, name: str) -> None:
    plugins.get_plugin_manager().register(plugin, name=name)


def test_registry_holds_exactly_the_names_of_the_workspace_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.ENV_BLOCK, "local-sgd,ft")  # the example third-party plugin (installed for the kit) and strategy-ft, which core never names
    assert plugins.strategies().names() == [
        "data-parallel", "ddp", "deepspeed", "fsdp", "fsdp-offload", "fsdp1", "fsdp2", "fully-sharded",
        "zero", "zero1", "zero2", "zero2-offload", "zero3", "zero3-offload",
    ]  # fmt: skip
    assert plugins.checkpoint_formats().names() == ["dcp", "deepspeed", "fsdp-full"]
    assert plugins.wrap_policies().names() == ["none", "size", "transformer"]
    assert {s.name: owner for s, owner in plugins.strategies().primary()} == {"ddp": "ddp", "deepspeed": "deepspeed", "fsdp": "fsdp"}


def test_in_test_plugin_registers_a_strategy_with_aliases_and_presets() -> None:
    register(EchoPlugin(), "echo")
    reg = plugins.strategies()
    assert {"echo", "echo-alias", "echo-high"} <= set(reg.names())
    assert reg.get("echo-alias") is reg.get("echo-high")
    assert reg.owner("echo") == "echo"


def test_preset_options_are_the_starting_point_and_config_overrides_them() -> None:
    register(EchoPlugin(), "echo")
    job = load_job(flags={"strategy.name": ("echo-high", "--strategy")})
    assert job.strategy.options.level == 9
    job = load_job(flags={"strategy.name": ("echo-high", "--strategy")}, sets=["strategy.level=3"])
    assert job.strategy.options.level == 3 and job.to_dict()["strategy"] == {"name": "echo-high", "level": 3, "mode": "a"}


def test_strategy_options_are_strict() -> None:
    register(EchoPlugin(), "echo")
    with pytest.raises(UserError, match=r'strategy\.levle .*did you mean "strategy\.level"'):
        load_job(flags={"strategy.name": ("echo", "--strategy")}, sets=["strategy.levle=2"])
    with pytest.raises(UserError, match="strategy.mode"):
        load_job(flags={"strategy.name": ("echo", "--strategy")}, sets=["strategy.mode=c"])


def test_two_plugins_claiming_one_name_is_an_error_naming_both() -> None:
    register(EchoPlugin(), "first-echo")
    register(EchoPlugin(), "second-echo")
    assert "ddp" in plugins.strategies().names() and "echo" not in plugins.strategies().names()  # the rest keeps working
    with pytest.raises(UserError, match='"echo" is claimed by both plugin "first-echo" and plugin "second-echo"'):
        plugins.strategies().get("echo")
    assert any(f.name == "second-echo" and '"echo" is claimed by both' in f.reason for f in plugins.plugin_failures())


def test_a_plugin_whose_registration_raises_is_skipped_and_reported() -> None:
    class Broken:
        @hookimpl
        def acc_train_register_strategies(self, register: Any) -> None:
            raise RuntimeError("broken on purpose")

    register(Broken(), "broken")
    assert "ddp" in plugins.strategies().names()
    failures = plugins.plugin_failures()
    assert any(f.name == "broken" and "broken on purpose" in f.reason for f in failures)


def test_blocking_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.ENV_BLOCK, "ddp,fsdp,deepspeed,local-sgd,ft")
    assert plugins.strategies().names() == []
    with pytest.raises(UserError, match="pip install acc-train-strategy-ddp"):
        plugins.strategies().get("ddp")


def test_autoload_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.ENV_DISABLE_AUTOLOAD, "1")
    assert [i.name for i in plugins.plugin_infos()] == ["builtin"]
    assert plugins.checkpoint_formats().names() == ["dcp"]  # core's own plugin still loads


def test_lifecycle_hooks_reach_plugins() -> None:
    seen: list[tuple[str, int]] = []

    class Observer:
        @hookimpl
        def acc_train_step_end(self, run: Any, step: int, metrics: dict[str, Any]) -> None:
            seen.append(("step", step))

    register(Observer(), "observer")
    plugins.call_lifecycle("acc_train_step_end", run=None, step=3, metrics={})
    assert seen == [("step", 3)]


def test_every_hookspec_is_prefixed_typed_and_documented() -> None:
    specs = [f for name, f in vars(hookspecs).items() if name.startswith("acc_train_") and callable(f)]
    assert len(specs) >= 8
    for spec in specs:
        sig = inspect.signature(spec)
        assert sig.return_annotation != inspect.Signature.empty, spec.__name__
        assert all(p.annotation != inspect.Parameter.empty for p in sig.parameters.values()), spec.__name__
        doc = inspect.getdoc(spec) or ""
        assert "Called" in doc or "called" in doc, spec.__name__
        for param in sig.parameters:
            assert f":param {param}:" in doc, (spec.__name__, param)


def test_resolved_configs_of_every_strategy_and_preset_load_back(tmp_path: Path) -> None:
    """Workers read the resolved config.yaml: it must validate to the same job."""
    for name in plugins.strategies().names():
        job = load_job(flags={"strategy.name": (name, "--strategy")})
        path = tmp_path / f"{name}.yaml"
        path.write_text(job.to_yaml())
        assert load_job(path).to_dict() == job.to_dict(), name


def test_the_not_installed_hint_table_names_exactly_what_the_workspace_plugins_register(monkeypatch: pytest.MonkeyPatch) -> None:
    """Core's one table of strategy names (for "pip install ..." hints) cannot drift from the packages."""
    monkeypatch.setenv(plugins.ENV_BLOCK, "local-sgd,ft")  # the example, and strategy-ft: core names neither
    registry = plugins.strategies()
    distributions = {info.name: info.distribution for info in plugins.plugin_infos()}
    registered = {name: distributions[registry.owner(name)] for name in registry.names()}
    assert registered == plugins.KNOWN_STRATEGY_PACKAGES


def test_a_registered_strategy_is_a_prototype_and_resolving_binds_its_options() -> None:
    from acc_train import PluginError, resolve_strategy

    register(EchoPlugin(), "echo")
    prototype = plugins.strategies().get("echo-high")
    with pytest.raises(PluginError, match="not configured"):
        prototype.options  # noqa: B018
    configured = resolve_strategy("echo-high", {"mode": "b"})
    assert isinstance(configured, EchoStrategy) and configured is not prototype
    assert (configured.options.level, configured.options.mode) == (9, "b")
    assert not prototype.is_configured
