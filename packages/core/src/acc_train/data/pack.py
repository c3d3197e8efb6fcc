"""Rows from examples: which span of the token stream each training row covers.

Every kept example is stored back to back in one token stream; ``starts`` holds where each one
begins (and, last, where the stream ends). A row is a contiguous span ``[start, end)`` of the
stream, at most ``seq_len`` tokens:

- ``text_rows``: the stream cut every ``seq_len`` tokens wherever the cut falls (pretraining
  documents, ``kind: text`` with packing); a last, shorter piece is left out.
- ``packed_rows``: whole examples, as many consecutive ones as fit (next-fit, which keeps the
  data's order and each row contiguous); the collator pads the rest of the row.
- ``single_rows``: one example per row (no packing; padded per batch).
"""

from __future__ import annotations

import numpy as np

__all__ = ["text_rows", "packed_rows", "single_rows", "inner_starts", "loss_tokens"]


def text_rows(n_tokens: int, seq_len: int) -> np.ndarray:
    n = n_tokens // seq_len
    begin = np.arange(n, dtype=np.int64) * seq_len
    return np.stack([begin, begin + seq_len], axis=1) if n else np.zeros((0, 2), dtype=np.int64)


def single_rows(starts: np.ndarray) -> np.ndarray:
    starts = np.asarray(starts, dtype=np.int64)
    return np.stack([starts[:-1], starts[1:]], axis=1)


def packed_rows(starts: np.ndarray, seq_len: int) -> np.ndarray:
    """Next-fit packing of the examples (each at most ``seq_len`` long) into rows."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.diff(starts)
    if len(lengths) and int(lengths.max()) > seq_len:
        raise ValueError("an example is longer than seq_len; truncate or drop it first")
    cuts = [0]
    fill = 0
    for i, n in enumerate(lengths.tolist()):
        if fill + n > seq_len:
            cuts.append(i)
            fill = 0
        fill += n
    cuts.append(len(lengths))
    bounds = starts[np.asarray(cuts, dtype=np.int64)]
    rows = np.stack([bounds[:-1], bounds[1:]], axis=1)
    return rows[rows[:, 1] > rows[:, 0]]


def inner_starts(starts: np.ndarray, begin: int, end: int) -> np.ndarray:
    """The example starts strictly inside ``(begin, end)``: where a row's position ids restart
    and whose token is not predicted from the example before it."""
    lo = int(starts.searchsorted(begin, side="right"))  # (an ndarray, or a NpyFile read on demand)
    hi = int(starts.searchsorted(end, side="left"))
    return np.asarray(starts[lo:hi], dtype=np.int64)


def loss_tokens(rows: np.ndarray, starts: np.ndarray, loss: np.ndarray | None) -> int:
    """Tokens of the rows that count in the loss: loss-flagged tokens, less those at an example
    start inside a row (their label is masked: predicting an example's first token from the
    example before it is not learning anything). Rows are sorted, contiguous spans."""
    if len(rows) == 0:
        return 0
    begin, end = int(rows[0, 0]), int(rows[-1, 1])
    counted = (end - begin) if loss is None else int(np.count_nonzero(loss[begin:end]))
    inner = inner_starts(starts, begin, end)
    inner = inner[~np.isin(inner, rows[:, 0])]  # an example starting a row is not "inside" it
    if loss is not None and len(inner):
        return counted - int(np.count_nonzero(loss[inner]))
    return counted - len(inner)
