"""The training text tokenized into fixed-length blocks (the demo corpus, or data files read
whole)."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.data.files import infer_format, load_error
from acc_train.errors import UserError

if TYPE_CHECKING:
    import torch

    from acc_train.config import DataConfig

__all__ = ["demo_text_bytes", "load_blocks", "BlockDataset"]


def demo_text_bytes(max_bytes: int) -> bytes:
    """The Python standard library's own sources, in a fixed order: a corpus every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)[:max_bytes]


def _texts(files: list[str], cfg: DataConfig, where: str) -> list[str]:
    import logging

    import datasets

    fmt = infer_format(files, cfg.format, where)
    log = logging.getLogger("datasets")
    level, log.level = log.level, logging.CRITICAL  # its error lines only repeat the one raised here
    try:
        ds = datasets.load_dataset(fmt, data_files=files, split="train")
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow's errors about the user's files
        raise load_error(files, fmt, exc, where) from None
    finally:
        log.setLevel(level)
    field = "text" if fmt == "text" else cfg.text_field
    if field not in ds.column_names:
        raise UserError(
            f"data has no field {field!r} (fields: {ds.column_names})",
            where="data.text_field",
            hint="set data.text_field to the column holding the text",
        )
    return [t for t in ds[field] if isinstance(t, str) and t]


def _encode(texts: list[str] | bytes, tokenizer: Any) -> list[int]:
    if tokenizer is None:  # byte-level: the demo model's vocabulary is the 256 byte values
        raw = texts if isinstance(texts, bytes) else "\n".join(texts).encode("utf-8")
        return list(raw)
    if isinstance(texts, bytes):
        texts = [texts.decode("utf-8", errors="replace")]
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    return ids


def _blocks(ids: list[int], seq_len: int) -> torch.Tensor:
    import torch

    n = len(ids) // seq_len
    if n == 0:
        raise UserError(
            f"the data holds {len(ids)} tokens, fewer than one block of data.seq_len={seq_len}",
            where="data",
            hint="add data or lower data.seq_len",
        )
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def load_blocks(cfg: DataConfig, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(train blocks, eval blocks or None), each ``[n, seq_len]`` of token ids."""
    source: list[str] | bytes = _texts(cfg.train_files, cfg, "data.train_files") if cfg.train_files else demo_text_bytes(cfg.demo_max_bytes)
    train = _blocks(_encode(source, tokenizer), cfg.seq_len)
    if cfg.eval_files:
        return train, _blocks(_encode(_texts(cfg.eval_files, cfg, "data.eval_files"), tokenizer), cfg.seq_len)
    if cfg.eval_fraction > 0 and len(train) > 1:
        n_eval = max(1, int(len(train) * cfg.eval_fraction))
        return train[:-n_eval], train[-n_eval:]
    return train, None


class BlockDataset:
    """Indexable blocks of token ids."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.blocks[i]


