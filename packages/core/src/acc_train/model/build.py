"""The model and tokenizer of a job: the demo Llama built from a config, or ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.model.adapters import apply_lora
from acc_train.errors import UserError

if TYPE_CHECKING:
    from acc_train.contracts.protocols import JobConfigView, Section

__all__ = ["DEMO_MODEL_CONFIG", "TRAINING_DTYPES", "training_dtype", "build_model", "load_tokenizer", "check_model_path", "check_model_builds",
           "meta_model", "model_config", "final_dtype", "config_source", "check_attn_implementation", "FLASH_ATTENTION_PACKAGES", "enable_gradient_checkpointing"]

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


def check_model_path(cfg: Section) -> None:
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


#: more layers than any model trained anywhere: building them (even on the meta device) would hang
MAX_LAYERS = 10_000
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def config_source(config: JobConfigView) -> tuple[str, str]:
    """(what the model's config is, the key that names it): ``DIR/config.json`` and
    ``model.name_or_path``, or ``the demo model config`` and ``model.config``."""
    name = config.model.name_or_path
    if name is None:
        return "the demo model config", "model.config"
    path = Path(name).expanduser()
    return (str(path / "config.json") if path.is_dir() else name), "model.name_or_path"


def _refuse_config(config: JobConfigView, exc: BaseException, doing: str = "", hint: str | None = None) -> UserError:
    """A transformers error about the user's model config, as a UserError naming the file."""
    what, where = config_source(config)
    detail = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())[:400] or type(exc).__name__
    return UserError(
        f"{what}: {doing}{detail}",
        where=where,
        hint=hint or "fix the config (written by save_pretrained), or point model.name_or_path at another model",
    )


def model_config(config: JobConfigView) -> Any:
    """The job's model config (a transformers ``PretrainedConfig``), without building the model;
    a config transformers rejects, or one too large to build, is a UserError naming its file."""
    import transformers

    mcfg = config.model
    if mcfg.name_or_path is None:
        try:
            llama = transformers.LlamaConfig(**{**DEMO_MODEL_CONFIG, **mcfg.config})
        except Exception as exc:  # noqa: BLE001 - what transformers' config validation raises (huggingface_hub's StrictDataclass errors too)
            raise UserError(f"invalid demo model config: {' '.join(str(exc).split())}", where="model.config") from None
        if llama.vocab_size < 256 and not config.model.tokenizer:
            raise UserError("the demo model reads bytes: vocab_size must be at least 256", where="model.config.vocab_size")
        loaded = llama
    else:
        try:
            loaded = _from_pretrained(transformers.AutoConfig, mcfg, "the config of model")
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - anything transformers says about the user's config.json
            raise _refuse_config(config, exc) from None
    for key in LAYER_KEYS:
        layers = getattr(loaded, key, None)
        if isinstance(layers, int) and not 0 <= layers <= MAX_LAYERS:
            raise UserError(
                f"{config_source(config)[0]}: {key}={layers} is not a model that can be built (0 to {MAX_LAYERS:,} layers)",
                where=config_source(config)[1],
                hint="check the number in the config",
            )
    return loaded


def _from_pretrained(loader: Any, mcfg: Any, what: str, **kwargs: Any) -> Any:
    """``loader.from_pretrained(model.name_or_path)``, a missing or unreadable model as a UserError."""
    try:
        return loader.from_pretrained(mcfg.name_or_path, trust_remote_code=mcfg.trust_remote_code, **kwargs)
    except OSError as exc:
        raise UserError(
            f"cannot load {what} {mcfg.name_or_path!r}: {exc}".splitlines()[0],
            where="model.name_or_path",
            hint="use a local save_pretrained directory, or a hub id with network access",
        ) from None


#: what building a model from a config transformers accepted can still raise for a bad config
#: (sizes that do not divide, negative or absurd dimensions, memory that cannot be allocated)
BUILD_ERRORS = (ValueError, TypeError, KeyError, RuntimeError, ZeroDivisionError, OverflowError, MemoryError)


def meta_model(config: JobConfigView) -> tuple[Any, Any]:
    """(the job's model built on the meta device, with ``model.lora``'s adapters, its config):
    nothing is allocated, so this checks any config before launch; what transformers cannot
    build is a UserError."""
    import torch
    import transformers

    mcfg = model_config(config)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(mcfg, trust_remote_code=config.model.trust_remote_code)
    except BUILD_ERRORS as exc:
        raise _refuse_config(config, exc, "cannot build a causal LM from it: ", "acc-train trains AutoModelForCausalLM models; fix the config") from None
    return apply_lora(model, config), mcfg


#: layer types that take a packed row's example boundaries (a mask, or flash's varlen keywords), or
#: mix no tokens at all (a hybrid's feed-forward-only layers)
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe"}

#: transformers models whose sequence mixing is (partly) recurrent: a state-space, linear-attention or
#: recurrent layer carries its state from one example of a packed row into the next, whatever the mask
RECURRENT_MODEL_TYPES = {
    "mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "xlstm", "jamba", "zamba", "zamba2", "bamba",
    "falcon_h1", "granitemoehybrid", "lfm2", "lfm2_moe", "nemotron_h", "plamo2", "qwen3_next", "minimax", "kimi_linear",
}  # fmt: skip


def recurrent_layers(model_config: Any) -> str | None:
    """What in the model carries state across a packed row's example boundaries (a
    description), or None: every sequence-mixing layer is attention."""
    layer_types = [str(t) for t in (getattr(model_config, "layer_types", None) or [])]
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if other:
        return f"its {', '.join(other)} layers"
    blocks = {str(t) for t in (getattr(model_config, "layers_block_type", None) or [])} - ATTENTION_LAYER_TYPES
    if blocks:
        return f"its {', '.join(sorted(blocks))} layers"
    model_type = getattr(model_config, "model_type", None)
    if model_type in RECURRENT_MODEL_TYPES:
        return f"its recurrent (state-space or linear-attention) layers ({model_type})"
    return None


def check_packing_boundaries(model_config: Any, packs: bool) -> None:
    """Packed rows (``packs``) keep examples apart only through attention: refuse packing for a
    model whose recurrent or linear-attention layers would carry one example's state into the next."""
    if not packs:
        return
    carries = recurrent_layers(model_config)
    if carries is None:
        return
    raise UserError(
        f"data.packing puts several examples in one row, kept apart by the attention mask, but "
        f"{getattr(model_config, 'model_type', 'this model')} cannot honour those boundaries: {carries} take no mask "
        "and carry their state from one example into the next",
        where="data.packing",
        hint="set data.packing=false (one example per row, padded per batch)",
    )


def check_model_builds(config: JobConfigView, strategy: Any = None, packs: bool | None = None) -> Any | None:
    """Fail before launch on a model config transformers rejects or cannot build, one the
    ``strategy`` cannot split, one whose layers cannot keep packed examples apart when the rows
    are packed (``packs``: ``acc_train.api.packs_rows``), or a tokenizer it cannot load; the
    tokenizer (None: byte level), for the data's checks."""
    model, mcfg = meta_model(config)
    _check_model_takes_attn(model, config.model)
    if packs is not None:
        check_packing_boundaries(mcfg, packs)
    if strategy is not None:
        strategy.check_model(model)
    return load_tokenizer(config.model)


#: ``model.dtype`` -> the torch dtype the model's parameters are held (and stepped) in
TRAINING_DTYPES = {"auto": "float32", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def training_dtype(mcfg: Section) -> Any:
    """The torch dtype ``model.dtype`` holds the parameters in: fp32 unless pure low-precision
    training is asked for, whatever dtype the checkpoint is stored in (transformers 5 would load
    a bf16 hub checkpoint as bf16, and train it with no fp32 master copy)."""
    import torch

    return getattr(torch, TRAINING_DTYPES[mcfg.dtype])


def final_dtype(config: JobConfigView) -> Any:
    """The torch dtype ``final/`` is written in: under ``model.dtype: auto`` the dtype the
    pretrained checkpoint is stored in (its config.json, what transformers loads it as: a bf16
    hub model fine-tuned with fp32 masters is written back in bf16, as HF Trainer and axolotl
    leave it), fp32 for the demo model; otherwise the dtype ``model.dtype`` holds."""
    import torch

    if config.model.dtype != "auto" or config.model.name_or_path is None:
        return training_dtype(config.model)
    stored = getattr(model_config(config), "dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if stored in (torch.bfloat16, torch.float16) else torch.float32


def build_model(config: JobConfigView) -> Any:
    """The job's model, its parameters in :func:`training_dtype`."""
    import transformers

    mcfg = model_config(config)
    dtype = training_dtype(config.model)
    if config.model.attn_implementation:  # what from_config and from_pretrained(config=...) build with
        mcfg._attn_implementation = config.model.attn_implementation
    try:
        if config.model.name_or_path is None:
            return transformers.LlamaForCausalLM(mcfg).to(dtype)
        return _from_pretrained(transformers.AutoModelForCausalLM, config.model, "model", config=mcfg, dtype=dtype)
    except BUILD_ERRORS as exc:
        raise _refuse_config(config, exc, "cannot build the model: ", "check the config against the weights saved with it; `acc-train plan` shows the memory a model needs per rank") from None


def load_tokenizer(mcfg: Section) -> Any | None:
    """The job's tokenizer, or None for byte-level text (the demo model)."""
    name = mcfg.tokenizer or mcfg.name_or_path
    if name is None:
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(name, trust_remote_code=mcfg.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - its files are the user's (a tokenizer.json of the wrong shape is a KeyError)
        detail = f"{type(exc).__name__} {exc}" if isinstance(exc, LookupError) else str(exc)
        files = ", ".join(f for f in TOKENIZER_FILES if (Path(name).expanduser() / f).is_file())
        raise UserError(
            f"cannot load tokenizer {name!r}{f' ({files})' if files else ''}: {detail}".splitlines()[0],
            where="model.tokenizer" if mcfg.tokenizer else "model.name_or_path",
            hint="set model.tokenizer to a directory holding one",
        ) from None


# --- memory savers: model.attn_implementation, training.gradient_checkpointing ---

#: attention kernels with a package of their own: name -> (module, what to pip install)
FLASH_ATTENTION_PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn")}


def check_attn_implementation(mcfg: Section, device_type: str) -> None:
    """Refuse a flash-attention kernel on a machine without a CUDA GPU, or without its package
    (no torch needed: called before launch, and by each worker)."""
    import importlib.util

    name = mcfg.attn_implementation
    if not name or not name.startswith("flash_attention"):
        return
    if device_type != "cuda":
        raise UserError(
            f"{name} runs on CUDA GPUs only, and this machine runs on {device_type} (no CUDA GPU)",
            where="model.attn_implementation",
            hint="use sdpa (the default) or eager here; keep flash_attention_2 for a GPU machine",
        )
    module, package = FLASH_ATTENTION_PACKAGES.get(name, (None, None))
    if module and importlib.util.find_spec(module) is None:
        raise UserError(
            f"{name} needs the {package} package, which is not installed",
            where="model.attn_implementation",
            hint=f"pip install {package} (a build for this torch and CUDA), or use sdpa",
        )


def _check_model_takes_attn(model: Any, mcfg: Section) -> None:
    """Refuse an ``attn_implementation`` the model (built on the meta device) does not support."""
    name = mcfg.attn_implementation
    if name is None:
        return
    try:
        model.set_attn_implementation(name)
    except Exception as exc:  # noqa: BLE001 - the name is the user's: whatever transformers says about it (ValueError, ImportError, a hub kernel's errors)
        raise UserError(
            f"{type(model).__name__} cannot use attention {name!r}: {str(exc).splitlines()[0]}"[:500],
            where="model.attn_implementation",
            hint="use sdpa, eager, or another name from the message; leave it unset for transformers' default",
        ) from None


def enable_gradient_checkpointing(model: Any) -> None:
    """transformers' gradient checkpointing (``training.gradient_checkpointing``), before any
    strategy wraps the model: each layer's activations are recomputed in backward, with the RNG
    state of its forward (dropout draws the same masks). Non-reentrant (torch's recommended
    form), which DDP, FSDP's hooks and ZeRO-3's parameter gathering all work with; the KV cache
    is off (a cache filled in forward would be filled again by the recompute)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(
            f"{type(model).__name__} does not support transformers' gradient checkpointing",
            where="training.gradient_checkpointing",
            hint="turn it off (a strategy may checkpoint the layers it wraps itself: see its options)",
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.2x's name; the old one warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False
