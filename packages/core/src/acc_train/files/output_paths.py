"""Making output directories without harming what is there: refusing paths that cannot be
created, and writing a new directory under a fresh name before it takes its place.

A path under a regular file, under ``/proc`` or in a directory this process cannot write is
refused up front with the flag that named it, before anything is created; a new directory is
written into a uniquely named sibling (``tempfile.mkdtemp``, never a fixed name that may be the
user's), renamed into place only when complete, and removed, with any parent it had to create,
when anything fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from acc_train.errors import UserError

__all__ = ["check_creatable", "check_new_directory", "new_directory", "fresh_directory", "readable", "replace_directory", "replace_file"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _nearest_existing(path: Path) -> tuple[Path, bool]:
    """``path`` itself or its closest ancestor that exists, and whether it is a directory (one
    this process may not look into counts as one: trying to write there says why not)."""
    current = path.absolute()
    while True:
        try:
            return current, stat.S_ISDIR(current.stat().st_mode)
        except (FileNotFoundError, NotADirectoryError):
            if current == current.parent:
                return current, True
            current = current.parent
        except OSError:  # no permission to look: the probe below reports it
            return current, True


def check_creatable(path: str, where: str, what: str = "output directory") -> Path:
    """Refuse a directory path that cannot be created (or written into, if it exists).

    Creates nothing that outlives the call: whether the nearest existing directory takes a new
    entry is tried with a uniquely named directory, removed at once (``os.access`` alone would
    say yes to root in a read-only directory and under ``/proc``).
    """
    if not path.strip():
        raise UserError(f"the {what} is empty", where=where, hint="name a directory (the current one is `.`)")
    if "\0" in path:
        raise UserError(f"the {what} {path!r} holds a NUL character, which no file name can", where=where)
    target = Path(path)
    if target.is_symlink() and not target.exists():  # a link to nowhere: the workers would fail late on it
        raise UserError(
            f"{path!r} is a symbolic link to {os.readlink(target)!r}, which does not exist",
            where=where,
            hint=f"create the directory it points to, or name another {what}",
        )
    existing, is_dir = _nearest_existing(target)
    if not is_dir:
        shown = "it" if existing == target.absolute() else f"{str(existing)!r}"
        raise UserError(
            f"{path!r} cannot be a directory: {shown} is a file",
            where=where,
            hint=f"name an {what} that is not inside a file",
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".acc-train-probe-", dir=existing))
    except OSError as exc:
        doing = f"cannot write into {path!r}" if existing == target.absolute() else f"cannot create {path!r}: {str(existing)!r} takes no new entries"
        raise UserError(
            f"{doing} ({exc.strerror or exc})",
            where=where,
            hint=f"name an {what} in a directory you can write to",
        ) from None
    return target


def check_new_directory(path: str, where: str) -> Path:
    """Refuse ``path`` as a new directory: it exists, or it cannot be created."""
    target = Path(path)
    if os.path.lexists(target):
        raise UserError(f"{path!r} already exists", where=where, hint="name a new directory; nothing is overwritten")
    return check_creatable(path, where)


@contextmanager
def new_directory(path: str, where: str) -> Iterator[Path]:
    """Yield a fresh staging directory beside ``path``, renamed to ``path`` when the block ends.

    ``path`` must not exist. Missing parents are created; if the block raises, the staging
    directory and the parents made for it are removed, and ``path`` never appears.
    """
    target = check_new_directory(path, where)
    made: list[Path] = []
    parent = target.absolute().parent
    while not parent.exists():
        made.append(parent)
        parent = parent.parent
    staging: Path | None = None
    try:
        for directory in reversed(made):
            directory.mkdir()
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.absolute().parent))
        yield staging
        if target.exists():  # appeared while we wrote: never replaced
            raise UserError(f"{path!r} appeared while it was being written", where=where, hint="name a new directory")
        readable(staging)  # mkdtemp's 0700 would make OUT private, and safetensors writes its files 0600
        os.rename(staging, target)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for directory in made:  # deepest first
            try:
                directory.rmdir()
            except OSError:
                break
        raise


def readable(path: Path) -> None:
    """Give ``path`` (a file, or a directory and everything in it) the permissions the umask
    gives a new file or directory: a colleague on a shared cluster reads a run's outputs under
    umask 022 as with any other file. Needed where a library writes 0600 whatever the umask
    (safetensors 0.8, ``tempfile``'s files and directories). Files this process does not own
    are left as they are."""
    mask = _umask()
    todo = [Path(path)]
    while todo:
        p = todo.pop()
        try:
            if p.is_symlink():
                continue
            if p.is_dir():
                os.chmod(p, 0o777 & ~mask)
                todo.extend(p.iterdir())
            else:
                os.chmod(p, 0o666 & ~mask)
        except OSError:  # another rank's file, or gone: its writer sees to it
            continue


def fresh_directory(parent: Path, prefix: str) -> Path:
    """A new, uniquely named directory in ``parent`` (``tempfile.mkdtemp``: never a name that
    may already be the user's), with the permissions the umask gives, not mkdtemp's 0700."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(path, 0o777 & ~_umask())
    return path


def replace_file(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: into a fresh temporary file beside it, then renamed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would make it private
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def replace_directory(new: Path, target: Path) -> None:
    """Put the directory ``new`` in ``target``'s place so that a crash at any moment leaves
    either the old ``target`` or the new one, whole: an atomic exchange of the two (Linux's
    ``renameat2(RENAME_EXCHANGE)``), then the old one, now at ``new``, removed. Where the
    exchange is not available, the old one is renamed aside first (a crash between the two
    renames leaves it under its aside name, which the next replacement removes)."""
    if not os.path.lexists(target):
        os.replace(new, target)
        return
    if _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
    os.rmdir(aside)
    os.rename(target, aside)
    os.replace(new, target)
    shutil.rmtree(aside, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where the
    system or the filesystem cannot."""
    import sys

    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0

