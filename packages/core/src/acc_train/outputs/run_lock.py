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
import sys
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


def _write_holder(fd: int, since: str, out: Path) -> None:
    """Write who holds the lock. On a full disk, what failed or killed writes of earlier runs left
    (a checkpoint's staging directory, a staged final/: this process holds the lock, so nothing
    writes them) is removed first, with a line saying so; if the disk is still full, a
    :class:`DiskFullError` says what takes the space."""
    from acc_train.files.disk_full import disk_full, disk_full_error, human_bytes, remove_unfinished_writes

    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}).encode()
    os.ftruncate(fd, 0)
    try:
        os.pwrite(fd, info, 0)
        return
    except OSError as exc:
        if not disk_full(exc, out):
            raise
    freed = remove_unfinished_writes(out)
    if freed:
        sys.stderr.write(f"acc-train: the disk holding {str(out)!r} is full: removed {human_bytes(freed)} of unfinished writes an earlier run left there\n")
    try:
        os.pwrite(fd, info, 0)
    except OSError as exc:
        full = disk_full_error(exc, out / LOCK_NAME, what="while taking the run lock", done="nothing was changed", hint=space_hint(out))
        if full is None:
            raise
        raise full from None


def space_hint(out: Path) -> str:
    """What to do about a full disk under ``out``: what the run's checkpoints take there."""
    from acc_train.checkpoint.layout import complete_steps
    from acc_train.files.disk_full import human_bytes, tree_size

    steps = complete_steps(out / "checkpoints") if (out / "checkpoints").is_dir() else []
    hint = "free space on that filesystem, then run the same command again"
    if len(steps) > 1:
        sizes = sum(tree_size(p) for _, p in steps[:-1])
        hint += (
            f"; this run's {len(steps) - 1} checkpoint(s) before the latest ({steps[-1][1].name}) take {human_bytes(sizes)} "
            f"and a resume needs only the latest (e.g. rm -r {steps[0][1]})"
        )
    return hint


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
    try:
        _write_holder(fd, since, out)
    except BaseException:
        os.close(fd)
        raise
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
