"""Core's own plugin: what every install has, registered through the ordinary hooks."""

from __future__ import annotations

from collections.abc import Callable

from acc_train.checkpoint import CheckpointFormat, DCPFormat
from acc_train.hookspecs import hookimpl


@hookimpl
def acc_train_register_checkpoint_formats(register: Callable[[CheckpointFormat], None]) -> None:
    register(DCPFormat())
