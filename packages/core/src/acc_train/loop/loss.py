"""The loss as a mean over every token that counts in one optimizer step, across ranks and
micro-batches, whatever the split.

A per-micro-batch mean (what ``model(..., labels=...).loss`` gives), averaged over ranks and
accumulation steps, weighs a token by how many others share its micro-batch: with rows that
hold different numbers of loss tokens (labels -100 for prompts, padding, example starts) the
same global batch then trains differently on 2 ranks x 4 rows than on 1 rank x 8 rows, and a
resume under another world size would not continue its run. As transformers' Trainer does
(``num_items_in_batch``), each micro-batch's loss is the SUM of its token losses divided by the
tokens the whole step counts, summed over every rank before the step's first forward.

Under context parallelism (Accelerate's ``ParallelismConfig.cp_size``) the ranks of a cp group
read one batch and each runs a part of every row (:func:`sequence_shards`): labels are shifted
before the rows are cut (a shift inside a part would lose the label at each cut), and each
rank's sum is its part of the batch's, so the step's loss is the sum over the group.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
import contextlib
from contextlib import contextmanager
from typing import Any

from acc_train.data.rows import IGNORE_INDEX, REAL_TOKENS, real_tokens
from acc_train.errors import UserError

__all__ = ["SHIFTED_LABELS", "EXPLICIT_MASKS", "CAUSAL_SDPA", "step_windows", "sequence_shards", "token_loss", "eval_loss", "packed_mask_kind", "is_flash"]

#: a batch's labels already shifted by one (the label of each position's next token), set by
#: :func:`sequence_shards`; the model never sees them
SHIFTED_LABELS = "shift_labels"


def _counted(batch: dict[str, Any]) -> Any:
    """Tokens of a batch whose label a prediction is made for (labels are shifted by one)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def step_windows(
    batches: Iterable[dict[str, Any]], accumulation: int, accelerator: Any, carry: Any = None
) -> Iterator[tuple[dict[str, Any], Any, Any]]:
    """Each micro-batch with the number of loss tokens of its whole optimizer step, over all
    ranks, and the step's real tokens (padding left out: what throughput counts): the step's
    micro-batches are read first (every rank reads the same number: an epoch is cut to whole
    steps), both counts summed across ranks in one all-reduce. The counts stay 0-d tensors on
    the device: nothing here waits for it.

    ``carry`` (a :class:`acc_train.loop.ledger.StepLedger`) rides on that all-reduce: the
    previous step's loss, summed over ranks with the counts."""
    import torch

    window: list[dict[str, Any]] = []
    for batch in batches:
        window.append(batch)
        if len(window) == accumulation:
            yield from _with_total(window, accelerator, torch, carry)
            window = []
    if window:
        yield from _with_total(window, accelerator, torch, carry)


def _with_total(window: list[dict[str, Any]], accelerator: Any, torch: Any, carry: Any) -> Iterator[tuple[dict[str, Any], Any, Any]]:
    local = torch.stack([torch.stack([_counted(b), real_tokens(b).to(torch.long)]) for b in window]).sum(0).to(accelerator.device)
    if accelerator.num_processes > 1:
        loss = carry.take() if carry is not None else None
        # float64 holds token counts exactly up to 2**53; the loss is summed in it too
        parts = [local.double()] if loss is None else [local.double(), loss.double().reshape(1)]
        reduced = accelerator.reduce(torch.cat(parts), reduction="sum")
        if loss is not None:
            carry.put(reduced[2])
        local = reduced[:2].round().long()
    counted, real = local // accelerator.batch_replicas  # a tp/cp group's ranks read one batch
    counted = counted.clamp(min=1)
    for batch in window:
        yield batch, counted, real


@contextmanager
def sequence_shards(accelerator: Any, batch: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The batch to run forward and backward on, inside Accelerate's context-parallel context
    when the accelerator's mesh has a cp dimension: token ids, labels shifted by one and
    position ids cut to this rank's part of every row (torch's ``context_parallel``, which
    patches SDPA into ring attention until the context ends; backward runs inside it too).
    Without context parallelism, the batch itself and no context."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or not config.cp_enabled:
        yield batch
        return
    import torch

    if "attention_mask" in batch:
        raise UserError(
            "context parallelism (the mesh's cp dimension) cannot take rows padded per batch: its ring attention takes no attention mask",
            where="data.packing",
            hint="set data.packing=true, or run without context parallelism",
        )
    ids, labels = batch["input_ids"], batch["labels"]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    positions = positions.contiguous()
    shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
    buffers = [ids, shifted, positions]
    with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
        yield {"input_ids": ids, "position_ids": positions, SHIFTED_LABELS: shifted}


#: attention implementations given a packed batch's block-diagonal causal mask explicitly, and the
#: form each takes it in (a 4-d mask is passed to them as it is)
EXPLICIT_MASKS = {"sdpa": "bool", "eager": "additive"}


def packed_mask_kind(model: Any) -> str | None:
    """How to hand this model a packed batch's example boundaries: ``"bool"`` or ``"additive"``
    (a 4-d block-diagonal causal mask, :data:`EXPLICIT_MASKS`), ``"varlen"`` (flash attention:
    the collator's ``cu_seq_lens``, :class:`acc_train.data.Collate`), or None: transformers
    infers them from the restarting position ids. Inferring reads a tensor back to the host on
    every forward (``masking_utils.find_packed_sequence_indices`` checks whether any row is
    packed). A model with a sliding window or other per-layer masks keeps the inference, which
    builds each layer's own mask; so does flex attention."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if is_flash(getattr(config, "_attn_implementation", None)):
        return "varlen"  # cu_seq_lens from the collator (Collate.varlen): per-layer windows are flash's own
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "sliding_window", None) or any(t != "full_attention" for t in layer_types):
        return None
    return EXPLICIT_MASKS.get(getattr(config, "_attn_implementation", None) or "")


def is_flash(attn_implementation: str | None) -> bool:
    """Whether an attention implementation is flash attention (``flash_attention_2``/``_3``, or
    a kernel of it from the hub), which takes packed boundaries as varlen keywords."""
    return bool(attn_implementation) and "flash" in str(attn_implementation)


def _packed_mask(positions: Any, kind: str, dtype: Any) -> Any:
    """The block-diagonal causal mask of packed rows, ``(batch, 1, seq, seq)``, from their
    position ids (each example, and the row's padding, restarts them at 0): what transformers
    builds from them, without reading anything back."""
    import torch

    segments = (positions == 0).cumsum(-1)
    n = positions.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril()
    mask = ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]
    if kind == "bool":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _padded_mask(attention_mask: Any) -> Any:
    """The causal mask of rows padded per batch, ``(batch, 1, seq, seq)`` booleans, from their
    2-d attention mask (1: a real token): what transformers builds from it, without asking the
    device whether any row is padded. Rows are padded on the right, so every query keeps at
    least its row's first token."""
    import torch

    n = attention_mask.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=attention_mask.device).tril()
    return (causal[None] & attention_mask.bool()[:, None, :])[:, None]


#: the attention implementation the loop's forward runs under when the model's is ``sdpa``:
#: transformers' own SDPA kernel, registered with ``AttentionInterface`` and with no mask
#: function (``AttentionMaskInterface``), so transformers builds no mask and checks nothing:
#: the loop hands every mask a batch needs (packed rows, padded rows) as a 4-d tensor, and a
#: batch that needs none runs SDPA's ``is_causal`` kernel
CAUSAL_SDPA = "acc_train_causal_sdpa"


@contextlib.contextmanager
def _causal_sdpa(config: Any) -> Iterator[None]:
    """The model's forward under :data:`CAUSAL_SDPA` (its config's own value restored after:
    generation and saving see ``sdpa``). Without it, transformers 5 makes position ids for a row
    given none and, with no attention mask, reads the device on every forward to ask whether they
    restart (``masking_utils.find_packed_sequence_indices``); for padded rows it reads whether
    any token is padding (``_ignore_causal_mask_sdpa``)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if CAUSAL_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    before = config._attn_implementation_internal  # this config only: its layers hold it
    config._attn_implementation_internal = CAUSAL_SDPA
    try:
        yield
    finally:
        config._attn_implementation_internal = before


def _token_losses(model: Any, batch: dict[str, Any], mask: str | None = None, config: Any = None) -> tuple[Any, Any]:
    """(sum of the batch's token losses, their number); the model runs without labels and
    without a KV cache (with one, transformers does not build the packed rows' mask). ``mask``
    (:func:`packed_mask_kind`): a packed batch's boundaries given as an explicit mask. ``config``
    (the unwrapped model's, for ``mask == "bool"``: SDPA over full attention): the forward runs
    under :data:`CAUSAL_SDPA`, every mask given here, so nothing is read back."""
    import torch
    import torch.nn.functional as F

    inputs = {k: v for k, v in batch.items() if k not in ("labels", SHIFTED_LABELS, REAL_TOKENS)}
    if mask in EXPLICIT_MASKS.values() and "position_ids" in inputs and "attention_mask" not in inputs and SHIFTED_LABELS not in batch:
        inputs["attention_mask"] = _packed_mask(inputs["position_ids"], mask, torch.float32)
    causal = mask == "bool" and config is not None and SHIFTED_LABELS not in batch  # (context parallelism: its ring attention as before)
    if causal and "attention_mask" in inputs and inputs["attention_mask"].ndim == 2:
        inputs["attention_mask"] = _padded_mask(inputs["attention_mask"])
    with _causal_sdpa(config) if causal else contextlib.nullcontext():
        logits = model(**inputs, use_cache=False).logits
    if SHIFTED_LABELS in batch:  # this rank's part of each row, labels shifted before the cut
        labels = batch[SHIFTED_LABELS].reshape(-1)
    else:
        labels, logits = batch["labels"][:, 1:].reshape(-1), logits[:, :-1]
    summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return summed, (labels != IGNORE_INDEX).sum()


def token_loss(model: Any, batch: dict[str, Any], step_tokens: Any, mask: str | None = None, config: Any = None) -> Any:
    """This micro-batch's share of the step's per-token mean loss."""
    summed, _ = _token_losses(model, batch, mask, config)
    return summed / step_tokens


def eval_loss(accelerator: Any, model: Any, eval_dl: Any, mask: str | None = None, config: Any = None) -> float:
    """Mean loss per token over the evaluation loader, all ranks together."""
    import torch

    model.eval()
    total = torch.zeros((), device=accelerator.device)
    count = torch.zeros((), device=accelerator.device, dtype=torch.long)
    with torch.no_grad():
        for batch in eval_dl:
            with sequence_shards(accelerator, batch) as part:  # a cp rank counts its part of the rows
                summed, n = _token_losses(model, part, mask, config)
            total += summed.float()
            count += n.to(count.device)
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    count = accelerator.reduce(count, reduction="sum")
    return float((total / count.clamp(min=1)).item())
