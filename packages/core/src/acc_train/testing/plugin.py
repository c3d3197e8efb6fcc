"""The conformance kit's pytest plugin, registered through the ``pytest11`` entry point ``acc_train``.

It stays idle unless asked: ``--acc-train-strategy NAME`` adds the standard suite
(:class:`acc_train.testing.TestStrategyConformance`) for NAME to the session, and a test module
marked ``acc_train_strategy("NAME", ...)`` that imports the suite class runs it for those names.
Disable it altogether with ``-p no:acc_train``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["MARKER", "OPTION"]

MARKER = "acc_train_strategy"
OPTION = "--acc-train-strategy"
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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*names): run acc-train's conformance suite (acc_train.testing.TestStrategyConformance) "
        "in this module or class against these strategies",
    )
    config.addinivalue_line("markers", "launch: starts worker processes through the elastic launcher (slow)")
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


@pytest.fixture(scope="session")
def acc_train_kit(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The session's kit launches (:class:`acc_train.testing.KitRuns`), shared by every strategy's suite."""
    from acc_train.testing.runs import KitRuns

    return KitRuns(tmp_path_factory.mktemp("acc-train-kit"))
