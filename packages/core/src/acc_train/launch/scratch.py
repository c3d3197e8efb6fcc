"""What a launch leaves outside the output directory, and how it never outlives the launch.

The workers read the resolved config from a file the command writes (and leave markers beside
it: claimed, stopped); each launch keeps these in a folder of its own under one known folder,
``$TMPDIR/acc-train-launches/PID-XXXX``, removed when the command ends. A command that was
killed (SIGKILL, the OOM killer) cannot remove it: the next command on the machine removes every
folder there whose process is gone. The workers die with the command that started them
(:func:`die_with_parent`), so none is left training unsupervised.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LAUNCHES_DIR", "launch_folder", "die_with_parent"]

LAUNCHES_DIR = Path(tempfile.gettempdir()) / "acc-train-launches"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


@contextlib.contextmanager
def launch_folder() -> Iterator[Path]:
    """A private folder for this launch's files, removed at the end; folders of commands that
    died first are removed on the way in."""
    LAUNCHES_DIR.mkdir(mode=0o777, exist_ok=True)
    with contextlib.suppress(OSError):
        os.chmod(LAUNCHES_DIR, 0o1777)  # shared by the machine's users, as /tmp is
    for old in LAUNCHES_DIR.iterdir():
        pid = old.name.split("-", 1)[0]
        with contextlib.suppress(OSError):
            if pid.isdigit() and not _alive(int(pid)) and old.stat().st_uid == os.getuid():
                shutil.rmtree(old, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=LAUNCHES_DIR))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when the process that started it (the
    launching command) dies, however it dies; called first thing in a worker."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before we asked
        os._exit(1)
