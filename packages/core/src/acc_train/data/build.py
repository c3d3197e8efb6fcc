"""Tokenizing data files once: ``datasets`` loads them, ``datasets.map(batched=True,
num_proc=...)`` tokenizes them with the job's kind, and the kept examples are written back to
back into ``.npy`` arrays that every rank reads on demand (numpy's format: no pickle).

Files written for a split ``NAME`` into a directory:

    NAME.tokens.npy   uint16 or uint32 token ids (by the vocabulary's size)
    NAME.loss.npy     uint8, 1 where a token counts in the loss (absent: all do)
    NAME.starts.npy   int64, where each example starts, and the stream's end last
    NAME.rows.npy     int64 [rows, 2], each row's span of the stream
"""

from __future__ import annotations

import functools

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from acc_train.data import pack
from acc_train.data.files import infer_format, load_error
from acc_train.data.npyfile import NpyFile
from acc_train.data.rows import Split
from acc_train.errors import UserError

if TYPE_CHECKING:
    from acc_train.config import DataConfig
    from acc_train.contracts.data_kind import DataKind

__all__ = ["KEPT", "TRUNCATED", "DROPPED", "EMPTY", "token_dtype", "tokenize_files", "write_split", "open_split", "in_memory_split"]

#: an example's fate in the tokenized table (column ``fate``)
KEPT, TRUNCATED, DROPPED, EMPTY = 0, 1, 2, 3


def token_dtype(vocab: int) -> type:
    return np.uint16 if vocab <= 2**16 else np.uint32


def packing(cfg: DataConfig, kind: DataKind) -> bool | str:
    """``data.packing`` (``True``, ``False`` or ``"best_fit"``), or the kind's own default."""
    return kind.packs_by_default if cfg.packing is None else cfg.packing


def _tokenize(batch: dict[str, list[Any]], kind: DataKind, tokenizer: Any, cfg: DataConfig, limit: int | None) -> dict[str, list[Any]]:
    """``datasets.map`` function: the kind's tokens, cut to ``limit`` as ``data.overlong`` says,
    each example's fate recorded (dropped and empty ones keep a row, with no tokens, to be counted)."""
    out = kind.tokenize(batch, tokenizer, cfg)
    ids_out, loss_out, fates = [], [], []
    masks = out.get("loss_mask")
    # an empty loss_mask stands for "every token counts" (half the data to move and store)
    for ids, loss in zip(out["input_ids"], masks if masks is not None else [None] * len(out["input_ids"])):
        fate = KEPT
        if loss is not None and all(loss):
            loss = None
        if limit is not None and len(ids) > limit:
            if cfg.overlong == "drop":
                ids, loss, fate = [], None, DROPPED
            else:
                ids, loss, fate = ids[:limit], None if loss is None else loss[:limit], TRUNCATED
        if fate != DROPPED and (not ids or (loss is not None and not any(loss))):
            ids, loss, fate = [], None, EMPTY
        ids_out.append(ids)
        loss_out.append([] if loss is None else loss)
        fates.append(fate)
    return {"input_ids": ids_out, "loss_mask": loss_out, "fate": fates}


def tokenize_files(files: list[str], where: str, cfg: DataConfig, kind: DataKind, tokenizer: Any, work_dir: Path, num_proc: int) -> Any:
    """The files as a tokenized ``datasets.Dataset`` (columns ``input_ids``, ``loss_mask``,
    ``fate``), its Arrow files under ``work_dir``."""
    import datasets

    fmt = infer_format(files, cfg.format, where)
    log = logging.getLogger("datasets")
    level, log.level = log.level, logging.CRITICAL  # its error lines only repeat the one raised here
    try:
        ds = datasets.load_dataset(fmt, data_files=files, split="train", cache_dir=str(work_dir / "hf"))
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow's errors about the user's files
        raise load_error(files, fmt, exc, where) from None
    finally:
        log.setLevel(level)
    if fmt == "text" and cfg.text_field != "text" and kind.name == "text":
        ds = ds.rename_column("text", cfg.text_field)
    missing = [f for f in kind.fields(cfg) if f not in ds.column_names]
    if missing:
        raise UserError(
            f"data files {files[:3]} have no field {missing[0]!r} (fields: {ds.column_names})",
            where=where,
            hint=f"set data.{_field_key(cfg, missing[0])} to the column holding it",
        )
    limit = None if (kind.continuous and packing(cfg, kind)) else cfg.seq_len
    num_proc = max(1, min(num_proc, len(ds) // 1000))  # small files: one process, no start-up cost
    if num_proc > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism
    return ds.map(
        _tokenize,
        batched=True,
        batch_size=1000,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=ds.column_names,
        fn_kwargs={"kind": kind, "tokenizer": tokenizer, "cfg": cfg, "limit": limit},
        desc=f"tokenizing {where.removeprefix('data.')}",
    )


def _field_key(cfg: DataConfig, field: str) -> str:
    for key in ("text_field", "prompt_field", "completion_field", "messages_field"):
        if getattr(cfg, key) == field:
            return key
    return "kind"


def write_split(table: Any, name: str, directory: Path, dtype: type, make_rows: Any, best_fit: int | None = None) -> dict[str, Any]:
    """Write a tokenized table's kept examples as ``NAME.*.npy`` into ``directory``; its
    counts (``documents``, ``tokens``, ``loss_tokens``, ``truncated``, ``dropped``, ``empty``,
    ``rows``, ``max_token``). ``best_fit`` (a row's length): the examples are written in the
    order best-fit decreasing packs them (:func:`acc_train.data.pack.best_fit`), each row
    contiguous, and ``make_rows`` is not used."""
    from numpy.lib.format import open_memmap

    fates = np.asarray(table["fate"], dtype=np.int8)
    kept = np.flatnonzero(fates <= TRUNCATED)
    lengths = _lengths(table)
    lengths = lengths[kept]
    if best_fit is not None:
        order, per_row = pack.best_fit(lengths, best_fit)
        table = table.select(kept[order])  # every example kept, in row order
        lengths = lengths[order]
        make_rows = functools.partial(pack.rows_of, counts=per_row)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    total = int(starts[-1])
    tokens = open_memmap(directory / f"{name}.tokens.npy", mode="w+", dtype=dtype, shape=(total,))
    loss_path = directory / f"{name}.loss.npy"
    loss = open_memmap(loss_path, mode="w+", dtype=np.uint8, shape=(total,))
    at, top, all_count = 0, 0, True
    for batch in table.with_format("arrow").iter(batch_size=10_000):
        keep = pa_keep(batch)
        ids = batch.column("input_ids").filter(keep).combine_chunks()
        flat = ids.flatten().to_numpy(zero_copy_only=False) if len(ids) else np.zeros(0, dtype=np.int64)
        n = len(flat)
        if n:
            tokens[at : at + n] = flat
            flags = batch.column("loss_mask").filter(keep).combine_chunks()
            given = np.diff(flags.offsets.to_numpy()) > 0  # examples with flags; the others: all count
            if given.any():
                chunk = np.ones(n, dtype=np.uint8)
                chunk[np.repeat(given, np.diff(ids.offsets.to_numpy()))] = flags.flatten().to_numpy(zero_copy_only=False)
                loss[at : at + n] = chunk
                all_count = all_count and bool(chunk.all())
            else:
                loss[at : at + n] = 1
            top = max(top, int(flat.max()))
        at += n
    tokens.flush()
    loss.flush()
    del tokens, loss
    if all_count:
        loss_path.unlink()
    np.save(directory / f"{name}.starts.npy", starts)
    rows = make_rows(starts)
    np.save(directory / f"{name}.rows.npy", rows)
    split = open_split(directory, name, mapped=True)
    return {
        **_counts(fates),
        "tokens": total,
        "loss_tokens": pack.loss_tokens(rows, starts, split.loss),
        "rows": len(rows),
        "max_token": top,
    }


def pa_keep(batch: Any) -> Any:
    """The rows of an Arrow batch whose example is kept (whole or truncated)."""
    import pyarrow.compute as pc

    return pc.less_equal(batch.column("fate"), TRUNCATED)


def _lengths(table: Any) -> np.ndarray:
    out = []
    for batch in table.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=50_000):
        col = batch.column(0).combine_chunks()
        out.append(np.diff(col.offsets.to_numpy()))
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)


def _counts(fates: np.ndarray) -> dict[str, int]:
    return {
        "documents": int(np.count_nonzero(fates <= TRUNCATED)),
        "truncated": int(np.count_nonzero(fates == TRUNCATED)),
        "dropped": int(np.count_nonzero(fates == DROPPED)),
        "empty": int(np.count_nonzero(fates == EMPTY)),
    }


def open_split(directory: Path, name: str, mapped: bool = False) -> Split:
    """A written split, read on demand with ``pread`` (:class:`~acc_train.data.npyfile.NpyFile`:
    a rank's memory does not grow with what it reads), or memory-mapped read-only."""

    def array(file: str) -> Any:
        return np.load(directory / file, mmap_mode="r", allow_pickle=False) if mapped else NpyFile(directory / file)

    loss_file = directory / f"{name}.loss.npy"
    return Split(
        tokens=array(f"{name}.tokens.npy"),
        loss=array(f"{name}.loss.npy") if loss_file.exists() else None,
        starts=array(f"{name}.starts.npy"),
        rows=array(f"{name}.rows.npy"),
    )


def in_memory_split(ids: np.ndarray, seq_len: int) -> Split:
    """One document (the demo corpus) as a split of ``seq_len`` rows."""
    starts = np.asarray([0, len(ids)], dtype=np.int64)
    return Split(tokens=ids, loss=None, starts=starts, rows=pack.text_rows(len(ids), seq_len))
