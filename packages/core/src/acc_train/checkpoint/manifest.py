"""A checkpoint's manifest: written last, it lists every file with its size and sha256, the
model's fingerprint and the library versions; nothing is loaded before the files match it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from acc_train.errors import UserError

__all__ = [
    "MANIFEST",
    "write_json",
    "sha256",
    "file_table",
    "verify_checkpoint",
    "model_fingerprint",
    "check_same_model",
    
]

MANIFEST = "manifest.json"


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON at ``path`` atomically (beside, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def sha256(path: Path) -> str:
    """The sha256 of a file's content, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_table(directory: Path) -> dict[str, dict[str, Any]]:
    """The manifest's ``files``: every file under ``directory`` by relative path, with its
    size and sha256."""
    return {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def verify_checkpoint(path: Path, hashes: bool = True) -> dict[str, Any]:
    """Read ``path``'s manifest and check every file against it (size, and sha256 where
    ``hashes``), and that no file was added. Returns the manifest; raises :class:`UserError`
    naming what is wrong. Nothing is loaded before this passes, so a planted or edited file is
    never read. (Workers other than each machine's first check sizes only: one full read of a
    large checkpoint per machine is enough.)"""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise UserError(f"{str(path)!r} is not a directory", where=str(path), hint="pass a checkpoint directory (checkpoints/step-NNNNNN)")
    if not manifest_path.is_file():
        hint = "a save interrupted before its manifest is never resumed from; pick an earlier checkpoint"
        if not any(path.glob("rng-rank*.json")) and not (path / "trainer_state.json").exists():
            hint = "pass a checkpoint directory (OUTPUT_DIR/checkpoints/step-NNNNNN) or an output directory"
        raise UserError(f"{str(path)!r} is not a complete checkpoint (no {MANIFEST})", where=str(path), hint=hint)
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{MANIFEST} is not a valid manifest ({exc})", where=str(manifest_path)) from None
    problems = []
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            problems.append(f"{name}: missing")
        elif f.stat().st_size != want["size"]:
            problems.append(f"{name}: {f.stat().st_size} bytes, the manifest says {want['size']}")
        elif hashes and sha256(f) != want["sha256"]:
            problems.append(f"{name}: content differs from the manifest (sha256)")
    extra = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST and str(p.relative_to(path)) not in files)
    problems += [f"{name}: not in the manifest" for name in extra]
    if problems:
        shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise UserError(
            "checkpoint files do not match its manifest:\n  " + "\n  ".join(shown),
            where=str(path),
            hint="the checkpoint was changed or damaged after it was written; resume from another one",
        )
    return manifest


def model_fingerprint(config: Any) -> dict[str, Any]:
    """What identifies a model's architecture in a manifest: its type and a hash of its
    transformers config (less the fields that name where it came from)."""
    data = json.loads(config.to_json_string(use_diff=False))
    for key in ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures"):
        data.pop(key, None)
    canonical = json.dumps(data, sort_keys=True)
    return {"model_type": data.get("model_type"), "config_sha256": hashlib.sha256(canonical.encode()).hexdigest()}


def check_same_model(manifest: dict[str, Any], fingerprint: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint whose manifest names another model than ``fingerprint``."""
    theirs = manifest.get("model")
    if isinstance(theirs, dict) and theirs != fingerprint:
        raise UserError(
            f"the checkpoint holds a different model ({theirs.get('model_type')}, config {str(theirs.get('config_sha256'))[:12]}) "
            f"than this run ({fingerprint.get('model_type')}, config {str(fingerprint.get('config_sha256'))[:12]})",
            where=f"--resume {path}",
            hint="resume with the model and model config that wrote the checkpoint (its run's config.yaml)",
        )
