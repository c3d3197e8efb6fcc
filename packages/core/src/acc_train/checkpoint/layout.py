"""Where a run's checkpoints live: directory names, the ``latest`` pointer, and which
checkpoint a path or ``--resume`` names.

``latest`` is a hint, not the truth: when it is missing, unreadable or names a checkpoint that
is gone, the newest complete ``step-*`` directory (one whose manifest parses) is used instead,
and the caller is told why through ``warn``. Starting over beside complete checkpoints would
replace them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from acc_train.checkpoint.manifest import MANIFEST, read_manifest
from acc_train.errors import UserError

__all__ = [
    "complete_steps","LATEST", "STAGING_PREFIX", "step_dir_name", "latest_checkpoint", "find_checkpoint", "resolve_checkpoint"]

LATEST = "latest"
STAGING_PREFIX = ".staging-"

#: told why ``latest`` was not followed (printed once, by the command; workers pass None)
Warn = Callable[[str], None]


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _manifest_unreadable(path: Path) -> str | None:
    """Why ``path``'s manifest cannot be used (the manifest reader's own check, structure
    included), or None."""
    try:
        read_manifest(path)
    except UserError as exc:
        return exc.message.removeprefix(f"{MANIFEST} ")
    return None


def _pointer(ckpt_root: Path) -> tuple[Path | None, str | None]:
    """The checkpoint ``latest`` names, or (None, what is wrong with the pointer). A named
    checkpoint with a manifest is returned as it is: reading it checks the manifest."""
    pointer = ckpt_root / LATEST
    if not pointer.exists():
        return None, f"{pointer} is missing"
    if not pointer.is_file():
        return None, f"{pointer} is not a file"
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except OSError as exc:
        return None, f"{pointer} cannot be read ({exc.strerror or exc})"
    except UnicodeDecodeError:
        return None, f"{pointer} is not UTF-8 text"
    if not name:
        return None, f"{pointer} is empty"
    if Path(name).name != name or name in (".", ".."):
        return None, f"{pointer} names {name[:80]!r}, which is not a checkpoint directory of this run"
    if not (ckpt_root / name).is_dir():
        return None, f"{pointer} names {name!r}, which does not exist"
    if not (ckpt_root / name / MANIFEST).is_file():
        return None, f"{pointer} names {name!r}, which has no {MANIFEST} (a save that did not finish)"
    return ckpt_root / name, None


def complete_steps(ckpt_root: Path) -> list[tuple[int, Path]]:
    """The committed checkpoints (``step-NNNNNN`` with a manifest) as (step, path), in step
    order: by number, not by name (``step-1000000`` sorts after ``step-999999``); a directory
    whose name is not ``step-`` and ASCII digits (a user's ``step-000010.bak``) is not one."""
    steps = []
    for path in ckpt_root.glob("step-*"):
        digits = path.name.removeprefix("step-")
        if digits.isascii() and digits.isdigit() and (path / MANIFEST).is_file():
            steps.append((int(digits), path))
    return sorted(steps)


def _newest_complete(ckpt_root: Path, problem: str, where: str) -> Path | None:
    """The ``step-*`` directory of the highest step that has a manifest (a directory without
    one is a save that did not finish). One whose manifest does not parse is refused, never
    passed over: a run resumed from an older one would delete it as abandoned."""
    steps = complete_steps(ckpt_root)
    if not steps:
        return None
    newest = max(steps)[1]
    damage = _manifest_unreadable(newest)
    if damage is not None:
        raise UserError(
            f"{problem}, and the newest checkpoint's {MANIFEST} {damage}: {newest / MANIFEST}",
            where=where,
            hint=f"repair or move {newest} aside, or pass an earlier checkpoint's path (which abandons the later ones)",
        )
    return newest


def latest_checkpoint(ckpt_root: Path, where: str = "--resume") -> tuple[Path | None, str | None]:
    """The run's latest complete checkpoint: ``latest``'s, or the newest complete one when the
    pointer is missing, unreadable or dangling. Returns (checkpoint or None, a note saying why
    ``latest`` was not followed, or None when there is nothing to say)."""
    path, problem = _pointer(ckpt_root)
    if problem is None:
        return path, None
    fallback = _newest_complete(ckpt_root, problem, where)
    if fallback is not None:
        return fallback, f"{problem}; using the newest complete checkpoint, {fallback}"
    if not (ckpt_root / LATEST).exists():
        return None, None  # no checkpoint was ever committed: nothing to say
    return None, f"{problem}, and there is no complete checkpoint under {ckpt_root}"


def find_checkpoint(output_dir: Path, resume: str, warn: Warn | None = None) -> Path | None:
    """Resolve ``--resume``: ``latest`` (must exist), ``auto`` (latest or None), or a path
    (a checkpoint, or an output directory: its latest). ``warn`` is told when ``latest`` was
    not followed."""
    ckpt_root = output_dir / "checkpoints"
    if resume in ("latest", "auto"):
        path, note = latest_checkpoint(ckpt_root)
        if path is None and resume == "latest":
            raise UserError(
                f"--resume latest: {note or f'no complete checkpoint under {ckpt_root}'}",
                where="--resume",
                hint="start without --resume, or pass a checkpoint directory",
            )
        if note is not None and warn is not None:
            warn(note if path is not None else f"{note}: starting from step 0")
        return path
    path = Path(resume)
    if path.name.startswith(STAGING_PREFIX):
        raise UserError(
            f"{resume!r} is the staging directory of a save that did not finish",
            where="--resume",
            hint="resume from a committed checkpoint (checkpoints/step-NNNNNN, or `latest`)",
        )
    if path.is_dir() and (path / "checkpoints").is_dir() and not (path / MANIFEST).exists():  # an output dir
        return find_checkpoint(path, "latest", warn)
    if not path.is_dir():
        raise UserError(f"checkpoint {resume!r} does not exist", where="--resume", hint="pass a checkpoint directory, `latest` or `auto`")
    if not (path / MANIFEST).is_file():
        raise UserError(
            f"{resume!r} is not a complete checkpoint (no {MANIFEST})",
            where="--resume",
            hint="a save interrupted before its manifest is never resumed from; pick an earlier checkpoint",
        )
    return path


def resolve_checkpoint(path: str, warn: Warn | None = None) -> Path:
    """A checkpoint directory, or an output directory (its latest complete checkpoint)."""
    p = Path(path)
    if (p / "checkpoints").is_dir() and not (p / MANIFEST).exists():
        found, note = latest_checkpoint(p / "checkpoints", where="PATH")
        if found is None:
            raise UserError(
                note or f"no complete checkpoint under {p / 'checkpoints'}",
                where="PATH",
                hint="pass a checkpoint directory (checkpoints/step-NNNNNN)",
            )
        if note is not None and warn is not None:
            warn(note)
        return found
    if not p.exists():
        raise UserError(f"{path!r} does not exist", where="PATH", hint="pass a checkpoint directory or a run's output directory")
    return p
