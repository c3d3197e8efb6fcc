"""The order training rows are read in: fixed by (seed, epoch), able to start part-way
through an epoch, so a run resumes exactly."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from acc_train.errors import UserError

if TYPE_CHECKING:
    import torch

__all__ = ["ResumableSampler"]


class ResumableSampler:
    """Indices in an order fixed by (seed, epoch), that can start part-way through an epoch.

    Accelerate shards the batches this produces round-robin across ranks. The epoch is cut to a
    whole number of optimizer steps on every rank (``group`` = ranks x micro-batch x accumulation),
    so every rank sees the same number of batches and an epoch never ends mid-step; starting at
    ``batches_done * world_size * micro_batch`` then gives each rank exactly the batches it would
    have seen next.
    """

    def __init__(self, num_items: int, seed: int, shuffle: bool, group: int, part: tuple[int, int, int] = (0, 1, 0)) -> None:
        if num_items < group:
            raise UserError(
                f"the training data has {num_items} rows, fewer than one optimizer step needs ({group}: processes x micro-batch x accumulation)",
                where="data",
                hint="add data, or lower training.micro_batch_size / gradient_accumulation_steps / data.seq_len",
            )
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self.usable = num_items - num_items % group
        self.epoch = 0
        self.start = 0
        #: (index, count, chunk): several launches share the order (``Strategy.data_part``), each
        #: reading part ``index`` of every ``count`` x ``chunk`` indices; ``start`` counts them all
        self.part = part

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, start: int) -> None:
        self.start = start

    def _order(self) -> torch.Tensor:
        import torch

        if not self.shuffle:
            return torch.arange(self.usable)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_items, generator=g)[: self.usable]

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        start, self.start = self.start, 0  # a skip applies to one pass only
        order = order[start:]
        index, count, chunk = self.part
        if count > 1:
            order = order.reshape(-1, count, chunk)[:, index].reshape(-1)
        return _in_chunks(order)

    def __len__(self) -> int:
        return (self.usable - self.start) // self.part[1]


def _in_chunks(order: torch.Tensor) -> Iterator[int]:
    """The indices one by one, converted 65,536 at a time: a list of every index of a large
    corpus would cost more memory than its rows."""
    for chunk in order.split(1 << 16):
        yield from chunk.tolist()
