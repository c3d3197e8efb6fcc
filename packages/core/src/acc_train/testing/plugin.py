"""The conformance kit's pytest plugin, registered through the ``pytest11`` entry point ``acc_train``.

It stays idle unless asked: ``--acc-train-strategy NAME`` adds the standard suite
(:class:`acc_train.testing.TestStrategyConformance`) for NAME to the session, and a test module
marked ``acc_train_strategy("NAME", ...)`` that imports the suite class runs it for those names.
A strategy states the effect that distinguishes it (a ``run.json`` key counting its own work in a
launch) with the marker's ``effects={"NAME": "KEY"}`` or ``--acc-train-effect NAME=KEY``.
Disable it altogether with ``-p no:acc_train``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["MARKER", "OPTION", "EFFECT_OPTION"]

MARKER = "acc_train_strategy"
OPTION = "--acc-train-strategy"
EFFECT_OPTION = "--acc-train-effect"
_ARG = "acc_train_strategy_name"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("acc-train", "acc-train strategy conformance kit")
    group.addoption(
        OPTION,
        action="append",
        default=[],
        metavar="NAME",
        help="run acc-train's conformance suite against the strategy NAME (repeatable)",
    )
    group.addoption(
        EFFECT_OPTION,
        action="append",
        default=[],
        metavar="NAME=KEY",
        help="the run.json key that counts what strategy NAME does of its own in a launch; the suite requires it present and changing (repeatable)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*names, effects={{name: run.json key}}): run acc-train's conformance suite "
        "(acc_train.testing.TestStrategyConformance) in this module or class against these strategies",
    )
    config.addinivalue_line("markers", "launch: starts worker processes through the elastic launcher (slow)")
    if not config.pluginmanager.hasplugin("xdist"):  # the kit's groups mean nothing then, and warn nothing either
        config.addinivalue_line("markers", "xdist_group(name): pytest-xdist keeps a group's tests on one worker (not installed here)")
    if config.getoption(OPTION):
        from acc_train.testing import suite

        path = str(Path(suite.__file__).resolve())
        if path not in config.args:
            config.args.append(path)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if _ARG not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker(MARKER)
    names = list(marker.args) if marker is not None else list(metafunc.config.getoption(OPTION))
    if not names or not all(isinstance(n, str) and n for n in names):
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: name the strategy to check, with "
            f'pytest.mark.{MARKER}("NAME") on the module or class, or {OPTION} NAME'
        )
    metafunc.parametrize(_ARG, list(dict.fromkeys(names)), ids=lambda n: n)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep one strategy's launch tests on one xdist worker, so they share its launches."""
    from acc_train.testing.runs import kit_group

    groups: dict[str, str] = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or _ARG not in callspec.params:
            continue
        name = callspec.params[_ARG]
        if name not in groups:
            groups[name] = kit_group(name)
        item.add_marker(pytest.mark.xdist_group(groups[name]))


@pytest.fixture
def acc_train_effect(request: pytest.FixtureRequest, acc_train_strategy_name: str) -> str | None:
    """The ``run.json`` key that distinguishes the strategy under test, as its author stated it
    (the marker's ``effects``, or ``--acc-train-effect``), or None where none is stated."""
    effects = _effects(request.config.getoption(EFFECT_OPTION))
    marker = request.node.get_closest_marker(MARKER)
    stated = marker.kwargs.get("effects", {}) if marker is not None else {}
    if not isinstance(stated, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in stated.items()):
        raise pytest.UsageError(f'{request.node.nodeid}: {MARKER}(..., effects=...) takes {{"STRATEGY": "RUN_JSON_KEY"}}, got {stated!r}')
    unknown = sorted(set(stated) - set(marker.args)) if marker is not None else []
    if unknown:
        raise pytest.UsageError(f"{request.node.nodeid}: {MARKER}'s effects name {unknown}, which the marker does not check; it checks {list(marker.args)}")
    return {**stated, **effects}.get(acc_train_strategy_name)


def _effects(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, key = value.partition("=")
        if not sep or not name or not key:
            raise pytest.UsageError(f"{EFFECT_OPTION} {value!r}: write NAME=KEY (the strategy, the run.json key of its effect)")
        out[name] = key
    return out


@pytest.fixture(scope="session")
def acc_train_kit(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The session's kit launches (:class:`acc_train.testing.KitRuns`), shared by every strategy's suite."""
    from acc_train.testing.runs import KitRuns

    return KitRuns(tmp_path_factory.mktemp("acc-train-kit"))
