"""Context parallelism of the fsdp strategy's mesh (``strategy.cp``): what a job needs for it.

Accelerate runs it (``ParallelismConfig(cp_size=...)``): its ``prepare`` hooks each attention
module to drop the attention mask and attend causally, and the training loop enters
``Accelerator.maybe_context_parallel`` around each micro-batch's forward and backward (core's
``acc_train.loop.loss.sequence_shards``), where torch's ``context_parallel`` cuts the token ids,
the pre-shifted labels and the position ids of each row into ``2 x cp`` chunks (head-tail load
balancing for causal attention: rank ``r`` keeps chunks ``r`` and ``2cp - 1 - r``) and runs SDPA
as ring attention over the mesh's ``cp`` dimension. Hence what is checked before launch: SDPA
attention, rows of one fixed width divisible by ``2 x cp`` (packed rows: no attention mask,
which the ring cannot take), and a GPU.
"""

from __future__ import annotations

from typing import Any

from acc_train.api import UserError, packs_continuous_text, packs_rows

__all__ = ["CPU_REASON", "check_cp_job", "check_cp_model", "refuse_cp_on_cpu"]

#: why context parallelism cannot run on CPU, as measured (torch 2.13.0+cpu, Accelerate 1.16,
#: 2 processes over gloo, a tiny Llama with sdpa attention inside torch's ``context_parallel``)
CPU_REASON = (
    "torch's context parallelism is CUDA only: it runs ring attention for SDPA's CUDA kernels "
    "(flash, memory-efficient, cuDNN) and has no rule for its CPU kernel (torch 2.13 on CPU: "
    '"Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered"; '
    "forcing SDPA's math kernel fails too: \"aten.add.Tensor got mixed torch.Tensor and DTensor\")"
)


def refuse_cp_on_cpu(cp: int) -> None:
    """A CPU run cannot cut sequences over processes (:data:`CPU_REASON`)."""
    raise UserError(
        f"cp: {cp} asks for context parallelism, which cannot run on CPU: {CPU_REASON}",
        where="strategy.cp",
        hint="run it on 2 or more GPUs, or drop strategy.cp (or set it to 1)",
    )


def check_cp_job(config: Any, cp: int) -> None:
    """Refuse job settings context parallelism cannot take: a ``data.seq_len`` not divisible by
    ``2 x cp``, attention other than ``sdpa``, rows padded per batch (an attention mask)."""
    seq_len, data = config.data.seq_len, config.data
    if seq_len % (2 * cp):
        raise UserError(
            f"cp: {cp} needs data.seq_len divisible by 2 x cp = {2 * cp} (torch cuts each row into 2 x cp chunks "
            f"to balance causal attention over the cp ranks); data.seq_len is {seq_len}",
            where="strategy.cp",
            hint=f"set data.seq_len to a multiple of {2 * cp}, or choose another cp",
        )
    name = config.model.attn_implementation
    if name is not None and name != "sdpa":
        raise UserError(
            f"cp: {cp} runs ring attention in place of SDPA (torch.nn.functional.scaled_dot_product_attention); "
            f"model.attn_implementation is {name!r}",
            where="model.attn_implementation",
            hint="set model.attn_implementation=sdpa (or leave it unset), or drop strategy.cp",
        )
    if not packs_rows(data):
        why = "data.packing is false" if data.packing is False else f"data.kind {data.kind!r} pads its examples unless data.packing is set"
        raise UserError(
            f"cp: {cp} needs packed rows of data.seq_len tokens: the ring attention of context parallelism takes no "
            f"attention mask, and rows padded per batch have one (and widths that vary); {why}",
            where="data.packing",
            hint="set data.packing=true (with data.kind text: documents cut into rows; they attend across document boundaries, see strategy.cp), or drop strategy.cp",
        )
    if not packs_continuous_text(data):
        raise UserError(
            f"cp: {cp} cannot keep the examples packed into a row apart: its ring attention takes only a causal mask, so "
            f"each example of data.kind {data.kind!r} would attend to the ones before it in its row",
            where="strategy.cp",
            hint="train these examples without cp (rows of whole examples are seldom long enough to need it), "
            "or use cp with data.kind: text",
        )


def check_cp_model(model: Any, cp: int) -> None:
    """The model (built on the meta device) must attend through SDPA, and be one whose mask
    Accelerate may drop (transformers' ``supports_context_parallel``: full causal attention)."""
    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    if name != "sdpa":
        raise UserError(
            f"cp: {cp} runs ring attention in place of SDPA; {type(model).__name__} attends with {name!r}",
            where="model.attn_implementation",
            hint="set model.attn_implementation=sdpa, or drop strategy.cp",
        )
    if getattr(model, "supports_context_parallel", True) is False:
        raise UserError(
            f"{type(model).__name__} does not support context parallelism (its layers use a mask stricter than full causal "
            "attention, or a recurrent state, which the ring cannot carry)",
            where="strategy.cp",
            hint="use a full-attention model, or drop strategy.cp",
        )
