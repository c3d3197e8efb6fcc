"""Training rows as the model takes them: token ids, labels (-100 where a token is not in the
loss) and, for packed rows, position ids that restart at every example.

The loop keeps a packed row's examples apart (:func:`acc_train.loop.loss.packed_mask_kind`):
``sdpa`` and ``eager`` get a block-diagonal causal mask built from the restarting position ids,
flash attention gets varlen keywords computed here (:func:`varlen_kwargs`), flex attention and
models with per-layer masks get the position ids, from which transformers builds their masks.
No token attends across examples. Padded rows carry an ``attention_mask`` instead, and padding
never counts in the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from acc_train.data.pack import inner_starts

__all__ = ["IGNORE_INDEX", "REAL_TOKENS", "Split", "TokenRows", "Collate", "real_tokens", "token_row"]

#: the label cross-entropy ignores (transformers' and torch's default)
IGNORE_INDEX = -100

#: a packed batch's count of each row's real (not padding) tokens; the model never sees it
REAL_TOKENS = "real_tokens"


@dataclass
class Split:
    """One split of prepared data: the token stream (read on demand when cached), per-token loss
    flags (None: every token counts), example starts (with the stream's end last) and rows."""

    tokens: np.ndarray
    loss: np.ndarray | None
    starts: np.ndarray
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, begin: int, end: int) -> Split:
        rows = self.rows.window(begin, end) if hasattr(self.rows, "window") else self.rows[begin:end]
        return Split(self.tokens, self.loss, self.starts, rows)


class TokenRows:
    """Indexable rows of a :class:`Split`: each a dict of int64 numpy arrays (``input_ids``,
    ``labels``, ``position_ids``). Reads only the row's span of the cached files."""

    def __init__(self, split: Split) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split.rows)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        s = self.split
        begin, end = (int(x) for x in s.rows[i])
        loss = None if s.loss is None else np.asarray(s.loss[begin:end])
        return token_row(np.asarray(s.tokens[begin:end], dtype=np.int64), loss, inner_starts(s.starts, begin, end) - begin)


def token_row(ids: np.ndarray, loss: np.ndarray | None, inner: np.ndarray) -> dict[str, np.ndarray]:
    """One row as the model takes it, from its token ids (int64), loss flags (None: all count)
    and the offsets of the examples that start strictly inside it (position ids restart there,
    and their first token's label is -100). Shared by cached and streamed rows."""
    labels = ids.copy()
    if loss is not None:
        labels[loss == 0] = IGNORE_INDEX
    labels[inner] = IGNORE_INDEX
    segment_start = np.zeros(len(ids), dtype=np.int64)
    segment_start[inner] = inner
    positions = np.arange(len(ids), dtype=np.int64) - np.maximum.accumulate(segment_start)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


@dataclass
class Collate:
    """Stacks rows into a batch. ``packed``: every row padded to ``seq_len`` (the padding its own
    segment of position ids, labels -100), no attention mask, and each row's real length in
    :data:`REAL_TOKENS` (throughput counts real tokens); the position ids only where some row
    restarts them (the loop then gives the model the examples' boundaries as a mask,
    :func:`acc_train.loop.loss.packed_mask_kind`: decided here, on the host, so nothing on the
    accelerator is read back to decide it). Otherwise: rows padded to the batch's
    longest, with an ``attention_mask``, no position ids."""

    seq_len: int
    packed: bool | str
    pad_id: int
    #: flash attention's varlen keywords for packed rows (``cu_seq_lens_q``/``_k``: where each
    #: example of the batch, flattened, starts; ``max_length_q``/``_k``: the longest), computed
    #: here on the host, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` does:
    #: transformers infers boundaries from position ids only for a batch of one row
    varlen: bool = False

    def __call__(self, rows: list[dict[str, np.ndarray]]) -> dict[str, Any]:
        import torch

        width = self.seq_len if self.packed else max(len(r["input_ids"]) for r in rows)
        n = len(rows)
        ids = np.full((n, width), self.pad_id, dtype=np.int64)
        labels = np.full((n, width), IGNORE_INDEX, dtype=np.int64)
        positions = np.tile(np.arange(width, dtype=np.int64), (n, 1))
        mask = np.zeros((n, width), dtype=np.int64)
        for j, r in enumerate(rows):
            k = len(r["input_ids"])
            ids[j, :k] = r["input_ids"]
            labels[j, :k] = r["labels"]
            mask[j, :k] = 1
            if self.packed:
                positions[j, :k] = r["position_ids"]
                positions[j, k:] = np.arange(width - k)
        batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if self.packed:
            if (positions != np.arange(width, dtype=np.int64)).any():
                batch["position_ids"] = torch.from_numpy(positions)
                if self.varlen:
                    batch.update(varlen_kwargs(positions))
            # else every row is one stretch of one document: the model's own positions and plain
            # causal attention are the same thing, and the fastest kernels take it (no mask)
            batch[REAL_TOKENS] = torch.from_numpy(mask.sum(axis=1))
        else:
            batch["attention_mask"] = torch.from_numpy(mask)
        return batch


def varlen_kwargs(positions: np.ndarray) -> dict[str, Any]:
    """Flash attention's varlen keywords for a batch of packed rows, from their position ids
    (every example, and a row's padding, restarts them at 0), over the batch flattened."""
    import torch

    flat = positions.reshape(-1)
    cu = np.append(np.flatnonzero(flat == 0), len(flat)).astype(np.int32)
    longest = int(np.diff(cu).max())
    seqs = torch.from_numpy(cu)
    return {"cu_seq_lens_q": seqs, "cu_seq_lens_k": seqs, "max_length_q": longest, "max_length_k": longest}


def real_tokens(batch: dict[str, Any]) -> Any:
    """The batch's real tokens, padding left out (a 0-d tensor): its attention mask's ones, a
    packed batch's :data:`REAL_TOKENS`, or every position of a batch that has neither."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    if REAL_TOKENS in batch:
        return batch[REAL_TOKENS].sum()
    return batch["input_ids"].new_tensor(batch["input_ids"].numel())
