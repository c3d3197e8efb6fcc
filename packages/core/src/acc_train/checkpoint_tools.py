"""``acc-train checkpoint inspect | convert | export``: checkpoints as things of their own.

Everything here runs in one process, without a process group: a checkpoint's state is read
whole through its format's :meth:`~acc_train.checkpoint.CheckpointFormat.read_full_state`
(by default the portable state, DCP safetensors shards keyed by parameter name). Convert
targets are the registered formats that say ``convert_target``. Nothing is written until the
input has been checked against its manifest, and outputs appear atomically: written into a
freshly made sibling directory (never a fixed name, which may be the user's), renamed into
place, removed on failure (:func:`acc_train.output_paths.new_directory`). ``OUT`` is refused
before any work if it exists or cannot be created. The model ``export`` writes is loaded as
``generate`` and ``eval`` load theirs (:mod:`acc_train.evaluation.trained`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from acc_train.checkpoint.format import CheckpointFormat
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
from acc_train.evaluation.trained import checkpoint_model, read_full_state
from acc_train.output_paths import check_new_directory, new_directory

__all__ = [
    "resolve_checkpoint",
    "inspect_checkpoint",
    "registered_formats",
    "convert_targets",
    "read_full_state",
    "convert_checkpoint",
    "export_checkpoint",
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


def export_checkpoint(path: str, to: str, out: str, warn: Warn | None = None, merge: bool = False) -> tuple[Path, bool]:
    """Write the checkpoint's model as a ``save_pretrained`` directory (safetensors) that
    ``transformers`` loads: (where, whether it is an adapter directory). A LoRA checkpoint is
    exported as its adapter directory, or with ``merge`` as its base model with the adapters
    merged in (the base read from where the manifest says it was trained)."""
    if to != "hf":
        raise UserError(f"cannot export to {to!r}", where="--to", hint="choose: hf")
    check_new_directory(out, "OUT")
    ckpt = resolve_checkpoint(path, warn)
    manifest = verify_checkpoint(ckpt)
    model, adapters = checkpoint_model(ckpt, manifest, merge)  # (on the meta device: only saved)
    with new_directory(out, "OUT") as staging:
        model.save_pretrained(staging, safe_serialization=True)
        card = _checkpoint_card(ckpt, manifest, adapter=bool(adapters) and not merge, warn=warn)
        if card is not None:
            (Path(staging) / "README.md").write_text(card)
    return Path(out), bool(adapters) and not merge


def _checkpoint_card(ckpt: Path, manifest: dict[str, Any], adapter: bool, warn: Warn | None) -> str | None:
    """The model card of an exported checkpoint, from its run's ``config.yaml`` (beside its
    ``checkpoints/``) and its manifest; None (said through ``warn``) when that config is not
    there or cannot be read: the export goes on without a card."""
    from acc_train.config import load_resolved
    from acc_train.model_card import checkpoint_summary, model_card

    config_file = ckpt.parent.parent / "config.yaml"
    try:
        job = load_resolved(config_file)
        return model_card(job.to_yaml(), job.config, checkpoint_summary(manifest), adapter)
    except Exception as exc:  # noqa: BLE001 - a copied checkpoint without its run, an old config: no card, said
        if warn is not None:
            warn(f"no model card written: the run's config ({config_file}) cannot be read ({type(exc).__name__})")
        return None
