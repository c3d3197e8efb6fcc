"""Subcommands from plugins (``acc_train_register_commands``): found through core's registry like any
other registration, never over a built-in command, and a plugin whose hook raises does not take
the others' commands with it."""

from __future__ import annotations

from collections.abc import Iterator

import click
import pytest
from click.testing import CliRunner

from acc_train import hookimpl, plugins
from acc_train_cli.plugin_commands import PluginCommandGroup


@click.command("hello")
def hello() -> None:
    click.echo("hello from a plugin")


@click.command("built")
def shadow() -> None:
    click.echo("a plugin's command where a built-in one stands")


class Commands:
    @hookimpl
    def acc_train_register_commands(self, register):  # type: ignore[no-untyped-def]
        register(hello)
        register(shadow)


class Broken:
    @hookimpl
    def acc_train_register_commands(self, register):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")


@pytest.fixture
def group() -> Iterator[click.Group]:
    plugins.reset()
    pm = plugins.get_plugin_manager()
    pm.register(Commands(), name="commands-plugin")
    pm.register(Broken(), name="broken-plugin")
    grp = PluginCommandGroup()

    @grp.command("built")
    def built() -> None:
        click.echo("the built-in command")

    yield grp
    plugins.reset()


def test_a_plugin_command_runs_and_never_replaces_a_built_in_one(group: click.Group) -> None:
    result = CliRunner().invoke(group, ["hello"])
    assert result.exit_code == 0 and "hello from a plugin" in result.stdout
    assert 'plugin "broken-plugin"' in result.stderr and "boom" in result.stderr  # reported; the others stand
    assert 'registered the command "built", which is built in: ignored' in result.stderr
    built = CliRunner().invoke(group, ["built"])
    assert built.exit_code == 0 and built.stdout.strip() == "the built-in command"


def test_an_unknown_command_is_still_click_s_usage_error(group: click.Group) -> None:
    result = CliRunner().invoke(group, ["no-such-command"])
    assert result.exit_code == 2 and "No such command" in result.stderr
