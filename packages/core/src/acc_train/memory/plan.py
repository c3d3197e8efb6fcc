"""Per-rank memory of a job under each strategy, stated before anything is allocated.

``acc-train plan`` asks every installed strategy (:meth:`acc_train.api.StrategyPlanner.plan_memory`) what
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
    from acc_train.contracts.protocols import JobConfigView

__all__ = [
    "ACTIVATION_FORMULA",
    "MemoryPlan",
    "ModelShape",
    "PlanInput",
    "activation_bytes",
    "attention_score_factor",
    "layer_activation_bytes",
    "model_shape",
    "replicated",
]

#: What :func:`activation_bytes` computes, for the table's header.
ACTIVATION_FORMULA = (
    "activations (estimate: what autograd keeps in transformers' decoder layers, term by term, held to plan --simulate): "
    "s*b*[L*(n*(4h + 2Bh) + B(2q + 2k) + 4a + c*a*s + 4BI) + 4h + 2Bh + 12V] bytes, no recomputation; "
    "n norms per layer (RMSNorm upcasts to fp32: 4h + 2Bh each; LayerNorm 2Bh; Gemma-2's 4 sandwich norms 34h + 2Bh together), q = a*d and k = kv*d the query and key widths, "
    "c bytes kept per attention score: 0 for sdpa and flash attention (a logsumexp, the 4a), 4 + B for eager in bf16/fp16 "
    "(the fp32 softmax and its cast; 4 in fp32; + 1 + B with attention dropout; + B with score softcapping, eager's q, k, v and output "
    "then 4B*q in place of B(2q + 2k)); 4BI a gated MLP of width I (2BI ungated); a mixture of experts k*(2Bh + 4BI) for its top-k experts "
    "+ 4E + 46k for the router; 12V the loss: the fp32 log-softmax (4V, + BV with logit softcapping) and the two fp32 gradients of "
    "its backward (8V); with activation checkpointing s*b*[B*h*L + max(one layer's share, the final norm's and the loss's)]; B = bytes per activation; over a mesh's tp ranks "
    "(tensor parallelism) the attention, MLP and expert terms / t, and seq_len / cp in place of s (context parallelism)"
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
    #: the decoder layer as :func:`activation_bytes` counts it (transformers' config names; None: the
    #: plain multi-head default): key/value heads, head width, MLP width (each expert's in an MoE)
    kv_heads: int | None = None
    head_dim: int | None = None
    intermediate: int | None = None
    #: a gated MLP (SwiGLU, GeGLU: gate and up projections) rather than one up projection
    gated_mlp: bool = True
    #: hidden-sized norms per layer (Llama 2, Gemma-2 4), and whether they are RMSNorms (which
    #: compute in fp32: the upcast input and the normalised output are kept)
    norms_per_layer: int = 2
    rms_norm: bool = True
    #: mixture of experts: experts per layer and experts each token is routed to (0: dense)
    experts: int = 0
    experts_per_token: int = 0
    #: tanh softcapping of the attention scores (Gemma-2, eager) and of the logits
    attention_softcapping: bool = False
    logit_softcapping: bool = False
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


def model_shape(config: JobConfigView) -> ModelShape:
    """Count the job's model (with ``model.lora``'s adapters) on the meta device: its config is
    read, no weight is allocated."""
    from acc_train.model.build import meta_model

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
    hidden = _first(mcfg, "hidden_size", "n_embd", "d_model")
    layer = next((m for m in model.modules() if type(m).__name__ in blocks), None)
    norms = [m for m in layer.modules() if "Norm" in type(m).__name__ and getattr(m, "weight", None) is not None and m.weight.numel() == hidden] if layer is not None else []
    names = {name.rsplit(".", 1)[-1] for name, _ in layer.named_parameters()} | {name.rsplit(".", 1)[-1] for name, _ in layer.named_modules()} if layer is not None else set()
    n_experts = (_first(mcfg, "num_local_experts", "num_experts", "n_routed_experts") or 0) if experts else 0
    return ModelShape(
        name=config.model.name_or_path or "demo (Llama, byte-level)",
        parameters=psi,
        layers=_first(mcfg, "num_hidden_layers", "n_layer", "num_layers"),
        hidden=hidden,
        heads=_first(mcfg, "num_attention_heads", "n_head", "num_heads"),
        vocab=_first(mcfg, "vocab_size"),
        frozen=frozen,
        largest_layer=largest,
        expert_parameters=experts,
        kv_heads=_first(mcfg, "num_key_value_heads"),
        head_dim=_first(mcfg, "head_dim"),
        intermediate=_first(mcfg, *(("moe_intermediate_size",) if n_experts else ()), "intermediate_size", "n_inner", "ffn_dim"),
        gated_mlp=bool(names & {"gate_proj", "gate_up_proj", "w3"}),
        norms_per_layer=len(norms) or 2,
        rms_norm=all("RMSNorm" in type(m).__name__ for m in norms),
        experts=n_experts,
        experts_per_token=(_first(mcfg, "num_experts_per_tok", "top_k") or 0) if n_experts else 0,
        attention_softcapping=bool(getattr(mcfg, "attn_logit_softcapping", None)),
        logit_softcapping=bool(getattr(mcfg, "final_logit_softcapping", None)),
        attn_implementation=attn,
        attention_dropout=float(getattr(mcfg, "attention_dropout", 0.0) or 0.0),
        config=mcfg,
        model=model,
    )


def attention_score_factor(attn_implementation: str | None, attention_dropout: float = 0.0, precision: str = "bf16", softcapping: bool = False) -> int:
    """Bytes kept per attention score (``a * s`` of them per token): eager attention keeps the
    fp32 softmax (transformers computes it in fp32) and, in bf16/fp16, its cast to the
    activations' dtype; with attention dropout its mask (1 byte) and output; with score
    softcapping (Gemma-2) the tanh's output. sdpa, flash attention and the other fused kernels
    keep none (they recompute the scores in backward from a logsumexp per row). Measured with
    autograd's saved-tensor hooks (``tests/core/test_memory_plan.py``)."""
    if attn_implementation != "eager":
        return 0
    b = _bytes_per_activation(precision)
    return 4 + (b if b < 4 else 0) + (1 + b if attention_dropout > 0 else 0) + (b if softcapping else 0)


def _bytes_per_activation(precision: str) -> int:
    return 2 if precision in ("bf16", "fp16") else 4


def layer_activation_bytes(shape: ModelShape, seq_len: int, precision: str, tp: int = 1, scores: int | None = None) -> float | None:
    """Bytes one decoder layer keeps for backward per token (``seq_len`` for the attention
    scores), counted term by term from what autograd saves in transformers' Llama, Gemma-2 and
    Mixtral layers (``tests/core/test_memory_plan.py`` measures each within 1%; issue 41 found the
    Korthikanti et al. 2022 form, written for a GPT layer, 38% low for Gemma-2-2B):

    - each hidden-sized norm: RMSNorm's fp32 upcast of its input (4h) and its normalised output
      before and after the weight (2Bh); a LayerNorm's input and output (2Bh); Gemma-2's four
      sandwich norms apply their weight in fp32 (8h), and only the two before a projection keep
      their output (Bh);
    - attention, sdpa/flash: the rotated query and key, the value, the output (``B(2q + 2k)``,
      q = heads x head width, k = kv heads x head width) and a fp32 logsumexp per head (4a); eager:
      query, the key and value repeated to every head, the output made contiguous (4Bq), and
      ``scores`` bytes per score (:func:`attention_score_factor`);
    - a gated MLP: gate, up, the activation and the product, each of width I (4BI; ungated 2BI);
    - a mixture of experts, per token routed to k experts: the gathered input, the expert's output
      (2Bh) and its gated MLP (4BI) each time, and the router's fp32 softmax and top-k (4E + 46k,
      measured);
    - the residual stream keeps nothing (additions save no input).

    Over ``tp`` tensor-parallel ranks the attention, MLP and experts are split; the norms are not."""
    if None in (shape.hidden, shape.heads):
        return None
    h, a = shape.hidden, shape.heads
    b = _bytes_per_activation(precision)
    d = shape.head_dim or h // a  # type: ignore[operator]
    q, k = a * d, (shape.kv_heads or a) * d  # type: ignore[operator]
    i = shape.intermediate or 4 * h  # type: ignore[operator]
    if not shape.rms_norm:
        norms = shape.norms_per_layer * 2 * b * h  # type: ignore[operator]
    elif shape.norms_per_layer == 4:  # sandwich norms (Gemma-2): weight applied in fp32; the post-norms feed the residual alone
        norms = 2 * (8 * h + b * h) + 2 * 8 * h  # type: ignore[operator]
    else:
        norms = shape.norms_per_layer * (4 * h + 2 * b * h)  # type: ignore[operator]
    c = attention_score_factor(shape.attn_implementation, shape.attention_dropout, precision, shape.attention_softcapping) if scores is None else scores
    attention = (4 * b * q if shape.attn_implementation == "eager" else b * (2 * q + 2 * k) + 4 * a) + c * a * seq_len  # type: ignore[operator]
    mlp = (4 if shape.gated_mlp else 2) * b * i
    router = 0
    if shape.experts and shape.experts_per_token:
        mlp = shape.experts_per_token * (2 * b * h + mlp)  # type: ignore[operator]
        router = 4 * shape.experts + 46 * shape.experts_per_token
    return norms + router + (attention + mlp) / tp


def activation_bytes(
    shape: ModelShape, micro_batch: int, seq_len: int, precision: str, recompute: bool = False, tp: int = 1, scores: int | None = None
) -> int | None:
    """Bytes of activations one rank holds at the step's peak (the start of backward): every
    layer's (:func:`layer_activation_bytes`), the final norm's, and the loss's: transformers
    upcasts the logits to fp32 and keeps their log-softmax (4V a token; with logit softcapping
    also the tanh's output, BV), and the log-softmax's backward holds two fp32 gradients of the
    logits at once (8V; ``plan --simulate`` tracks them as temporaries: 1.95 GiB for a 7B model at
    4 x 2048, issue 41). With activation checkpointing each layer keeps only its input (Bh), and
    the larger of the loss's share and one recomputed layer's is added (the layers are recomputed
    after the loss's backward). Not sharded by any data-parallel strategy. None when the
    config lacks the dimensions."""
    if None in (shape.layers, shape.hidden, shape.heads, shape.vocab):
        return None
    per_layer = layer_activation_bytes(shape, seq_len, precision, tp, scores)
    assert per_layer is not None
    b, h, v = _bytes_per_activation(precision), shape.hidden, shape.vocab
    final_norm = (4 * h + 2 * b * h) if shape.rms_norm else 2 * b * h  # type: ignore[operator]
    loss = 12 * v + (b * v if shape.logit_softcapping else 0)  # type: ignore[operator]
    if recompute:  # the loss's backward ends before the first layer is recomputed: never live together
        return int(seq_len * micro_batch * (b * h * shape.layers + max(final_norm + loss, per_layer)))  # type: ignore[operator]
    return int(seq_len * micro_batch * (shape.layers * per_layer + final_norm + loss))  # type: ignore[operator]
