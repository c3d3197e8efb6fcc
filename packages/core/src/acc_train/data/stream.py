"""Streamed training data (``data.streaming: true``): the files read as a ``datasets`` stream,
split across ranks, tokenized and packed on the fly, with a position a checkpoint can hold.

Rows are the cached path's, made the same way (:mod:`acc_train.data.pack`): ``text`` with
packing cuts the documents' token stream every ``seq_len`` tokens; other kinds with packing
pack whole examples next-fit; without packing each example is its own row. A stream never
ends: when a rank's share of the files is used up it starts the next pass (the last, shorter
piece of ``text`` is left out, as the cached path leaves it out).

Each rank reads its own share (``datasets.distributed.split_dataset_by_node``: whole files when
their number divides the world size, else every world-size-th example). With ``data.shuffle``
every pass reads the files in another order, seeded by ``training.seed`` and the pass
(``ds.shuffle(seed, buffer_size=1)`` + ``set_epoch(pass)``: datasets reads up to 10 files
alternately). There is no shuffle buffer of examples: its content is not in datasets'
``state_dict``, and a resumed run would not read what the uninterrupted one read.

The position after the last row handed out (:class:`StreamPosition`) is small: the pass,
datasets' ``state_dict`` at the start of the current read of :data:`READ_SIZE` examples, how
many of them are used up, and how many tokens of the next one a row already took. A resumed
rank reads that batch again, tokenizes it again and continues exactly; no token is stored.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import IterableDataset

from acc_train.data.build import DROPPED, EMPTY, KEPT, TRUNCATED, _field_key, _tokenize, packing
from acc_train.data.files import infer_format, load_error
from acc_train.data.rows import IGNORE_INDEX, token_row
from acc_train.errors import UserError

if TYPE_CHECKING:
    from acc_train.config import DataConfig
    from acc_train.contracts.data_kind import DataKind

__all__ = ["READ_SIZE", "STATE_VERSION", "COUNTS", "StreamPosition", "StreamRows", "DeviceBatches", "StreamedData", "first_rows"]

#: examples read and tokenized together (a resumed rank reads at most this many again)
READ_SIZE = 256
#: bumped when the meaning of a saved position changes
STATE_VERSION = 1
#: what a stream counts (run.json's ``data`` section, summed over ranks)
COUNTS = ("documents", "tokens", "loss_tokens", "truncated", "dropped", "empty", "rows")


@dataclass
class StreamPosition:
    """Where a rank stands after the last row it handed out (JSON)."""

    #: passes over the rank's share completed before this one
    pass_number: int = 0
    #: datasets' ``state_dict`` at the start of the current read (None: the pass's start)
    source: dict[str, Any] | None = None
    #: examples of the current read used up
    taken: int = 0
    #: tokens of the next example already in rows (a ``text`` document cut between rows)
    offset: int = 0

    def at_start(self) -> bool:
        return self.source is None and self.taken == 0 and self.offset == 0


def _no_buffer_warning(record: logging.LogRecord) -> bool:
    """datasets warns that a shuffle buffer's content is lost on every resume; with
    ``buffer_size=1`` there is none (the buffer is empty after every example)."""
    return not record.getMessage().startswith("Loading a state dict of a shuffle buffer")


class StreamRows(IterableDataset):  # type: ignore[type-arg]
    """One rank's rows of a stream, as dicts like :class:`acc_train.data.rows.TokenRows`
    gives. Iterating continues from :attr:`position` (a fresh stream's start, or what
    :meth:`load_state_dict` set); with ``passes`` (eval) it stops after that many."""

    def __init__(
        self, files: list[str], where: str, cfg: DataConfig, kind: DataKind, tokenizer: Any,
        rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = False, passes: int | None = None,
    ) -> None:  # fmt: skip
        self.files, self.where, self.cfg, self.kind, self.tokenizer = files, where, cfg, kind, tokenizer
        self.rank, self.world_size, self.seed, self.shuffle, self.passes = rank, world_size, seed, shuffle, passes
        self.format = infer_format(files, cfg.format, where)
        self.packing = packing(cfg, kind)
        self.mode = "single" if not self.packing else ("text" if kind.continuous else "packed")
        #: examples longer than this are truncated or dropped (None: ``text`` rows cut anywhere)
        self.limit = None if self.mode == "text" else cfg.seq_len
        self.position = StreamPosition()
        #: what this run's rows were made of (see :data:`COUNTS`)
        self.counts = dict.fromkeys(COUNTS, 0)
        #: the model's vocabulary size, once known: a larger token id is refused
        self.vocab_size: int | None = None
        self._base: Any = None

    # -- the position, for checkpoints ----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "rank": self.rank, "world_size": self.world_size, **asdict(self.position)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or state.get("world_size") != self.world_size or state.get("rank") != self.rank:
            raise UserError(
                f"the checkpoint's stream position is rank {state.get('rank')} of {state.get('world_size')} (version {state.get('version')}); this is rank {self.rank} of {self.world_size}",
                where="--num-processes",
                hint="resume a streamed run with the number of processes that wrote it",
            )
        self.position = StreamPosition(**{k: state[k] for k in StreamPosition.__dataclass_fields__})

    # -- reading --------------------------------------------------------------------------

    def _source(self, pass_number: int) -> Any:
        """The rank's share of the files for one pass, as a ``datasets`` stream."""
        import datasets
        from datasets.distributed import split_dataset_by_node

        if self._base is None:
            logging.getLogger("datasets.iterable_dataset").addFilter(_no_buffer_warning)
            try:
                self._base = datasets.load_dataset(self.format, data_files=self.files, split="train", streaming=True)
            except Exception as exc:  # noqa: BLE001 - datasets' errors about the user's files
                raise load_error(self.files, self.format, exc, self.where) from None
            if self.format == "text" and self.cfg.text_field != "text" and self.kind.name == "text":
                self._base = self._base.rename_column("text", self.cfg.text_field)
        ds = self._base.shuffle(seed=self.seed, buffer_size=1) if self.shuffle else self._base
        ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world_size)
        if self.shuffle:
            ds.set_epoch(pass_number)  # on the split stream: split_dataset_by_node does not keep it
        return ds

    def _reads(self, position: StreamPosition) -> Iterator[tuple[dict[str, Any] | None, dict[str, list[Any]]]]:
        """(datasets' state before the read, the read's examples tokenized) for the rest of a pass."""
        ds = self._source(position.pass_number)
        if position.source is not None:
            ds.load_state_dict(position.source)
        examples = iter(ds)
        before = position.source
        fields = self.kind.fields(self.cfg)
        while True:
            try:
                read = list(itertools.islice(examples, READ_SIZE))
            except Exception as exc:  # noqa: BLE001 - a broken line, a file that is not what it says
                raise load_error(self.files, self.format, exc, self.where) from None
            if not read:
                return
            after = ds.state_dict()
            missing = [f for f in fields if all(f not in ex for ex in read)]
            if missing:
                raise UserError(
                    f"data files {self.files[:3]} have no field {missing[0]!r} (fields: {sorted(read[0])})",
                    where=self.where,
                    hint=f"set data.{_field_key(self.cfg, missing[0])} to the column holding it",
                )
            columns = {f: [ex.get(f) for ex in read] for f in fields}
            yield before, _tokenize(columns, self.kind, self.tokenizer, self.cfg, self.limit)
            before = after

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        passes = 0
        while self.passes is None or passes < self.passes:
            from_start, rows = self.position.at_start(), 0
            for row in self._pass():
                rows += 1
                yield row
            passes += 1
            if rows == 0 and from_start:
                raise UserError(
                    f"rank {self.rank}'s share of {self.where} gives no row of data.seq_len={self.cfg.seq_len} tokens "
                    f"({self.counts['documents']} examples read, {self.counts['dropped']} dropped as overlong, {self.counts['empty']} empty)",
                    where="data.streaming",
                    hint="add data (at least one file per process is best), lower data.seq_len, or use fewer processes",
                )

    def _pass(self) -> Iterator[dict[str, np.ndarray]]:
        """The rows of the rest of the current pass; :attr:`position` is kept after each row."""
        start = self.position
        seq_len = self.cfg.seq_len
        ids: list[int] = []
        loss: list[int] = []
        starts: list[int] = []
        for first, (source, batch) in enumerate(self._reads(start)):
            self._check_vocab(batch)
            begin = start.taken if first == 0 else 0
            for i in range(begin, len(batch["input_ids"])):
                example, flags, fate = batch["input_ids"][i], batch["loss_mask"][i], batch["fate"][i]
                flags = flags or [1] * len(example)  # an empty mask: every token counts
                offset = start.offset if (first == 0 and i == begin) else 0
                kept = fate in (KEPT, TRUNCATED)
                if kept and self.mode == "packed" and ids and len(ids) + len(example) > seq_len:  # next-fit
                    self.position = StreamPosition(start.pass_number, source, i, 0)
                    yield self._row(ids, loss, starts)
                    ids, loss, starts = [], [], []
                if offset == 0:  # (a document a row already began was counted when it began)
                    self._count(fate, len(example))
                if not kept:
                    continue
                if offset == 0:
                    starts.append(len(ids))
                if self.mode != "text":
                    ids, loss = ids + example, loss + flags
                    if self.mode == "single":
                        self.position = StreamPosition(start.pass_number, source, i + 1, 0)
                        yield self._row(ids, loss, starts)
                        ids, loss, starts = [], [], []
                    continue
                while offset < len(example):  # text: fill the row, cut it wherever seq_len falls
                    take = min(seq_len - len(ids), len(example) - offset)
                    ids, loss = ids + example[offset : offset + take], loss + flags[offset : offset + take]
                    offset += take
                    if len(ids) == seq_len:
                        done = offset == len(example)
                        self.position = StreamPosition(start.pass_number, source, i + 1 if done else i, 0 if done else offset)
                        yield self._row(ids, loss, starts)
                        ids, loss, starts = [], [], []
        self.position = StreamPosition(start.pass_number + 1)
        if ids and self.mode == "packed":  # the last row of the pass (text's shorter piece is left out)
            yield self._row(ids, loss, starts)

    def _row(self, ids: list[int], loss: list[int], starts: list[int]) -> dict[str, np.ndarray]:
        flags = np.asarray(loss, dtype=np.uint8)
        row = token_row(np.asarray(ids, dtype=np.int64), flags, np.asarray([s for s in starts if s > 0], dtype=np.int64))
        self.counts["rows"] += 1
        self.counts["loss_tokens"] += int(np.count_nonzero(row["labels"] != IGNORE_INDEX))
        return row

    def _count(self, fate: int, n_tokens: int) -> None:
        if fate in (KEPT, TRUNCATED):
            self.counts["documents"] += 1
            self.counts["tokens"] += n_tokens
        key = {TRUNCATED: "truncated", DROPPED: "dropped", EMPTY: "empty"}.get(fate)
        if key:
            self.counts[key] += 1

    def _check_vocab(self, batch: dict[str, list[Any]]) -> None:
        if self.vocab_size is None:
            return
        top = max((max(x) for x in batch["input_ids"] if x), default=-1)
        if top >= self.vocab_size:
            raise UserError(
                f"the data holds token id {top}, but the model's vocab_size is {self.vocab_size}",
                where="model",
                hint="use the tokenizer that belongs to the model",
            )


def first_rows(files: list[str], where: str, cfg: DataConfig, kind: DataKind, tokenizer: Any, limit: int) -> list[dict[str, np.ndarray]]:
    """The first ``limit`` rows of one pass over the files, unsplit and in file order (eval)."""
    return list(itertools.islice(StreamRows(files, where, cfg, kind, tokenizer, passes=1), limit))


class DeviceBatches:
    """A loader's batches moved to ``device``: a streamed loader is not passed through
    ``accelerator.prepare``, which would read the stream on rank 0 and dispatch its batches,
    and read one batch ahead of the position a checkpoint saves."""

    def __init__(self, loader: Any, device: Any) -> None:
        self.loader, self.device = loader, device

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from accelerate.utils import send_to_device

        for batch in self.loader:
            yield send_to_device(batch, self.device)


@dataclass
class StreamedData:
    """What ``run.json``'s ``data`` section says of a streamed run: no cache, and counts of what
    this run's rows were made of, summed over ranks."""

    kind: str
    packing: bool
    stream: StreamRows

    def summary(self) -> dict[str, Any]:
        """Collective: every rank calls it (each has its own stream's counts)."""
        from accelerate.utils import gather_object

        every = gather_object([self.stream.counts])
        return {"kind": self.kind, "packing": self.packing, "packing_efficiency": None, "streaming": True, **{k: sum(c[k] for c in every) for k in COUNTS}, "cache": {"status": "none"}}
