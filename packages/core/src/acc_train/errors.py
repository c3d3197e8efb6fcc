"""Errors a person can act on.

A ``UserError`` is a mistake in the user's own input (a config key, a flag, a file).
The command prints it as one message and exits with code 2; it never shows a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["UserError", "PluginError", "closest", "EXIT_USER_ERROR", "LOST_PEER", "is_lost_peer", "CONNECTION_LOST", "is_connection_lost"]

EXIT_USER_ERROR = 2


class UserError(Exception):
    """What was wrong, where, and what to do about it."""

    def __init__(self, message: str, *, where: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.where = where
        self.hint = hint

    def __str__(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class PluginError(UserError):
    """A plugin broke the contract (failed import, duplicate name, bad registration)."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The closest valid name to a misspelt one, or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


#: what a rank records when another rank died under it: a symptom, not the cause
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout", "NCCL communicator was aborted", "ProcessGroupNCCL", "Timed out")


def is_lost_peer(text: str) -> bool:
    """Whether an error's text is a lost peer's symptom (:data:`LOST_PEER`)."""
    return any(s in text for s in LOST_PEER)


#: what a rank records when the connection to another rank closed under it (gloo's words): the
#: one symptom that is reported as a lost machine, where the run spans several
CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer")


def is_connection_lost(text: str) -> bool:
    """Whether an error's text says a connection to another rank closed (:data:`CONNECTION_LOST`)."""
    return any(s in text for s in CONNECTION_LOST)
