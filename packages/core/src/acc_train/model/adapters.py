"""LoRA adapters through PEFT (``model.lora``): applied to the model, described in checkpoints,
saved as an adapter directory and merged into the base model.

The base model's weights are frozen and come from ``model.name_or_path`` on every launch;
checkpoints hold the adapters (and their optimizer state) alone, keyed by the PEFT model's
parameter names, which are the same under every strategy. A checkpoint's manifest says which
adapters it holds (:func:`adapter_manifest`), so a resume or an export finds its base model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.errors import UserError

if TYPE_CHECKING:
    from acc_train.contracts.protocols import JobConfigView

__all__ = ["peft_config", "apply_lora", "is_adapter_model", "adapter_manifest", "check_adapters_match", "save_adapter", "manifest_lora_config", "with_adapters"]

#: the keys of a LoRA description that change what a checkpoint's adapter tensors mean
MANIFEST_KEYS = ("r", "alpha", "target_modules", "modules_to_save")


def peft_config(config: JobConfigView) -> Any:
    """``model.lora`` as PEFT's ``LoraConfig`` (a causal-LM task, no bias terms trained)."""
    lora = config.model.lora
    assert lora is not None
    return manifest_lora_config(lora.model_dump(mode="json"))


def apply_lora(model: Any, config: JobConfigView) -> Any:
    """The model wrapped by PEFT with ``model.lora``'s adapters (only they train), or the model
    itself without ``model.lora``. Works on the meta device too (``acc-train plan`` and the
    checks before launch). Adapters are created in the base weights' dtype (``model.dtype``)."""
    if config.model.lora is None:
        return model
    try:
        return _peft_model(model, peft_config(config))
    except ValueError as exc:  # e.g. "Target modules {...} not found in the base model"
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ == "Linear"})
        raise UserError(
            f"cannot add LoRA adapters to {type(model).__name__}: {' '.join(str(exc).split())[:300]}",
            where="model.lora.target_modules",
            hint=f"name some of this model's linear layers ({', '.join(names[:12])}), or use all-linear",
        ) from None


def _peft_model(model: Any, lora: Any) -> Any:
    """``peft.get_peft_model``, adapters in the base weights' dtype, without the FutureWarning
    PEFT 0.21 triggers in transformers 5 (``is_gradient_checkpointing``), which is not the user's."""
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, lora, autocast_adapter_dtype=False)


def is_adapter_model(model: Any) -> bool:
    """Whether ``model`` (unwrapped) is a PEFT model."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def adapter_manifest(config: JobConfigView) -> dict[str, Any] | None:
    """What a checkpoint of this job says about its adapters: the LoRA settings and the base
    model they belong to (an absolute path for a local model); None for full fine-tuning."""
    lora = config.model.lora
    if lora is None:
        return None
    name = config.model.name_or_path
    base = str(Path(name).expanduser().resolve()) if name and Path(name).expanduser().exists() else name
    return {"type": "lora", "base_model": base, **lora.model_dump(mode="json")}


def check_adapters_match(written: dict[str, Any] | None, mine: dict[str, Any] | None, where: str) -> None:
    """Refuse a resume whose adapters differ from the checkpoint's: the tensors would not fit,
    or (full weights against adapters) the state would mean something else."""
    if written is None and mine is None:
        return
    if written is None or mine is None:
        has, wants = ("LoRA adapters", "full fine-tuning") if mine is None else ("the full model (full fine-tuning)", "LoRA adapters (model.lora)")
        raise UserError(
            f"the checkpoint holds {has}, and this run trains {wants}",
            where=where,
            hint="resume with the checkpoint's model.lora setting, or start a new output_dir",
        )
    changed = [k for k in MANIFEST_KEYS if written.get(k) != mine.get(k)]
    if changed:
        diff = ", ".join(f"{k}: {written.get(k)!r} -> {mine.get(k)!r}" for k in changed)
        raise UserError(f"the checkpoint's LoRA adapters differ from this run's ({diff})", where=where, hint="resume with the checkpoint's model.lora settings")


def save_adapter(model: Any, state_dict: dict[str, Any], directory: Path) -> None:
    """An adapter directory PEFT loads (``PeftModel.from_pretrained(base, directory)``):
    ``adapter_config.json`` and ``adapter_model.safetensors``, the adapters taken from the full
    ``state_dict`` (gathered by the strategy)."""
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)


def manifest_lora_config(manifest: dict[str, Any]) -> Any:
    """PEFT's ``LoraConfig`` from a checkpoint manifest's ``adapters`` (:func:`adapter_manifest`)."""
    from peft import LoraConfig, TaskType

    targets = manifest["target_modules"]
    return LoraConfig(
        r=manifest["r"],
        lora_alpha=manifest["alpha"],
        lora_dropout=manifest.get("dropout", 0.0),
        target_modules=targets if isinstance(targets, str) else list(targets),
        modules_to_save=list(manifest.get("modules_to_save") or []) or None,
        bias="none",
        task_type=TaskType.CAUSAL_LM,
    )


def with_adapters(base: Any, adapter_state: dict[str, Any], manifest: dict[str, Any], where: str, assign: bool = False) -> Any:
    """``base`` wrapped by PEFT with a checkpoint's adapters (``adapter_state``: its PEFT
    model's trainable tensors by name; ``assign`` for a base on the meta device)."""
    model = _peft_model(base, manifest_lora_config(manifest))
    missing, unexpected = model.load_state_dict(adapter_state, strict=False, assign=assign)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lost = sorted(trainable & set(missing))
    if lost or unexpected:
        raise UserError(
            f"the checkpoint's adapters do not fit its base model (missing {lost[:3]}, unexpected {list(unexpected)[:3]})",
            where=where,
            hint="export with the base model the adapters were trained on",
        )
    return model
