"""Training data: text from the demo corpus or data files, tokenized into fixed-length blocks,
read in an order that depends only on (seed, epoch), so a run can resume mid-epoch exactly."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.errors import UserError

if TYPE_CHECKING:
    import torch

    from acc_train.config import DataConfig

__all__ = ["demo_text_bytes", "load_blocks", "ResumableSampler", "BlockDataset", "infer_format"]

FORMATS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}


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


def infer_format(files: list[str], fmt: str, where: str) -> str:
    if fmt != "auto":
        return "json" if fmt == "jsonl" else fmt
    kinds = {FORMATS.get(Path(f).suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise UserError(
            f"cannot tell the format of {files}",
            where=where,
            hint="name files .json/.jsonl/.txt/.parquet, or set data.format",
        )
    return kinds.pop()  # type: ignore[return-value]


def check_data_files(cfg: DataConfig) -> None:
    """Fail before launch on missing data files (no torch needed)."""
    for key in ("train_files", "eval_files"):
        files = getattr(cfg, key)
        for f in files:
            if not Path(f).is_file():
                raise UserError(f"data file {f!r} does not exist", where=f"data.{key}", hint="check the path")
        if files:
            infer_format(files, cfg.format, f"data.{key}")


def _texts(files: list[str], cfg: DataConfig, where: str) -> list[str]:
    import datasets

    fmt = infer_format(files, cfg.format, where)
    ds = datasets.load_dataset(fmt, data_files=files, split="train")
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


class ResumableSampler:
    """Indices in an order fixed by (seed, epoch), that can start part-way through an epoch.

    Accelerate shards the batches this produces round-robin across ranks. The epoch is cut to a
    whole number of optimizer steps on every rank (``group`` = ranks x micro-batch x accumulation),
    so every rank sees the same number of batches and an epoch never ends mid-step; starting at
    ``batches_done * world_size * micro_batch`` then gives each rank exactly the batches it would
    have seen next.
    """

    def __init__(self, num_items: int, seed: int, shuffle: bool, group: int) -> None:
        if num_items < group:
            raise UserError(
                f"the training data has {num_items} blocks, fewer than one optimizer step needs ({group}: processes x micro-batch x accumulation)",
                where="data",
                hint="add data, or lower training.micro_batch_size / gradient_accumulation_steps / data.seq_len",
            )
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.usable = num_items - num_items % group
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, start: int) -> None:
        self.start = start

    def _order(self) -> list[int]:
        import torch

        if not self.shuffle:
            return list(range(self.usable))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_items, generator=g)[: self.usable].tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        start, self.start = self.start, 0  # a skip applies to one pass only
        return iter(order[start:])

    def __len__(self) -> int:
        return self.usable - self.start
