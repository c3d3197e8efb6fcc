"""A checkpoint's manifest: written last, it lists every file with its size and sha256, the
model's fingerprint and the library versions; nothing is loaded before the files match it.

Its structure is checked where it is read (:func:`read_manifest`): a manifest of the wrong
shape is a UserError naming the file and the key. On resume each rank hashes its share of the
files (:func:`find_problems` with :func:`~acc_train.checkpoint.hashing.assign_files`); one
process alone (``checkpoint inspect``) hashes everything (:func:`verify_checkpoint`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from acc_train.checkpoint.hashing import MANIFEST, file_table, hash_files, list_files, sha256
from acc_train.errors import UserError

__all__ = [
    "MANIFEST",
    "write_json",
    "sha256",
    "hash_files",
    "file_table",
    "read_manifest",
    "find_problems",
    "raise_problems",
    "verify_checkpoint",
    "model_fingerprint",
    "check_same_model",
]


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON at ``path`` atomically (beside, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class _FileEntry(BaseModel):
    size: StrictInt = Field(ge=0)
    sha256: StrictStr = Field(pattern="^[0-9a-f]{64}$")


class _Manifest(BaseModel):
    """The keys acc-train reads from a manifest, by type; other keys are kept as they are."""

    model_config = ConfigDict(extra="allow")

    files: dict[StrictStr, _FileEntry]
    format: StrictStr | None = None
    portable: StrictStr | None = None
    step: StrictInt | None = Field(None, ge=0)
    epoch: StrictInt | None = Field(None, ge=0)
    samples_in_epoch: StrictInt | None = Field(None, ge=0)
    world_size: StrictInt | None = Field(None, ge=1)
    model: dict[StrictStr, Any] | None = None
    data: dict[StrictStr, Any] | None = None


def _bad_manifest(manifest_path: Path, what: str) -> UserError:
    return UserError(
        f"{MANIFEST} is not a valid manifest: {what}",
        where=str(manifest_path),
        hint="the manifest was changed or damaged after the checkpoint was written; resume from another checkpoint",
    )


def _validate(raw: Any, manifest_path: Path) -> dict[str, Any]:
    """``raw`` if it has a manifest's structure, else a UserError naming the first bad key."""
    if not isinstance(raw, dict):
        raise _bad_manifest(manifest_path, f"a JSON {type(raw).__name__}, not an object")
    try:
        _Manifest.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = "".join(f"[{part!r}]" for part in err["loc"])
        raise _bad_manifest(manifest_path, f"key {key}: {err['msg']}") from None
    for name in raw["files"]:
        if not name or name.startswith("/") or ".." in Path(name).parts:
            raise _bad_manifest(manifest_path, f"key ['files'][{name!r}]: not a relative path inside the checkpoint")
    return raw


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint ``path``, its structure checked (UserError naming the file
    and the bad key otherwise). Checks no file against it."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise UserError(f"{str(path)!r} is not a directory", where=str(path), hint="pass a checkpoint directory (checkpoints/step-NNNNNN)")
    if not manifest_path.is_file():
        hint = "a save interrupted before its manifest is never resumed from; pick an earlier checkpoint"
        if not any(path.glob("rng-rank*.json")) and not (path / "trainer_state.json").exists():
            hint = "pass a checkpoint directory (OUTPUT_DIR/checkpoints/step-NNNNNN) or an output directory"
        raise UserError(f"{str(path)!r} is not a complete checkpoint (no {MANIFEST})", where=str(path), hint=hint)
    try:
        raw = json.loads(manifest_path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _bad_manifest(manifest_path, f"not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise _bad_manifest(manifest_path, f"not JSON ({exc.msg}, line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise _bad_manifest(manifest_path, "JSON nested too deeply") from None
    except OSError as exc:
        raise UserError(f"{MANIFEST} cannot be read: {exc.strerror or exc}", where=str(manifest_path)) from None
    return _validate(raw, manifest_path)


def find_problems(path: Path, manifest: Mapping[str, Any], hashes: bool | Collection[str] = True) -> list[str]:
    """How checkpoint ``path``'s files differ from ``manifest``: a listed file missing or of
    another size, a file not listed, and (for every file, none, or the named ones, by
    ``hashes``) content of another sha256."""
    files: Mapping[str, Mapping[str, Any]] = manifest["files"]
    problems = []
    for name, want in files.items():
        f = path / name
        try:
            if not f.is_file():
                problems.append(f"{name}: missing")
            elif f.stat().st_size != want["size"]:
                problems.append(f"{name}: {f.stat().st_size} bytes, the manifest says {want['size']}")
            elif (hashes is True or (hashes is not False and name in hashes)) and sha256(f) != want["sha256"]:
                problems.append(f"{name}: content differs from the manifest (sha256)")
        except OSError as exc:
            problems.append(f"{name}: cannot be read ({exc.strerror or exc})")
    problems += [f"{name}: not in the manifest" for name in list_files(path) if name not in files]
    return problems


def raise_problems(path: Path, problems: list[str]) -> None:
    """Refuse checkpoint ``path`` if ``problems`` (from :func:`find_problems`) has any."""
    if problems:
        shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise UserError(
            "checkpoint files do not match its manifest:\n  " + "\n  ".join(shown),
            where=str(path),
            hint="the checkpoint was changed or damaged after it was written; resume from another one",
        )


def verify_checkpoint(path: Path, hashes: bool | Collection[str] = True) -> dict[str, Any]:
    """Read ``path``'s manifest and check every file against it (size, and sha256 of every
    file, none, or the named ones, by ``hashes``), and that no file was added. Returns the
    manifest; raises :class:`UserError` naming what is wrong. Nothing is loaded before this
    passes, so a planted or edited file is never read. (A resuming worker hashes only its
    share: :meth:`~acc_train.checkpoint.manager.CheckpointManager.check`.)"""
    manifest = read_manifest(path)
    raise_problems(path, find_problems(path, manifest, hashes))
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
