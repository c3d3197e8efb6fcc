"""The ``acc-train`` group that adds the subcommands plugins register (``acc_train_register_commands``).

Plugins are asked only when a subcommand is not a built-in one: ``acc-train --help`` imports
nothing of core (it stays fast), so it lists the built-in commands; ``acc-train NAME --help``
shows a plugin's command. The commands come from core's registry like every other registration
(:func:`acc_train.plugins.commands`): a plugin whose hook raises, or two plugins claiming one
name, are reported as plugin failures, and the other plugins' commands stand.
"""

from __future__ import annotations

import click

__all__ = ["PluginCommandGroup"]


class PluginCommandGroup(click.Group):
    """A click group whose unknown subcommands are looked up among the plugins' commands."""

    _plugin_commands: dict[str, click.Command] | None = None

    def plugin_commands(self) -> dict[str, click.Command]:
        if self._plugin_commands is None:
            from acc_train.plugins import commands

            from acc_train_cli.errors import report_plugin_failures

            registered, found = commands().registered(), {}
            report_plugin_failures()  # a plugin whose hook raised, two claiming one name
            for command, plugin in registered:
                name = command.name
                if not isinstance(command, click.Command):
                    click.echo(f'warning: plugin "{plugin}" registered {command!r}, not a click command: ignored', err=True)
                elif name in self.commands:
                    click.echo(f'warning: plugin "{plugin}" registered the command "{name}", which is built in: ignored', err=True)
                else:
                    found[name] = command
            self._plugin_commands = found
        return self._plugin_commands

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, cmd_name) or self.plugin_commands().get(cmd_name)
