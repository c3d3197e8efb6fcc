"""Where a run's checkpoints live: directory names, the ``latest`` pointer, and which
checkpoint a path or ``--resume`` names.

``latest`` is a hint, not the truth: when it is missing, unreadable or names a checkpoint that
is gone, the newest complete ``step-*`` directory (one whose manifest parses) is used instead,
and the caller is told why through ``warn``. Starting over beside complete checkpoints would
replace them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from acc_train.checkpoint.manifest import MANIFEST
from acc_train.errors import UserError

__all__ = ["LATEST", "STAGING_PREFIX", "step_dir_name", "latest_checkpoint", "find_checkpoint", "resolve_checkpoint"]

LATEST = "latest"
STAGING_PREFIX = ".staging-"

#: told why ``latest`` was not followed (printed once, by the command; workers pass None)
Warn = Callable[[str], None]


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _manifest_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None: it has a manifest that parses."""
    if not path.is_dir():
        return "which does not exist"
    if not (path / MANIFEST).is_file():
        return f"which has no {MANIFEST} (a save that did not finish)"
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return f"whose {MANIFEST} cannot be read as JSON"
    return None if isinstance(manifest, dict) else f"whose {MANIFEST} is not a JSON object"


def _pointer(ckpt_root: Path) -> tuple[Path | None, str | None]:
    """The checkpoint ``latest`` names if it is complete, else (None, what is wrong with it)."""
    pointer = ckpt_root / LATEST
    shown = f"{pointer}"
    if not pointer.exists():
        return None, f"{shown} is missing"
    if not pointer.is_file():
        return None, f"{shown} is not a file"
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except OSError as exc:
        return None, f"{shown} cannot be read ({exc.strerror or exc})"
    except UnicodeDecodeError:
        return None, f"{shown} is not UTF-8 text"
    if not name:
        return None, f"{shown} is empty"
    if Path(name).name != name or name in (".", ".."):
        return None, f"{shown} names {name[:80]!r}, which is not a checkpoint directory of this run"
    problem = _manifest_problem(ckpt_root / name)
    if problem is not None:
        return None, f"{shown} names {name!r}, {problem}"
    return ckpt_root / name, None


def _newest_complete(ckpt_root: Path) -> tuple[Path | None, list[str]]:
    """The complete ``step-*`` directory of the highest step, and the newer ones passed over."""
    steps = []
    for path in ckpt_root.glob("step-*"):
        digits = path.name.removeprefix("step-")
        if digits.isdigit() and path.is_dir():
            steps.append((int(digits), path))
    skipped = []
    for _, path in sorted(steps, reverse=True):
        problem = _manifest_problem(path)
        if problem is None:
            return path, skipped
        if (path / MANIFEST).is_file():  # an unfinished save (no manifest) is not worth a word
            skipped.append(f"{path.name} ({problem.removeprefix('which ').removeprefix('whose ')})")
    return None, skipped


def latest_checkpoint(ckpt_root: Path) -> tuple[Path | None, str | None]:
    """The run's latest complete checkpoint: ``latest``'s, or the newest complete one when the
    pointer is missing, unreadable or dangling. Returns (checkpoint or None, a note saying why
    ``latest`` was not followed, or None when there is nothing to say)."""
    path, problem = _pointer(ckpt_root)
    if problem is None:
        return path, None
    fallback, skipped = _newest_complete(ckpt_root)
    if fallback is None and not skipped and not (ckpt_root / LATEST).exists():
        return None, None  # no checkpoint was ever committed
    passed = f" (passed over: {', '.join(skipped)})" if skipped else ""
    if fallback is not None:
        return fallback, f"{problem}; using the newest complete checkpoint, {fallback}{passed}"
    return None, f"{problem}, and there is no complete checkpoint under {ckpt_root}{passed}"


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
        found, note = latest_checkpoint(p / "checkpoints")
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
