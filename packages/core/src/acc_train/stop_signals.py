"""Save on a signal, then stop: what a worker does when it is preempted or interrupted.

A signal in ``launch.save_signals`` (to the launcher, which passes it on, or to every process,
as Slurm and Ctrl-C send it) only sets a flag in the worker's handler; nothing is saved inside
the handler (Lightning's saves there fail intermittently, its issue 21406). At the next step
boundary the ranks agree on the flag, carried in the step's loss reduction, write a checkpoint
of that step through the normal atomic path, and stop (:mod:`acc_train.loop.loop`).

The same signal often arrives twice within a moment (Slurm or a terminal signals the whole
process group, and the launcher passes its own copy on): one arriving within
:data:`REPEAT_WINDOW_S` of the first is the same request. A later one stops the process at
once, by the signal's default action; an interrupted save leaves only its staging directory,
which the next launch removes, and the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import FrameType

__all__ = ["REPEAT_WINDOW_S", "StopRequest", "install", "read_stop_marker", "write_stop_marker", "stop_marker"]

#: seconds within which a repeated signal is the same request, not a second one
REPEAT_WINDOW_S = 2.0


class StopRequest:
    """The signal a worker was asked to stop by, set from its signal handlers."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._at = 0.0

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._at = signum, now
        elif now - self._at > REPEAT_WINDOW_S:  # a second request: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def install(names: list[str]) -> StopRequest:
    """Handle the signals named (``SIGTERM``...) by recording a stop request."""
    request = StopRequest()
    for name in names:
        signal.signal(getattr(signal, name), request._handle)
    return request


def stop_marker(config_file: str) -> Path:
    """Where a worker that stopped on a signal says so to the command of its machine: beside
    the resolved config the command handed the workers (as ``claimed_marker``)."""
    return Path(f"{config_file}.stopped")


def write_stop_marker(config_file: str, signum: int, step: int, checkpoint: str | None) -> None:
    stop_marker(config_file).write_text(json.dumps({"signal": signal.Signals(signum).name, "signum": signum, "step": step, "checkpoint": checkpoint}))


def read_stop_marker(config_file: str) -> dict | None:
    try:
        return json.loads(stop_marker(config_file).read_text())
    except (OSError, ValueError):
        return None
