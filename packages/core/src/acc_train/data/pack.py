"""Rows from examples: which span of the token stream each training row covers.

Every kept example is stored back to back in one token stream; ``starts`` holds where each one
begins (and, last, where the stream ends). A row is a contiguous span ``[start, end)`` of the
stream, at most ``seq_len`` tokens:

- ``text_rows``: the stream cut every ``seq_len`` tokens wherever the cut falls (pretraining
  documents, ``kind: text`` with packing); a last, shorter piece is left out.
- ``packed_rows``: whole examples, as many consecutive ones as fit (next-fit, which keeps the
  data's order and each row contiguous); the collator pads the rest of the row.
- ``best_fit``: best-fit decreasing (``data.packing: best_fit``): the order to write the examples
  in, so that each row of whole examples is contiguous again, and the rows' example counts.
- ``single_rows``: one example per row (no packing; padded per batch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["text_rows", "packed_rows", "single_rows", "best_fit", "rows_of", "inner_starts", "loss_tokens", "fill"]


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


def best_fit(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: the examples, longest first, each into the open row it fills the
    most (the least room left that still takes it), else a new row. Returns (the example
    indices row after row, each row's examples in their data order and the rows in the order
    of their first example, so that a held-out tail or an unshuffled epoch is not the shortest
    leftovers; each row's number of examples). A segment tree over the room left (0..seq_len) finds the row in O(log seq_len):
    a million examples take seconds."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > seq_len:
        raise ValueError("an example is longer than seq_len; truncate or drop it first")
    size = 1
    while size < seq_len + 1:
        size *= 2
    count = [0] * (2 * size)  # rows with exactly this much room left, summed up the tree
    waiting: dict[int, list[int]] = {}  # room left -> rows (their numbers) with that room

    def change(room: int, by: int) -> None:
        i = room + size
        while i:
            count[i] += by
            i //= 2

    def least_room_for(n: int) -> int:
        """The smallest room left >= n that some row has, or -1."""
        stack = [(1, 0, size - 1)]
        while stack:
            i, lo, hi = stack.pop()
            if hi < n or count[i] == 0:
                continue
            if lo == hi:
                return lo
            mid = (lo + hi) // 2
            stack.append((2 * i + 1, mid + 1, hi))  # the right half after the left: smaller room first
            stack.append((2 * i, lo, mid))
        return -1

    rows: list[list[int]] = []
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        room = least_room_for(n)
        if room < 0:
            rows.append([i])
            row, left = len(rows) - 1, seq_len - n
        else:
            row = waiting[room].pop()
            change(room, -1)
            rows[row].append(i)
            left = room - n
        waiting.setdefault(left, []).append(row)
        change(left, 1)
    rows.sort(key=min)  # rows in the order of their first example: the data's order, roughly (not longest first)
    order = np.asarray([i for row in rows for i in sorted(row)], dtype=np.int64)
    return order, np.asarray([len(row) for row in rows], dtype=np.int64)


def rows_of(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The ``[start, end)`` spans of rows of ``counts`` consecutive examples each."""
    cuts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    bounds = np.asarray(starts, dtype=np.int64)[cuts]
    return np.stack([bounds[:-1], bounds[1:]], axis=1) if len(counts) else np.zeros((0, 2), dtype=np.int64)


def fill(rows: Any, seq_len: int, chunk: int = 1 << 20) -> float | None:
    """Packing efficiency: the rows' real tokens over their ``seq_len`` slots (None: no rows).
    ``rows``: an array or a :class:`~acc_train.data.npyfile.NpyFile`, read ``chunk`` rows at a
    time so that the memory it takes does not grow with the corpus."""
    n = len(rows)
    if not n:
        return None
    real = 0
    for begin in range(0, n, chunk):
        part = np.asarray(rows[begin : begin + chunk], dtype=np.int64)
        real += int((part[:, 1] - part[:, 0]).sum())
    return real / (n * seq_len)


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
