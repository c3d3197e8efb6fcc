"""Training data: text from the demo corpus or data files, tokenized into fixed-length blocks,
read in an order that depends only on (seed, epoch), so a run can resume mid-epoch exactly."""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.errors import UserError
from acc_train.user_files import read_user_text

if TYPE_CHECKING:
    import torch

    from acc_train.config import DataConfig

__all__ = ["demo_text_bytes", "load_blocks", "ResumableSampler", "BlockDataset", "infer_format", "check_data_files", "CHECK_BYTES"]

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


#: data files up to this size are read whole before launch (UTF-8, every JSON line); larger ones
#: are checked by the workers, whose ``datasets`` errors name the file too
CHECK_BYTES = 64 * 2**20


def check_data_files(cfg: DataConfig) -> None:
    """Fail before launch on data files that cannot load: missing, a directory, empty, not
    UTF-8, a broken JSON line (named by its line number), not parquet, no ``data.text_field``.
    Needs no torch; files over :data:`CHECK_BYTES` get only the cheap checks."""
    for key in ("train_files", "eval_files"):
        files, where = getattr(cfg, key), f"data.{key}"
        for f in files:
            if Path(f).is_dir():
                raise UserError(f"data file {f!r} is a directory", where=where, hint="list the files in it (data files are json, jsonl, txt or parquet)")
            if not Path(f).is_file():
                raise UserError(f"data file {f!r} does not exist", where=where, hint="check the path")
        if files:
            fmt = infer_format(files, cfg.format, where)
            for f in files:
                _check_file(Path(f), fmt, cfg.text_field, where)


def _check_file(path: Path, fmt: str, text_field: str, where: str) -> None:
    def refuse(problem: str, hint: str | None = None, at: str = where) -> UserError:
        return UserError(f"data file {str(path)!r} {problem}", where=at, hint=hint)

    size = path.stat().st_size
    if size == 0:
        raise refuse("is empty", "give a file holding the training text")
    if fmt == "parquet":
        with path.open("rb") as fh:
            head = fh.read(4)
            fh.seek(max(0, size - 4))
            tail = fh.read(4)
        if size < 12 or head != b"PAR1" or tail != b"PAR1":
            raise refuse("is not a parquet file (no PAR1 magic bytes at its start and end)", "check the file, or set data.format to its real format")
        return
    if size > CHECK_BYTES:
        return
    text = read_user_text(path, what="data file", where=where)
    if not text.strip():
        raise refuse("holds only blank lines", "give a file holding the training text")
    if fmt == "json":
        rows = _json_rows(path, text, where)
        if not any(isinstance(row.get(text_field), str) for row in rows):
            fields = sorted({k for row in rows for k in row})[:12]
            raise refuse(f"has no row with a text field {text_field!r} (fields: {fields})", "set data.text_field to the column holding the text", "data.text_field")


def _json_rows(path: Path, text: str, where: str) -> list[dict[str, Any]]:
    """The rows of a JSON Lines file, or of a file holding one JSON list of objects (both are
    what ``datasets``' json loader reads); the first line that is neither is a UserError."""
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:
            problem = f"is not JSON ({exc.msg if isinstance(exc, json.JSONDecodeError) else 'nested too deeply'})"
        else:
            if isinstance(row, dict):
                rows.append(row)
                continue
            problem = f"is a JSON {type(row).__name__}, not an object (one row of data)"
        try:  # a single JSON document, e.g. a list of rows over many lines
            whole = json.loads(text)
        except (ValueError, RecursionError):
            whole = None
        if isinstance(whole, list) and whole and all(isinstance(r, dict) for r in whole):
            return whole
        raise UserError(
            f"data file {str(path)!r}, line {number}: {problem}",
            where=where,
            hint="every line of a .jsonl file is one JSON object, e.g. {\"text\": \"...\"}",
        )
    return rows


def _texts(files: list[str], cfg: DataConfig, where: str) -> list[str]:
    import logging

    import datasets

    fmt = infer_format(files, cfg.format, where)
    log = logging.getLogger("datasets")
    level, log.level = log.level, logging.CRITICAL  # its error lines only repeat the one raised here
    try:
        ds = datasets.load_dataset(fmt, data_files=files, split="train")
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow's errors about the user's files
        raise _load_error(files, fmt, exc, where) from None
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


def _load_error(files: list[str], fmt: str, exc: BaseException, where: str) -> UserError:
    """A ``datasets`` failure as one message: the files and the first cause that says what is
    wrong (``DatasetGenerationError`` itself only says that something was)."""
    causes: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in causes:
        causes.append(seen)
        seen = seen.__cause__ or seen.__context__
    useful = [c for c in causes if type(c).__name__ != "DatasetGenerationError" and str(c).strip()]
    detail = (str(useful[0]).strip().splitlines() or [""])[0] if useful else type(exc).__name__
    named = repr(files[0]) if len(files) == 1 else f"{len(files)} files ({', '.join(files[:3])}{', ...' if len(files) > 3 else ''})"
    return UserError(
        f"cannot read data file {named} as {fmt}: {detail}",
        where=where,
        hint="check the file (every .jsonl line one JSON object; .txt UTF-8 text; .parquet a parquet file) or set data.format",
    )


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
