"""How every ``acc-train`` command reports a mistake in the user's input."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

__all__ = ["EXIT_USER_ERROR", "user_errors"]

EXIT_USER_ERROR = 2


def user_errors(f: Callable[..., Any]) -> Callable[..., Any]:
    """Mistakes in the user's input: one message, exit 2, no traceback."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from acc_train.errors import UserError

        try:
            return f(*args, **kwargs)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USER_ERROR)

    return wrapper
