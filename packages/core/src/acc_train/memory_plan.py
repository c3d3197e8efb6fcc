"""Per-rank memory of a job under each strategy, stated before anything is allocated.

``acc-train plan`` asks every installed strategy (:meth:`acc_train.Strategy.plan_memory`) what
one rank holds of the model state (parameters, gradients, optimizer state) for a model of
``psi`` parameters on ``N`` ranks, and adds an estimate of the activations. The model is
counted on the meta device, so planning a 70B model needs no memory for it. The figures are
the ones ``run.json`` measures (``per_rank[*].model_state_bytes``, see BENCHMARKS.md), whatever
dtype the checkpoint is stored in: ``model.dtype`` decides what the parameters are held in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from acc_train.config import JobConfig

__all__ = [
    "ACTIVATION_FORMULA",
    "MemoryPlan",
    "ModelShape",
    "PlanInput",
    "activation_bytes",
    "attention_score_factor",
    "model_shape",
    "replicated",
]

#: What :func:`activation_bytes` computes, for the table's header.
ACTIVATION_FORMULA = (
    "activations (estimate, Korthikanti et al. 2022, no recomputation): "
    "L*s*b*h*(34 + c*a*s/h) * (B/2) + 2*s*b*V*4 (the fp32 logits and their log-softmax); "
    "c counts the attention scores the attention implementation stores: 0 for sdpa and flash attention "
    "(they recompute them in backward), 2 for eager (the softmax), 5 for eager with attention dropout (Korthikanti's); "
    "with activation checkpointing 2*s*b*h*L*(B/2) + one layer's share; B = bytes per activation; "
    "over a mesh's tp ranks (tensor parallelism) 10 + 24/t + c*a*s/(h*t) in place of 34 + c*a*s/h, "
    "and seq_len / cp in place of s (context parallelism)"
)


@dataclass(frozen=True)
class PlanInput:
    """What a strategy's accounting depends on."""

    #: psi: the model's parameter elements (trainable ones; all of them for ``from_config``).
    parameters: int
    #: N: ranks sharing the model state (processes per machine x machines).
    world_size: int
    #: resolved mixed precision: ``no`` (fp32), ``bf16`` or ``fp16``.
    precision: str
    #: processes per machine (hybrid sharding shards within a machine).
    local_world_size: int = 0
    #: ``model.dtype``: what the parameters are loaded and held in (``auto`` is fp32); ``bf16``
    #: or ``fp16`` is pure low-precision training.
    dtype: str = "fp32"
    #: bytes of optimizer state per trainable parameter element (the optimizer's
    #: ``OptimizerKind.state_bytes``); None: AdamW's two moments in the parameters' dtype
    optimizer_bytes_per_param: float | None = None
    #: parameter elements of the model's largest block (a transformer layer: the unit a sharding
    #: strategy gathers at once); 0 where the model names no block class
    largest_layer: int = 0
    #: parameter elements of mixture-of-experts weights (transformers' ``*Experts`` modules, 3-d),
    #: all layers together: transformers hands each to ``grouped_mm`` as a transposed view, which
    #: autograd saves for backward, so whatever a strategy gathers of them stays alive until then
    expert_parameters: int = 0
    #: ``training.gradient_checkpointing``: each layer's saved tensors are dropped after its
    #: forward and recomputed in backward (the views above included)
    gradient_checkpointing: bool = False

    @property
    def low_precision(self) -> bool:
        """Mixed-precision compute (``training.mixed_precision`` bf16 or fp16)."""
        return self.precision in ("bf16", "fp16")

    @property
    def low_precision_weights(self) -> bool:
        """Pure low-precision training: the parameters themselves are bf16/fp16 (``model.dtype``)."""
        return self.dtype in ("bf16", "fp16")

    @property
    def param_bytes(self) -> int:
        """Bytes of a parameter as the model is loaded (4, or 2 under pure low precision)."""
        return 2 if self.low_precision_weights else 4

    @property
    def optimizer_bytes(self) -> float:
        """Bytes of optimizer state per parameter element: AdamW 2x the parameter's (8 in fp32),
        SGD with momentum 1x, Adafactor about 0 (factored), 8-bit AdamW 2."""
        return 2.0 * self.param_bytes if self.optimizer_bytes_per_param is None else self.optimizer_bytes_per_param


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's model state under one strategy configuration, in bytes.

    ``offload`` names the parts held in CPU (or NVMe) memory instead of the accelerator's:
    ``{"optimizer": "cpu"}``. ``formula`` states the total in psi and N, e.g. ``16psi/N``.
    """

    params: int
    grads: int
    optimizer: int
    formula: str
    offload: dict[str, str] = field(default_factory=dict)
    note: str = ""
    #: activation checkpointing: activations are recomputed in backward, not stored
    recompute: bool = False
    #: working buffers on the device beside the model state: parameters gathered for the block
    #: that computes, communication buffers (:attr:`PlanInput.largest_layer`)
    buffers: int = 0
    #: how the strategy splits each layer's activations: every rank runs ``1/sequence_split`` of
    #: every row (context parallelism), and ``tensor_split`` ranks share each layer's matrix
    #: products (tensor parallelism, Korthikanti et al.'s t); 1: not split
    sequence_split: int = 1
    tensor_split: int = 1

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    def on_device(self) -> int:
        return sum(getattr(self, part) for part in ("params", "grads", "optimizer", "buffers") if part not in self.offload)

    def offloaded(self) -> int:
        return self.model_state + self.buffers - self.on_device()


def replicated(plan: PlanInput, note: str = "") -> MemoryPlan:
    """A full replica on every rank (DDP): fp32 parameters and gradients, the optimizer's state
    (Adam's two fp32 moments) stepped in place. Under Accelerate's bf16/fp16 autocast the parameters, gradients
    and moments stay fp32 (only activations are low precision), so the bytes are the same.
    Under ``model.dtype: bf16`` they are all 2 bytes: 8psi."""
    psi, b = plan.parameters, plan.param_bytes
    if plan.low_precision_weights:
        default = f"model.dtype {plan.dtype}: parameters, gradients and moments are {plan.dtype}, no fp32 master copy"
    else:
        default = "autocast: parameters, gradients and moments stay fp32" if plan.low_precision else ""
    o = plan.optimizer_bytes
    return MemoryPlan(b * psi, b * psi, int(o * psi), f"{b}psi + {b}psi + {o:g}psi = {2 * b + o:g}psi", note=note or default)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model: its parameter count and, for the activation estimate,
    its transformer dimensions (None where the config does not say)."""

    name: str
    #: trainable parameters (LoRA's adapters under ``model.lora``)
    parameters: int
    layers: int | None
    hidden: int | None
    heads: int | None
    vocab: int | None
    #: frozen parameters (LoRA's base model): held as the strategy holds parameters, with no
    #: gradients and no optimizer state
    frozen: int = 0
    #: the attention implementation the model resolves to (``sdpa``, ``eager``, ...) and its
    #: attention dropout: what decides whether attention scores are stored
    attn_implementation: str | None = None
    attention_dropout: float = 0.0
    #: parameter elements of the largest block (a class in transformers' ``_no_split_modules``:
    #: the decoder layer), 0 where the model names none
    largest_layer: int = 0
    #: parameter elements of mixture-of-experts weights (:attr:`PlanInput.expert_parameters`)
    expert_parameters: int = 0
    #: the model's transformers config (for FLOPs per token), not compared
    config: Any = field(default=None, compare=False, repr=False)
    #: the model itself, on the meta device (for a strategy's ``check_model``), not compared
    model: Any = field(default=None, compare=False, repr=False)


def _first(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def model_shape(config: JobConfig) -> ModelShape:
    """Count the job's model (with ``model.lora``'s adapters) on the meta device: its config is
    read, no weight is allocated."""
    from acc_train.model import meta_model

    model, mcfg = meta_model(config)
    built = getattr(model, "config", mcfg)  # transformers resolved the attention implementation on it
    attn = config.model.attn_implementation or getattr(built, "_attn_implementation", None) or "sdpa"
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    blocks = set(getattr(model, "_no_split_modules", None) or getattr(getattr(model, "base_model", None), "_no_split_modules", None) or ())
    largest = max((sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in blocks), default=0)
    experts = sum(
        p.numel() for m in model.modules() if type(m).__name__.endswith("Experts") for p in m.parameters(recurse=False) if p.ndim == 3
    )
    return ModelShape(
        name=config.model.name_or_path or "demo (Llama, byte-level)",
        parameters=psi,
        layers=_first(mcfg, "num_hidden_layers", "n_layer", "num_layers"),
        hidden=_first(mcfg, "hidden_size", "n_embd", "d_model"),
        heads=_first(mcfg, "num_attention_heads", "n_head", "num_heads"),
        vocab=_first(mcfg, "vocab_size"),
        frozen=frozen,
        largest_layer=largest,
        expert_parameters=experts,
        attn_implementation=attn,
        attention_dropout=float(getattr(mcfg, "attention_dropout", 0.0) or 0.0),
        config=mcfg,
        model=model,
    )


def attention_score_factor(attn_implementation: str | None, attention_dropout: float = 0.0) -> int:
    """Korthikanti's attention-score term, ``c * a * s / h`` in 2-byte units: eager attention
    stores the softmax of the scores (``c = 2``) and, with attention dropout, its mask and output
    (``c = 5``, the paper's); sdpa, flash attention and the other fused kernels store none (they
    recompute the scores in backward from a logsumexp of ``a * s`` per row: ``c = 0``)."""
    if attn_implementation != "eager":
        return 0
    return 5 if attention_dropout > 0 else 2


def activation_bytes(
    shape: ModelShape, micro_batch: int, seq_len: int, precision: str, recompute: bool = False, tp: int = 1, scores: int | None = None
) -> int | None:
    """Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer
    Models", eq. 1: a layer stores s*b*h*(34 + 5*a*s/h) bytes of 16-bit activations without
    recomputation, halved here per byte of precision; over ``tp`` tensor-parallel ranks (eq. 2,
    no sequence parallelism) s*b*h*(10 + 24/t + 5*a*s/(h*t)): the attention and MLP insides are
    split, the layer's inputs, norms and residuals are not. The 5 is ``scores``: what the
    attention implementation stores of the s x s scores (:func:`attention_score_factor`; None:
    the shape's own implementation). It assumes a 4h GELU MLP and dropout; a Llama layer
    (SwiGLU, no dropout) differs by some tens of percent. Not sharded by any data-parallel
    strategy. None when the config lacks the dimensions."""
    if None in (shape.layers, shape.hidden, shape.heads, shape.vocab):
        return None
    s, b, h, a, n_layers, v = seq_len, micro_batch, shape.hidden, shape.heads, shape.layers, shape.vocab
    scale = 1.0 if precision in ("bf16", "fp16") else 2.0  # the formula counts 2-byte activations
    c = attention_score_factor(shape.attn_implementation, shape.attention_dropout) if scores is None else scores
    per_layer = s * b * h * (10 + 24 / tp + c * a * s / (h * tp)) * scale  # type: ignore[operator]
    logits = 2 * s * b * v * 4  # type: ignore[operator]
    if recompute:  # only each layer's input is kept, and one layer is live at a time in backward
        return int(2 * s * b * h * n_layers * scale + per_layer + logits)  # type: ignore[operator]
    return int(n_layers * per_layer + logits)  # type: ignore[operator]
