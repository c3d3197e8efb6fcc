"""How every ``acc-train`` command reports a problem: a mistake in the user's input (one message,
exit ``acc_train.errors.EXIT_USER_ERROR``, no traceback) or a plugin that failed to load (a warning).

The exit code is core's one constant, which the workers exit with and the launcher reads too;
it is imported when a command runs, as everything of core is, so ``--help`` stays fast.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

__all__ = ["report_plugin_failures", "user_errors"]


def user_errors(f: Callable[..., Any]) -> Callable[..., Any]:
    """Mistakes in the user's input, and a full disk: one message, the user-error exit code, no traceback."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from acc_train.errors import EXIT_USER_ERROR, UserError

        try:
            return f(*args, **kwargs)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USER_ERROR)
        except Exception as exc:
            from acc_train.files.disk_full import disk_full_error

            full = disk_full_error(exc)  # a full disk anywhere (the data cache, a launch's files): one message
            if full is None:
                raise
            click.echo(f"error: {full}", err=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper


def report_plugin_failures() -> None:
    """One warning per plugin that failed to load; the others keep working."""
    from acc_train.plugins import plugin_failures

    for failure in plugin_failures():
        click.echo(f"warning: {failure}", err=True)
