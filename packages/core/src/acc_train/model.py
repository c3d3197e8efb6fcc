"""The model and tokenizer of a job: the demo Llama built from a config, or ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.errors import UserError

if TYPE_CHECKING:
    from acc_train.config import JobConfig, ModelConfig

__all__ = ["DEMO_MODEL_CONFIG", "build_model", "load_tokenizer", "check_model_path"]

#: The demo model: a small Llama over the 256 byte values; ``model.config`` overrides these.
DEMO_MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists()


def check_model_path(cfg: ModelConfig) -> None:
    """Fail before launch on a local model or tokenizer path that cannot load (no torch needed)."""
    for key in ("name_or_path", "tokenizer"):
        name = getattr(cfg, key)
        if not name or not _looks_local(name):
            continue
        path = Path(name).expanduser()
        if not path.is_dir():
            raise UserError(f"{name!r} is not a directory", where=f"model.{key}", hint="give a save_pretrained directory or a hub id")
        if key == "name_or_path" and not (path / "config.json").is_file():
            raise UserError(
                f"{name!r} has no config.json, so it is not a transformers model directory",
                where="model.name_or_path",
                hint="point at a directory written by save_pretrained",
            )
        tokenizer_here = key == "tokenizer" or not cfg.tokenizer
        if tokenizer_here and not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise UserError(
                f"{name!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})",
                where=f"model.{key}",
                hint="set model.tokenizer to a directory with the tokenizer saved by save_pretrained",
            )


def model_config(config: JobConfig) -> Any:
    """The job's model config (a transformers ``PretrainedConfig``), without building the model."""
    import transformers

    mcfg = config.model
    if mcfg.name_or_path is None:
        try:
            llama = transformers.LlamaConfig(**{**DEMO_MODEL_CONFIG, **mcfg.config})
        except (TypeError, ValueError) as exc:
            raise UserError(f"invalid demo model config: {exc}", where="model.config") from None
        if llama.vocab_size < 256 and not config.model.tokenizer:
            raise UserError("the demo model reads bytes: vocab_size must be at least 256", where="model.config.vocab_size")
        return llama
    return _from_pretrained(transformers.AutoConfig, mcfg, "the config of model")


def _from_pretrained(loader: Any, mcfg: Any, what: str) -> Any:
    """``loader.from_pretrained(model.name_or_path)``, a missing or unreadable model as a UserError."""
    try:
        return loader.from_pretrained(mcfg.name_or_path, trust_remote_code=mcfg.trust_remote_code)
    except OSError as exc:
        raise UserError(
            f"cannot load {what} {mcfg.name_or_path!r}: {exc}".splitlines()[0],
            where="model.name_or_path",
            hint="use a local save_pretrained directory, or a hub id with network access",
        ) from None


def build_model(config: JobConfig) -> Any:
    import transformers

    mcfg = config.model
    if mcfg.name_or_path is None:
        return transformers.LlamaForCausalLM(model_config(config))
    return _from_pretrained(transformers.AutoModelForCausalLM, mcfg, "model")


def load_tokenizer(mcfg: ModelConfig) -> Any | None:
    """The job's tokenizer, or None for byte-level text (the demo model)."""
    name = mcfg.tokenizer or mcfg.name_or_path
    if name is None:
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(name, trust_remote_code=mcfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load tokenizer {name!r}: {exc}".splitlines()[0],
            where="model.tokenizer" if mcfg.tokenizer else "model.name_or_path",
            hint="set model.tokenizer to a directory holding one",
        ) from None
