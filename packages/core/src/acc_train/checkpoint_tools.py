"""``acc-train checkpoint inspect | convert | export``: checkpoints as things of their own.

Everything here runs in one process, without a process group: a checkpoint's state is read
whole through its format's :meth:`~acc_train.checkpoint.CheckpointFormat.read_full_state`
(by default the portable state, DCP safetensors shards keyed by parameter name). Convert
targets are the registered formats that say ``convert_target``. Nothing is written until the
input has been checked against its manifest, and outputs appear atomically: written into a
freshly made sibling directory (never a fixed name, which may be the user's), renamed into
place, removed on failure (:func:`acc_train.files.output_paths.new_directory`). ``OUT`` is refused
before any work if it exists or cannot be created.
"""

from __future__ import annotations

import json
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
    "export_model",
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
    model, adapters = _checkpoint_model(ckpt, manifest, merge)
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
    from acc_train.outputs.model_card import checkpoint_summary, model_card

    config_file = ckpt.parent.parent / "config.yaml"
    try:
        job = load_resolved(config_file)
        return model_card(job.to_yaml(), job.config, checkpoint_summary(manifest), adapter)
    except Exception as exc:  # noqa: BLE001 - a copied checkpoint without its run, an old config: no card, said
        if warn is not None:
            warn(f"no model card written: the run's config ({config_file}) cannot be read ({type(exc).__name__})")
        return None


def _checkpoint_model(ckpt: Path, manifest: dict[str, Any], merge: bool, device: str = "meta") -> tuple[Any, dict[str, Any] | None]:
    """(the checkpoint's model from its portable state, its manifest's adapters section)."""
    adapters = manifest.get("adapters")
    if merge and not adapters:
        raise UserError("--merge merges LoRA adapters, and this checkpoint holds the full model", where="--merge", hint="export it without --merge")
    if not (ckpt / "model_config.json").is_file():
        raise UserError("the checkpoint has no model_config.json", where=str(ckpt), hint="export the run's final/ directory instead")
    flat = read_full_state(ckpt, manifest)
    weights = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if adapters:
        return _adapter_model(ckpt, weights, adapters, merge), adapters
    return _model_from_weights(ckpt, weights, device), None


def export_model(ckpt: Path) -> Any:
    """A checkpoint's model in memory, whatever strategy and world size wrote it: the full
    model, or for a LoRA checkpoint its base (read from where the manifest says it was
    trained) with the adapters merged into its weights."""
    manifest = verify_checkpoint(ckpt)
    model, _ = _checkpoint_model(ckpt, manifest, merge=bool(manifest.get("adapters")), device="cpu")
    return model


def _meta_model(ckpt: Path, device: str = "meta") -> Any:
    """The checkpoint's model (``model_config.json``) on the meta device (or ``device``: built
    there, its non-persistent buffers, such as rotary frequencies, computed as it is built)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((ckpt / "model_config.json").read_text())
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def _model_from_weights(ckpt: Path, weights: dict[str, Any], device: str = "meta") -> Any:
    """The checkpoint's model holding its full weights (built on ``device``: ``meta`` to be
    saved, where buffers the state does not hold are not needed; ``cpu`` to be run)."""
    model = _meta_model(ckpt, device)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [m for m in missing if m not in tied]
    if missing or unexpected:
        raise UserError(
            f"the checkpoint's weights do not fit its model config (missing {missing[:3]}, unexpected {unexpected[:3]})",
            where=str(ckpt),
        )
    if tied:
        model.tie_weights()
    return model


def _adapter_model(ckpt: Path, weights: dict[str, Any], adapters: dict[str, Any], merge: bool) -> Any:
    """A LoRA checkpoint's PEFT model (its base on the meta device: only the adapters are
    written), or with ``merge`` its base model, loaded from ``adapters["base_model"]`` in the
    dtype it is stored in, with the adapters merged into its weights."""
    from acc_train.model.adapters import with_adapters

    base_name = adapters.get("base_model")
    if not merge:
        base = _meta_model(ckpt)
        base.config._name_or_path = base_name or ""  # adapter_config.json's base_model_name_or_path
        return with_adapters(base, weights, adapters, str(ckpt), assign=True)
    if not base_name:
        raise UserError("the checkpoint does not name the base model its adapters belong to", where=str(ckpt), hint="export without --merge")
    from transformers import AutoModelForCausalLM

    try:
        base = AutoModelForCausalLM.from_pretrained(base_name, dtype="auto")
    except OSError as exc:
        raise UserError(
            f"cannot load the base model {base_name!r} the adapters were trained on: {str(exc).splitlines()[0]}",
            where=str(ckpt / MANIFEST),
            hint="make the base model available at that path (or hub id), or export without --merge",
        ) from None
    return with_adapters(base, weights, adapters, base_name).merge_and_unload()
