"""The loss as a mean over every token that counts in one optimizer step, across ranks and
micro-batches, whatever the split.

A per-micro-batch mean (what ``model(..., labels=...).loss`` gives), averaged over ranks and
accumulation steps, weighs a token by how many others share its micro-batch: with rows that
hold different numbers of loss tokens (labels -100 for prompts, padding, example starts) the
same global batch then trains differently on 2 ranks x 4 rows than on 1 rank x 8 rows, and a
resume under another world size would not continue its run. As transformers' Trainer does
(``num_items_in_batch``), each micro-batch's loss is the SUM of its token losses divided by the
tokens the whole step counts, summed over every rank before the step's first forward.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from acc_train.data.rows import IGNORE_INDEX

__all__ = ["step_windows", "token_loss", "eval_loss"]


def _counted(batch: dict[str, Any]) -> Any:
    """Tokens of a batch whose label a prediction is made for (labels are shifted by one)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def step_windows(batches: Iterable[dict[str, Any]], accumulation: int, accelerator: Any) -> Iterator[tuple[dict[str, Any], int]]:
    """Each micro-batch with the number of loss tokens of its whole optimizer step, over all
    ranks: the step's micro-batches are read first (every rank reads the same number: an epoch
    is cut to whole steps), their counts summed across ranks in one all-reduce."""
    import torch

    window: list[dict[str, Any]] = []
    for batch in batches:
        window.append(batch)
        if len(window) == accumulation:
            yield from _with_total(window, accelerator, torch)
            window = []
    if window:
        yield from _with_total(window, accelerator, torch)


def _with_total(window: list[dict[str, Any]], accelerator: Any, torch: Any) -> Iterator[tuple[dict[str, Any], int]]:
    local = torch.stack([_counted(b) for b in window]).sum().to(accelerator.device)
    total = int(accelerator.reduce(local, reduction="sum").item()) // accelerator.batch_replicas  # a tp group's ranks read one batch
    for batch in window:
        yield batch, max(total, 1)


def _token_losses(model: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
    """(sum of the batch's token losses, their number); the model runs without labels and
    without a KV cache (with one, transformers does not build the packed rows' mask)."""
    import torch.nn.functional as F

    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"][:, 1:].reshape(-1)
    summed = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return summed, (labels != IGNORE_INDEX).sum()


def token_loss(model: Any, batch: dict[str, Any], step_tokens: int) -> Any:
    """This micro-batch's share of the step's per-token mean loss."""
    summed, _ = _token_losses(model, batch)
    return summed / step_tokens


def eval_loss(accelerator: Any, model: Any, eval_dl: Any) -> float:
    """Mean loss per token over the evaluation loader, all ranks together."""
    import torch

    model.eval()
    total = torch.zeros((), device=accelerator.device)
    count = torch.zeros((), device=accelerator.device, dtype=torch.long)
    with torch.no_grad():
        for batch in eval_dl:
            summed, n = _token_losses(model, batch)
            total += summed.float()
            count += n.to(count.device)
    model.train()
    total = accelerator.reduce(total, reduction="sum")
    count = accelerator.reduce(count, reduction="sum")
    return float((total / count.clamp(min=1)).item())
