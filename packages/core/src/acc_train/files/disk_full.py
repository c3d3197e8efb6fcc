"""Disk full at any write: one message naming the path and the free space, what was removed,
and what to do.

A full filesystem reaches Python in three shapes: an ``OSError`` with ``ENOSPC`` (or ``EDQUOT``,
a quota), a library's own error that quotes the system's text (safetensors: "No space left on
device (os error 28)"), or torch's serializer losing the errno entirely (``torch.save`` and
DCP's file writer: "unexpected pos 576 vs 534", measured on a full tmpfs with torch 2.13).
The last is recognised by the filesystem itself: a write that failed where less than
:data:`NEARLY_FULL` bytes are left is taken for a full disk.

:func:`remove_unfinished_writes` removes what failed or killed writes leave in an output
directory (a checkpoint's staging directory, a staged ``final/``): only a process that holds
the directory's run lock, or a run's own worker before its checks pass, may call it.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from acc_train.errors import UserError

__all__ = ["DiskFullError", "NEARLY_FULL", "disk_full", "disk_full_error", "free_space", "human_bytes", "raise_if_disk_full", "remove_unfinished_writes", "tree_size"]

#: a write that fails where fewer bytes than this are free is taken for a full disk
NEARLY_FULL = 1 << 20
_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_TEXTS = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122", "StorageFull")
#: a checkpoint's staging directories and a staged final/, relative to the output directory
UNFINISHED = ("checkpoints/.staging-*", ".final-*")


class DiskFullError(UserError):
    """A write failed because its filesystem is full (exit 2: the user frees space and resumes)."""


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures DCP's CheckpointException holds."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # torch.distributed.checkpoint: {rank: (exception, frames)}
            for value in failures.values():
                inner = value[0] if isinstance(value, tuple) and value else value
                if isinstance(inner, BaseException):
                    todo.append(inner)


def free_space(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(free bytes an unprivileged write may use, size) of the filesystem holding ``path`` (its
    nearest existing parent); None where it cannot be read."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        usage = shutil.disk_usage(p)
    except OSError:
        return None
    return usage.free, usage.total


def disk_full(exc: BaseException, where: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``exc`` was a write failing on a full filesystem (``where``: the path written to,
    for errors that lost the errno)."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno in _ERRNOS:
            return True
        if any(text in str(e) for text in _TEXTS):
            return True
    if where is not None and any(isinstance(e, (OSError, RuntimeError)) for e in _causes(exc)):
        space = free_space(where)
        return space is not None and space[0] < NEARLY_FULL
    return False


def _written_path(exc: BaseException) -> str | None:
    for e in _causes(exc):
        if isinstance(e, OSError) and e.filename:
            return os.fsdecode(e.filename)
    return None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def disk_full_error(
    exc: BaseException, where: str | os.PathLike[str] | None = None, *, what: str = "writing", done: str = "", hint: str | None = None
) -> DiskFullError | None:
    """A :class:`DiskFullError` for ``exc`` if it was a full disk, else None. The message
    names the path (the one the failing call names, else ``where``), the filesystem's free
    space now, ``what`` was being written and ``done``: what was removed or kept."""
    if not disk_full(exc, where):
        return None
    path = _written_path(exc) or (str(where) if where is not None else None)
    space = free_space(path) if path else None
    room = f" ({human_bytes(space[0])} free of {human_bytes(space[1])} on that filesystem)" if space else ""
    message = f"disk full {what} {path}{room}" if path else f"disk full {what}"
    return DiskFullError(
        message + (f"; {done}" if done else ""),
        hint=hint or "free space on that filesystem, then run the same command again (add --resume auto to continue a run)",
    )


def tree_size(path: Path) -> int:
    """Bytes in the files under ``path`` (0 where it is gone; files removed meanwhile are skipped)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def remove_unfinished_writes(output_dir: str | os.PathLike[str]) -> int:
    """Remove the staging directories of checkpoint saves and of ``final/`` that a failed or
    killed write left in ``output_dir``; returns the bytes freed. The caller holds the run lock
    (or is the run's own main process), so nothing is writing them."""
    freed = 0
    out = Path(output_dir)
    for pattern in UNFINISHED:
        for left in out.glob(pattern):
            if left.is_symlink() or not left.is_dir():
                continue
            freed += tree_size(left)
            shutil.rmtree(left, ignore_errors=True)
    return freed


def raise_if_disk_full(exc: BaseException, staging: Path, step: int, complete: Callable[[], list[str]]) -> None:
    """A checkpoint save that failed on a full disk: its staging directory is removed (by every
    rank that failed; the command removes what is left once every worker has ended) and a
    :class:`DiskFullError` names the path, the free space and the checkpoint a resume continues
    from (``complete()``: the committed checkpoints' names, oldest first). Otherwise returns."""
    if not disk_full(exc, staging):
        return
    error = disk_full_error(exc, staging, what=f"while writing the checkpoint of step {step} into")
    assert error is not None
    freed = tree_size(staging)
    shutil.rmtree(staging, ignore_errors=True)
    kept = complete()
    error.message += f"; the partial checkpoint was removed ({human_bytes(freed)} freed); " + (
        f"the last complete checkpoint, {kept[-1]}, is intact" if kept else "there is no earlier checkpoint"
    )
    if kept:
        error.hint = (
            "free space on that filesystem (checkpoint.keep_last keeps fewer checkpoints), then run the same command "
            f"with --resume auto to continue from {kept[-1]}"
        )
    raise error from None
