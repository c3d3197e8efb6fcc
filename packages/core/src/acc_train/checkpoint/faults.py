"""Fault injection for crash-safety tests: a process dies at a named point, as a SIGKILL would."""

from __future__ import annotations

import os

__all__ = ["ENV_FAULT", "fault_point"]

ENV_FAULT = "ACC_TRAIN_FAULT"


def fault_point(name: str, step: int) -> None:
    """Die here, as a SIGKILL would, when ``ACC_TRAIN_FAULT`` names this point: for tests of
    crash safety. ``ACC_TRAIN_FAULT=save-before-manifest@10:1`` kills rank 1 while it saves
    step 10; ``@STEP`` and ``:RANK`` are optional. A worker the elastic agent restarted runs on."""
    spec = os.environ.get(ENV_FAULT)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    spec, _, rank = spec.partition(":")
    point, _, at = spec.partition("@")
    if point == name and (not at or int(at) == step) and (not rank or os.environ.get("RANK", "0") == rank):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
