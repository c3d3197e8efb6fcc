"""``acc-train checkpoint export``: a checkpoint's model written as a ``save_pretrained``
directory (safetensors) that ``transformers`` loads, with a model card; the model loaded as
``generate`` and ``eval`` load theirs (:mod:`acc_train.evaluation.trained`). Nothing is written
until the checkpoint has been checked against its manifest, and ``OUT`` appears atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from acc_train.checkpoint.layout import resolve_checkpoint
from acc_train.checkpoint.manifest import verify_checkpoint
from acc_train.checkpoint_tools import Warn
from acc_train.errors import UserError
from acc_train.evaluation.trained import checkpoint_model
from acc_train.files.output_paths import check_new_directory, new_directory

__all__ = ["export_checkpoint"]


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
    from acc_train.outputs.model_card import checkpoint_summary, model_card

    config_file = ckpt.parent.parent / "config.yaml"
    try:
        job = load_resolved(config_file)
        return model_card(job.to_yaml(), job.config, checkpoint_summary(manifest), adapter)
    except Exception as exc:  # noqa: BLE001 - a copied checkpoint without its run, an old config: no card, said
        if warn is not None:
            warn(f"no model card written: the run's config ({config_file}) cannot be read ({type(exc).__name__})")
        return None
