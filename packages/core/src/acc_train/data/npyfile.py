"""Prepared arrays read from their ``.npy`` files with ``pread``, on demand.

A memory map would serve the same reads, but every page it touches counts in the process's
resident memory, with the kernel's fault-around (measured here: ~400 KB of RSS per random
row on a 2 GB token file whose pages were cached), so a rank reading random rows of a large
corpus would grow with it. ``pread`` copies only the bytes asked for; the page cache still
shares the file between ranks. The files are plain numpy ``.npy`` (no pickle) and can be
memory-mapped by anyone who prefers (``np.load(path, mmap_mode="r")``).
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["NpyFile"]


class NpyFile:
    """Rows ``[start, stop)`` (axis 0) of a C-ordered ``.npy`` array on disk.

    ``a[i]`` reads one row (a scalar for a 1-D array), ``a[i:j]`` reads those rows into an
    ndarray, :meth:`window` narrows the rows without reading, :meth:`searchsorted` finds a
    value in a sorted 1-D array with a binary search of single reads."""

    def __init__(self, path: Path, start: int = 0, stop: int | None = None) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            self._offset = f.tell()
        if fortran:
            raise ValueError(f"{path}: a Fortran-ordered array")
        self.dtype = np.dtype(dtype)
        self._shape = tuple(shape)
        self._row = self.dtype.itemsize * int(np.prod(self._shape[1:], dtype=np.int64))
        self.start = start
        self.stop = self._shape[0] if stop is None else stop
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "start": self.start, "stop": self.stop}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["start"], state["stop"])  # type: ignore[misc]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self._shape[1:])

    def __len__(self) -> int:
        return self.stop - self.start

    def _read(self, first: int, count: int) -> np.ndarray:
        raw = os.pread(self._fd, count * self._row, self._offset + (self.start + first) * self._row)
        return np.frombuffer(raw, dtype=self.dtype).reshape((count, *self._shape[1:]))

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            first, last, step = key.indices(len(self))
            if step != 1:
                raise IndexError("NpyFile reads contiguous rows only")
            return self._read(first, max(0, last - first))
        index = int(key)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        row = self._read(index, 1)[0]
        return row if row.ndim else row[()]

    def __iter__(self) -> Any:
        for begin in range(0, len(self), 65536):
            yield from self[begin : begin + 65536]

    def window(self, begin: int, end: int) -> NpyFile:
        begin, end, _ = slice(begin, end).indices(len(self))
        return NpyFile(self.path, self.start + begin, self.start + max(begin, end))

    def searchsorted(self, value: int, side: str = "left") -> int:
        find = bisect.bisect_right if side == "right" else bisect.bisect_left
        return find(self, value)
