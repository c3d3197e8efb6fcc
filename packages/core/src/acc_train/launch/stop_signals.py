"""Save on a signal, then stop: what a worker does when it is preempted or interrupted.

A signal in ``launch.save_signals`` (to the launcher, which passes it on, or to every process,
as Slurm and Ctrl-C send it) only sets a flag in the worker's handler; nothing is saved inside
the handler (Lightning's saves there fail intermittently, its issue 21406). The ranks agree on
the flag at step boundaries without waiting for the accelerator (:class:`StopAgreement`: an
all-reduce of host tensors over gloo, started at one boundary and read at the next), write a
checkpoint of that step through the normal atomic path, and stop (:mod:`acc_train.loop.loop`):
a signal that arrives during step N stops the run after step N + 1 at the latest.

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

__all__ = ["REPEAT_WINDOW_S", "StopRequest", "StopAgreement", "install", "read_stop_marker", "write_stop_marker", "stop_marker"]

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


class StopAgreement:
    """The ranks' common answer to "was any of us asked to stop?", at each step boundary.

    The flags are host values, so they travel over gloo (the default group where it is gloo, a
    gloo group of the same ranks beside NCCL), never through the accelerator: nothing waits for
    the device. The all-reduce of one boundary is started without waiting and read at the next
    (by then every rank has long passed it), so no rank waits for the slowest either. Every rank
    calls :meth:`poll` at every step boundary, and :meth:`close` when the loop ends."""

    def __init__(self, request: StopRequest) -> None:
        import torch.distributed as dist

        self.request = request
        self.group: object | None = None
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self.distributed:
            self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self._pending: tuple[object, object] | None = None

    def poll(self) -> int | None:
        """The signal to stop on (the one the ranks that got one got), or None to go on."""
        signum = float(self.request.signum or 0)
        if not self.distributed:
            return int(signum) or None
        import torch
        import torch.distributed as dist

        agreed = None
        if self._pending is not None:
            work, flags = self._pending
            work.wait()  # type: ignore[attr-defined]
            askers, signals = flags.tolist()  # type: ignore[attr-defined]
            agreed = round(signals / askers) if askers else None
        flags = torch.tensor([1.0 if signum else 0.0, signum])
        self._pending = (dist.all_reduce(flags, group=self.group, async_op=True), flags)
        return agreed

    def close(self) -> None:
        """Wait for the last all-reduce started (every rank started it)."""
        if self._pending is not None:
            self._pending[0].wait()  # type: ignore[attr-defined]
            self._pending = None


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
