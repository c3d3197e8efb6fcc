"""``acc-train checkpoint inspect | convert``: checkpoints as things of their own.

Everything here runs in one process, without a process group: a checkpoint's state is read
whole through its format's :meth:`~acc_train.checkpoint.CheckpointFormat.read_full_state`
(by default the portable state, DCP safetensors shards keyed by parameter name). Convert
targets are the registered formats that say ``convert_target``. Nothing is written until the
input has been checked against its manifest, and outputs appear atomically: written into a
freshly made sibling directory (never a fixed name, which may be the user's), renamed into
place, removed on failure (:func:`acc_train.files.output_paths.new_directory`). ``OUT`` is refused
before any work if it exists or cannot be created. ``export`` lives with the loading of trained
models it shares with ``generate`` and ``eval`` (:mod:`acc_train.evaluation.export`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from acc_train.checkpoint.format import CheckpointFormat, read_portable_state_or_refuse
from acc_train.checkpoint.layout import resolve_checkpoint
from acc_train.checkpoint.manifest import (
    MANIFEST,
    file_table,
    verify_checkpoint,
    write_json,
)
from acc_train.checkpoint.portable import (
    PORTABLE_DIR,
    write_portable_full,
)
from acc_train.errors import UserError
from acc_train.files.output_paths import check_new_directory, new_directory

__all__ = [
    "resolve_checkpoint",
    "inspect_checkpoint",
    "registered_formats",
    "convert_targets",
    "read_full_state",
    "convert_checkpoint",
    "Warn",
]


#: told when an output directory's ``latest`` pointer was not followed (see ``resolve_checkpoint``)
Warn = Callable[[str], None]


def inspect_checkpoint(path: str, warn: Warn | None = None) -> dict[str, Any]:
    """What the manifest says, and whether the files match it (raises UserError if not)."""
    ckpt = resolve_checkpoint(path, warn)
    manifest = verify_checkpoint(ckpt)
    files = manifest["files"]
    return {
        "path": str(ckpt),
        "format": manifest.get("format"),
        "portable": manifest.get("portable"),
        "strategy": manifest.get("strategy"),
        "strategy_options": manifest.get("strategy_options"),
        "world_size": manifest.get("world_size"),
        "step": manifest.get("step"),
        "epoch": manifest.get("epoch"),
        "samples_in_epoch": manifest.get("samples_in_epoch"),
        "model": manifest.get("model"),
        "model_class": manifest.get("model_class"),
        "data": manifest.get("data"),
        "versions": manifest.get("versions"),
        "files": len(files),
        "bytes": sum(f["size"] for f in files.values()),
        "verified": True,
    }


def registered_formats() -> dict[str, CheckpointFormat]:
    """Every installed checkpoint format, by name: the plugin registry's (this module's one
    reach above the checkpoint package, made when a command runs)."""
    from acc_train.plugins import checkpoint_formats

    return {fmt.name: fmt for fmt, _ in checkpoint_formats().primary()}


def convert_targets() -> list[str]:
    """The registered checkpoint formats ``convert`` writes: each resumes from the portable
    state alone, under any world size (``CheckpointFormat.convert_target``)."""
    return [name for name, fmt in registered_formats().items() if fmt.convert_target]


def read_full_state(ckpt: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """A verified checkpoint's whole state, keyed as the portable state is, read by the format
    its manifest names (the portable state itself where that format is not installed)."""
    name = manifest.get("format")
    fmt = registered_formats().get(name) if isinstance(name, str) else None
    if fmt is not None:
        return fmt.read_full_state(ckpt, manifest)
    return read_portable_state_or_refuse(ckpt, manifest)


def convert_checkpoint(path: str, to: str, out: str, world_size: int | None = None, warn: Warn | None = None) -> Path:
    """Write ``path`` as a checkpoint in format ``to`` at ``out``: the portable state (resharded
    by DCP when it is loaded, so valid for any world size), trainer state and RNG states."""
    targets = convert_targets()
    if to not in targets:
        raise UserError(f"cannot convert to {to!r}", where="--to", hint=f"choose one of: {', '.join(targets)}")
    if world_size is not None and world_size < 1:
        raise UserError(f"--world-size must be at least 1 (got {world_size})", where="--world-size")
    check_new_directory(out, "OUT")
    ckpt = resolve_checkpoint(path, warn)
    manifest = verify_checkpoint(ckpt)
    flat = read_full_state(ckpt, manifest)
    with new_directory(out, "OUT") as staging:
        write_portable_full(staging, flat)
        writer_world = int(manifest.get("world_size") or 1)
        new_world = world_size or writer_world
        for name in manifest["files"]:
            if name == "trainer_state.json" or name == "model_config.json":
                shutil.copy2(ckpt / name, staging / name)
            elif name.startswith("rng-rank") and int(name[8:13]) < new_world:
                shutil.copy2(ckpt / name, staging / name)
        converted = {
            **{k: v for k, v in manifest.items() if k != "files"},
            "format": to,
            "portable": PORTABLE_DIR,
            "world_size": new_world,
            "converted_from": {"path": str(ckpt), "format": manifest.get("format"), "world_size": writer_world},
            "files": file_table(staging),
        }
        write_json(staging / MANIFEST, converted)
    return Path(out)
