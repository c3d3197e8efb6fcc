"""One run per output directory: a lock held by the command for the run's life.

The command on machine 0 takes an exclusive ``flock`` on ``OUTPUT_DIR/.acc-train.lock`` before
anything else touches the directory and keeps it until its workers have ended; the operating
system releases it when that process dies, however it dies, so a crashed run never leaves a
stale lock. A second run into the same directory (a new one, or a ``--resume`` started while the
first still trains) is refused at once, naming the holder written in the file: host, pid and
since when. On a filesystem several machines share, this assumes the filesystem supports
``flock`` across clients (NFSv4, Lustre and GPFS do; NFSv3 needs its lock daemon); on one that
does not, the lock only sees runs started on the same machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from acc_train.errors import UserError

__all__ = ["LOCK_NAME", "run_lock"]

LOCK_NAME = ".acc-train.lock"


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its name"


@contextlib.contextmanager
def run_lock(output_dir: str) -> Iterator[None]:
    """Hold ``output_dir``'s run lock while the block runs; a :class:`UserError` (exit 2) naming
    the holder if another process holds it. If the run wrote nothing, the lock file (and the
    directory, if this call created it) is removed again."""
    import fcntl

    out = Path(output_dir)
    created = not os.path.lexists(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    before = {p.name for p in out.iterdir()} - {LOCK_NAME}
    lock_created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the workers (O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise UserError(
            f"{output_dir!r} is in use by another run ({holder})",
            where="--output-dir",
            hint="wait for that run to end (or stop it), or pass another --output-dir",
        ) from None
    since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode(), 0)
    try:
        yield
    finally:
        if lock_created and {p.name for p in out.iterdir()} - {LOCK_NAME} == before:  # the run wrote nothing: leave nothing
            path.unlink()
            if created:
                out.rmdir()
        else:
            os.ftruncate(fd, 0)  # no holder any more; the file stays (removing it would race a newcomer)
        os.close(fd)
