"""The ``acc-train`` group that adds the subcommands plugins register (``acc_train_register_commands``).

Plugins are asked only when a subcommand is not a built-in one: ``acc-train --help`` imports
nothing of core (it stays fast), so it lists the built-in commands; ``acc-train NAME --help``
shows a plugin's command.
"""

from __future__ import annotations

from typing import Any

import click

__all__ = ["PluginCommandGroup"]


class PluginCommandGroup(click.Group):
    """A click group whose unknown subcommands are looked up among the plugins' commands."""

    _plugin_commands: dict[str, click.Command] | None = None

    def plugin_commands(self) -> dict[str, click.Command]:
        if self._plugin_commands is None:
            from acc_train.plugins import get_plugin_manager

            found: dict[str, click.Command] = {}
            pm = get_plugin_manager()
            for impl in pm.hook.acc_train_register_commands.get_hookimpls():
                def register(command: Any, plugin: str = impl.plugin_name) -> None:
                    name = getattr(command, "name", None)
                    if not isinstance(command, click.Command) or not name:
                        click.echo(f'warning: plugin "{plugin}" registered {command!r}, not a named click command: ignored', err=True)
                    elif name in self.commands or name in found:
                        click.echo(f'warning: plugin "{plugin}" registered the command "{name}", which is taken: ignored', err=True)
                    else:
                        found[name] = command

                impl.function(register=register)
            self._plugin_commands = found
        return self._plugin_commands

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, cmd_name) or self.plugin_commands().get(cmd_name)
