"""Model FLOPs utilization: the model's training FLOPs per token, the device's dense peak in the
precision a run computes in, and their ratio to measured throughput.

MFU counts the FLOPs the model needs, not the ones the hardware did: recomputation under
activation checkpointing is left out (that would be hardware FLOPs utilization), and so is
padding (throughput counts real tokens). The formula is PaLM's (Chowdhery et al. 2022, appendix
B) as torchtitan computes it (``torchtitan/tools/utils.py`` ``get_num_flop_per_token``):
``6 * N + 12 * L * H * Q * T`` per token, N the parameters without the input embedding, L
layers, H heads of size Q, T the sequence length. Frozen parameters (a LoRA base) cost their
forward (2 per parameter) and the gradient of their input activations (2 more), not a weight
gradient: 4 instead of 6.

The devices' peaks come from :mod:`acc_train.outputs.device_peaks` (vendor figures, or a CPU's
measured once per machine).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from acc_train.outputs.device_peaks import device_peak_flops, peak_from_env, precision_name

__all__ = ["model_flops_per_token", "mfu", "parameter_counts", "compute_precision", "run_basis"]

def _get(config: Any, *names: str) -> Any:
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return None


def _architecture(config: Any) -> tuple[int, int, int, int, int, int, int, bool]:
    """(layers, hidden, heads, kv heads, head dim, intermediate, vocab, tied embeddings) of a
    transformers config (or a dict of its keys); a text model inside a multimodal one counts."""
    text = _get(config, "text_config")
    if text is not None and _get(config, "num_hidden_layers") is None:
        config = text
    layers = _get(config, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _get(config, "hidden_size", "n_embd", "d_model")
    heads = _get(config, "num_attention_heads", "n_head", "num_heads")
    vocab = _get(config, "vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (layers, hidden, heads, vocab)):
        raise ValueError("the model config must give num_hidden_layers, hidden_size, num_attention_heads and vocab_size")
    kv = _get(config, "num_key_value_heads") or heads
    head_dim = _get(config, "head_dim") or hidden // heads
    inter = _get(config, "intermediate_size", "n_inner") or 4 * hidden
    tied = bool(_get(config, "tie_word_embeddings") or False)
    return layers, hidden, heads, kv, head_dim, inter, vocab, tied


def _llama_parameters(layers: int, hidden: int, heads: int, kv: int, head_dim: int, inter: int, vocab: int, tied: bool) -> int:
    """Parameters of a Llama-shaped decoder (no biases): embedding, attention, SwiGLU MLP, two
    RMSNorms a layer, a final norm and the output projection unless tied."""
    attention = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    return vocab * hidden + layers * per_layer + hidden + (0 if tied else vocab * hidden)


def model_flops_per_token(model_config: Any, seq_len: int, *, trainable_params: int | None = None, total_params: int | None = None) -> float:
    """Training FLOPs per token (forward and backward): ``6 * N + 12 * L * H * Q * T``, frozen
    parameters counted ``4`` each instead of ``6``.

    ``model_config``: a transformers ``PretrainedConfig`` or a dict of its keys. ``total_params``:
    every parameter of the model (LoRA's adapters included); without it, a Llama-shaped count
    from the config. ``trainable_params``: those that get a weight gradient (all when None). The
    input embedding is a lookup, not a matrix product: its ``vocab * hidden`` elements are left
    out of N (counted as frozen first, as LoRA freezes it), unless the output projection shares
    them (``tie_word_embeddings``), whose matrix product they then are.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, not {seq_len!r}")
    layers, hidden, heads, kv, head_dim, inter, vocab, tied = _architecture(model_config)
    total = total_params if total_params is not None else _llama_parameters(layers, hidden, heads, kv, head_dim, inter, vocab, tied)
    trainable = total if trainable_params is None else trainable_params
    if not 0 <= trainable <= total:
        raise ValueError(f"trainable_params ({trainable}) must be between 0 and total_params ({total})")
    embedding = 0 if tied else vocab * hidden
    frozen = total - trainable
    frozen_embedding = min(embedding, frozen)  # a frozen base (LoRA) freezes the embedding too
    frozen_matrix = frozen - frozen_embedding
    trainable_matrix = max(trainable - (embedding - frozen_embedding), 0)
    attention = 12 * layers * heads * head_dim * seq_len  # QK^T and scores x V: 2 x 2*s*h forward, twice that backward
    return float(6 * trainable_matrix + 4 * frozen_matrix + attention)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilization: the FLOPs the tokens needed per second over the peak of the
    devices that trained them (``peak_flops``: all of them together)."""
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, not {peak_flops!r}")
    return tokens_per_s * flops_per_token / peak_flops


def parameter_counts(model: Any) -> tuple[int, int]:
    """(every parameter, those that train) of a built model, before a strategy shards it
    (DeepSpeed's ZeRO-3 construction leaves each parameter's real size in ``ds_numel``)."""
    total = trainable = 0
    for p in model.parameters():
        n = int(getattr(p, "ds_numel", 0) or p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def compute_precision(mixed_precision: str, model_dtype: str) -> str:
    """What matrix products run in: the mixed precision, or pure ``model.dtype`` bf16/fp16 without one."""
    if mixed_precision in ("bf16", "fp16"):
        return mixed_precision
    return model_dtype if model_dtype in ("bf16", "fp16") else "fp32"


def run_basis(model: Any, seq_len: int, device_type: str, precision: str, devices: int) -> dict[str, Any]:
    """What a run's MFU is computed against (``run.json``'s ``mfu_basis``): FLOPs per token of
    ``model`` at ``seq_len``, the peak of one device (handed by the launching command, else
    found here) and of the ``devices`` that train together. ``{"error": ...}`` when the model or
    device has no figure: the run goes on without MFU."""
    config = getattr(model, "config", None)
    base = getattr(model, "get_base_model", None)  # a PEFT model's config is the base model's
    if config is None and base is not None:
        config = getattr(base(), "config", None)
    try:
        total, trainable = parameter_counts(model)
        per_token = model_flops_per_token(config, seq_len, trainable_params=trainable, total_params=total)
        found = peak_from_env(device_type, precision) or device_peak_flops(device_type, precision)
    except (ValueError, TypeError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "flops_per_token": per_token,
        "seq_len": seq_len,
        "precision": precision_name(precision),
        "peak_flops_per_device": found[0],
        "devices": devices,
        "peak_flops": found[0] * devices,
        "peak_source": found[1],
        "parameters": total,
        "trainable_parameters": trainable,
    }
