"""Loading what a run trained, the one way ``acc-train generate``, ``acc-train eval`` and
``acc-train checkpoint export`` do: from a run's output directory (its ``final/``, else its latest
checkpoint), from any checkpoint whatever strategy and world size wrote it (its portable state;
a LoRA checkpoint's adapters on their base, or merged into it), or from a ``save_pretrained``
directory (a full model, or adapters on the base their config names), with the tokenizer the run
trained with (None: the demo model's bytes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from acc_train.checkpoint.layout import resolve_checkpoint
from acc_train.checkpoint.manifest import MANIFEST, verify_checkpoint
from acc_train.checkpoint_tools import read_full_state
from acc_train.errors import UserError

__all__ = ["TrainedModel", "load_trained_model", "checkpoint_model"]


class TrainedModel(NamedTuple):
    """A trained model in memory, its tokenizer (None: bytes), and what was read."""

    model: Any
    tokenizer: Any | None
    source: str


def load_trained_model(path: str, where: str = "RUN_OR_CHECKPOINT") -> TrainedModel:
    """The model at ``path`` (a run's output directory, a checkpoint, or a model directory), on
    the CPU, with its tokenizer; a LoRA checkpoint's adapters merged into their base. A model
    that cannot be read, or one without the tokenizer its vocabulary needs, is a UserError at
    ``where``."""
    p = Path(path).expanduser()
    try:
        if (p / "final").is_dir() and _is_model_dir(p / "final"):
            model, tokenizer = _from_directory(p / "final")
            source = str(p / "final")
        elif _is_model_dir(p):
            model, tokenizer = _from_directory(p)
            source = str(p)
        else:
            ckpt = resolve_checkpoint(path)
            manifest = verify_checkpoint(ckpt)
            model, _ = checkpoint_model(ckpt, manifest, merge=bool(manifest.get("adapters")), device="cpu")
            tokenizer, source = _run_tokenizer(ckpt.parent.parent), str(ckpt)
    except OSError as exc:  # a model or base model that cannot be read
        raise UserError(f"cannot load the model from {path!r}: {exc}".splitlines()[0], where=where) from None
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0) or 0
    if tokenizer is None and vocab > 256:  # bytes are the demo model's text, not this model's
        raise UserError(
            f"found no tokenizer for {source} (vocabulary of {vocab}): neither in the directory nor in its run's config.yaml",
            where=where,
            hint="pass the run's output directory or its final/ (which hold the tokenizer), or save the tokenizer beside the model",
        )
    return TrainedModel(model, tokenizer, source)


def checkpoint_model(ckpt: Path, manifest: dict[str, Any], merge: bool, device: str = "meta") -> tuple[Any, dict[str, Any] | None]:
    """(the checkpoint's model from its portable state, its manifest's adapters section). Built
    on ``device``: ``meta`` to be saved (buffers the state does not hold are not needed), ``cpu``
    to be run. A LoRA checkpoint is its PEFT model (its base on the meta device), or with
    ``merge`` its base model with the adapters merged in."""
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


def _is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file() or (p / "adapter_config.json").is_file()


def _run_tokenizer(run_dir: Path) -> Any | None:
    """The tokenizer of the run whose ``config.yaml`` is in ``run_dir`` (None: byte level)."""
    from acc_train.config import load_resolved
    from acc_train.model.build import load_tokenizer

    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    return load_tokenizer(load_resolved(config).config.model)


def _from_directory(p: Path) -> tuple[Any, Any | None]:
    """A ``save_pretrained`` directory: a full model, or adapters on the base their config names."""
    import transformers

    if (p / "adapter_config.json").is_file():
        from peft import PeftModel

        base_name = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base_name:
            raise UserError(f"{p} holds LoRA adapters but does not name their base model", where="PATH", hint="export the merged model (checkpoint export --merge) and pass that")
        model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_name), p)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(p)
    has_tokenizer = (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(p) if has_tokenizer else _run_tokenizer(p.parent)
    return model, tokenizer


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
