"""Fault injection for crash-safety tests: a process dies at a named point, as a SIGKILL would."""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

from acc_train.errors import UserError, closest

__all__ = ["ENV_FAULT", "ENV_FAULT_SIGNAL", "FAULT_POINTS", "Fault", "parse_fault", "check_fault_env", "fault_point"]

ENV_FAULT = "ACC_TRAIN_FAULT"
#: the signal the process sends itself there (default SIGKILL; SIGSTOP: it hangs, as a machine that stops answering)
ENV_FAULT_SIGNAL = "ACC_TRAIN_FAULT_SIGNAL"

#: every point the code calls :func:`fault_point` with, in the order a run reaches them
FAULT_POINTS = (
    "train-step",
    "save-start",
    "save-state-written",
    "save-before-manifest",
    "save-before-rename",
    "save-before-pointer",
)

_SPEC = re.compile(r"(?P<point>[^@:]*)(?:@(?P<step>[^:]*))?(?::(?P<rank>.*))?", re.S)


@dataclass(frozen=True)
class Fault:
    """Where a process kills itself: a point, and optionally one step and one global rank."""

    point: str
    step: int | None = None
    rank: int | None = None


def parse_fault(spec: str) -> Fault:
    """``POINT[@STEP][:RANK]`` -> :class:`Fault`; anything else is a :class:`UserError` that
    lists the valid points."""
    match = _SPEC.fullmatch(spec)
    point = match["point"] if match else spec

    def refuse(problem: str) -> UserError:
        return UserError(
            f"{ENV_FAULT}={spec!r}: {problem}",
            where=ENV_FAULT,
            hint=f"write POINT[@STEP][:RANK], POINT one of {', '.join(FAULT_POINTS)} (e.g. save-before-manifest@10:1), or unset it",
        )

    if point not in FAULT_POINTS:
        near = closest(point, FAULT_POINTS) if point else None
        raise refuse(f"{point!r} is not a fault point" + (f" (did you mean {near!r}?)" if near else "") if point else "it names no fault point")
    numbers: dict[str, int | None] = {}
    for part in ("step", "rank"):
        text = match[part] if match else None
        if text is None:
            numbers[part] = None
        elif not (text.isascii() and text.isdigit()):
            raise refuse(f"the {part} {text!r} is not a whole number >= 0")
        else:
            numbers[part] = int(text)
    return Fault(point, numbers["step"], numbers["rank"])


@functools.cache
def _fault_from(spec: str) -> Fault:
    return parse_fault(spec)


def check_fault_env() -> Fault | None:
    """The fault ``ACC_TRAIN_FAULT`` asks for (read once), or None; refuses a malformed value
    before any worker starts."""
    spec = os.environ.get(ENV_FAULT)
    sig = os.environ.get(ENV_FAULT_SIGNAL)
    if spec and sig:
        import signal

        if sig not in signal.Signals.__members__:
            raise UserError(f"{ENV_FAULT_SIGNAL}={sig!r} is not a signal name", where=ENV_FAULT_SIGNAL, hint="write e.g. SIGKILL or SIGSTOP, or unset it")
    return _fault_from(spec) if spec else None


def fault_point(name: str, step: int) -> None:
    """Die here, as a SIGKILL would, when ``ACC_TRAIN_FAULT`` names this point: for tests of
    crash safety. ``ACC_TRAIN_FAULT=save-before-manifest@10:1`` kills rank 1 while it saves
    step 10; ``@STEP`` and ``:RANK`` are optional. A worker the elastic agent restarted runs on."""
    if name not in FAULT_POINTS:
        raise AssertionError(f"fault point {name!r} is not in FAULT_POINTS")
    fault = check_fault_env()
    if fault is None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if fault.point == name and fault.step in (None, step) and fault.rank in (None, int(os.environ.get("RANK", "0"))):
        import signal

        os.kill(os.getpid(), signal.Signals[os.environ.get(ENV_FAULT_SIGNAL) or "SIGKILL"])
