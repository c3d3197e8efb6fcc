"""Where a run's checkpoints live: directory names, the ``latest`` pointer, and which
checkpoint a path or ``--resume`` names."""

from __future__ import annotations

from pathlib import Path

from acc_train.checkpoint.manifest import MANIFEST
from acc_train.errors import UserError

__all__ = ["LATEST", "STAGING_PREFIX", "step_dir_name", "find_checkpoint", "resolve_checkpoint"]

LATEST = "latest"
STAGING_PREFIX = ".staging-"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def find_checkpoint(output_dir: Path, resume: str) -> Path | None:
    """Resolve ``--resume``: ``latest`` (must exist), ``auto`` (latest or None), or a path."""
    ckpt_root = output_dir / "checkpoints"
    if resume in ("latest", "auto"):
        pointer = ckpt_root / LATEST
        if pointer.is_file():
            path = ckpt_root / pointer.read_text().strip()
            if (path / MANIFEST).is_file():
                return path
        if resume == "auto":
            return None
        raise UserError(
            f"--resume latest: no complete checkpoint under {ckpt_root}",
            where="--resume",
            hint="start without --resume, or pass a checkpoint directory",
        )
    path = Path(resume)
    if path.name.startswith(STAGING_PREFIX):
        raise UserError(
            f"{resume!r} is the staging directory of a save that did not finish",
            where="--resume",
            hint="resume from a committed checkpoint (checkpoints/step-NNNNNN, or `latest`)",
        )
    if path.is_dir() and (path / "checkpoints" / LATEST).is_file():  # an output dir
        return find_checkpoint(path, "latest")
    if not path.is_dir():
        raise UserError(f"checkpoint {resume!r} does not exist", where="--resume", hint="pass a checkpoint directory, `latest` or `auto`")
    if not (path / MANIFEST).is_file():
        raise UserError(
            f"{resume!r} is not a complete checkpoint (no {MANIFEST})",
            where="--resume",
            hint="a save interrupted before its manifest is never resumed from; pick an earlier checkpoint",
        )
    return path


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint directory, or an output directory (its latest complete checkpoint)."""
    p = Path(path)
    pointer = p / "checkpoints" / LATEST
    if pointer.is_file():
        return p / "checkpoints" / pointer.read_text().strip()
    if not p.exists():
        raise UserError(f"{path!r} does not exist", where="PATH", hint="pass a checkpoint directory or a run's output directory")
    return p
