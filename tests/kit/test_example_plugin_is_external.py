"""examples/strategy-localsgd is a third-party plugin in all but location: installed as a package
of its own, found only through its entry point, never imported by acc-train."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from acc_train import plugins

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_plugins() -> object:
    plugins.reset()
    yield
    plugins.reset()


def test_it_is_found_through_its_entry_point_and_nothing_in_acc_train_imports_it() -> None:
    dist = metadata.distribution("acc-train-strategy-localsgd")
    assert [(ep.name, ep.value) for ep in dist.entry_points if ep.group == "acc_train"] == [("local-sgd", "acc_train_localsgd.plugin")]
    assert plugins.strategies().owner("local-sgd") == "local-sgd"
    info = {i.name: i for i in plugins.plugin_infos()}["local-sgd"]
    assert (info.distribution, info.version) == ("acc-train-strategy-localsgd", "0.1.0")
    assert not [p for p in (ROOT / "packages").rglob("*.py") if "acc_train_localsgd" in p.read_text()]


def test_blocking_it_by_name_removes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugins.ENV_BLOCK, "local-sgd")
    assert "local-sgd" not in plugins.strategies().names() and "ddp" in plugins.strategies().names()
    assert "local-sgd-per-rank" not in plugins.checkpoint_formats().names()
