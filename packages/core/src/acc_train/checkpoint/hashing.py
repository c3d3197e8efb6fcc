"""How a checkpoint's files are hashed, shared by the ranks: each hashes what it wrote (as it
writes the portable state, :class:`StreamHashes`; its rank's named files right after its writes,
:func:`hash_rank_files`) and an even share of the rest (:func:`assign_files`); rank 0 merges the
tables (:func:`merge_tables`). One process alone hashes everything (:func:`file_table`)."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST",
    "sha256",
    "hash_files",
    "list_files",
    "file_table",
    "EarlyHashes",
    "hash_rank_files",
    "unchanged",
    "StreamHashes",
    "writer_rank",
    "assign_files",
    "merge_tables",
    "from_every_rank",
    "from_rank0",
]

#: the manifest's file name: the one file of a checkpoint it does not list
MANIFEST = "manifest.json"

#: names that say which rank wrote a file: acc-train's ``...-rank00001...`` files, and DCP's
#: ``shard-00002-...`` (its shard index is the rank plus one)
_RANK_NAMES = ((re.compile(r"rank(\d{5})(?!\d)"), 0), (re.compile(r"(?:^|/)shard-(\d{5})-"), 1))


def _hash_entry(path: Path) -> dict[str, Any]:
    """``{size, sha256}`` of one file, the size being the bytes hashed (one read, 1 MiB chunks)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def sha256(path: Path) -> str:
    """The sha256 of a file's content, read in 1 MiB chunks."""
    return str(_hash_entry(path)["sha256"])


def hash_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {size, sha256}}`` for the given files under ``directory``."""
    return {name: _hash_entry(directory / name) for name in names}


#: files a rank hashed right after writing them: name -> ((size, mtime_ns) when hashed, entry)
EarlyHashes = dict[str, tuple[tuple[int, int], dict[str, Any]]]


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def hash_rank_files(directory: Path, rank: int, skip: Collection[str] = ()) -> EarlyHashes:
    """Hash the files named by ``rank`` (:func:`writer_rank`) right after its own writes, while
    they are in the page cache (other ranks may still be writing theirs), less ``skip``."""
    out: EarlyHashes = {}
    for name in list_files(directory):
        if writer_rank(name) == rank and name not in skip:
            before = _stamp(directory / name)
            entry = _hash_entry(directory / name)
            if _stamp(directory / name) == before:
                out[name] = (before, entry)
    return out


def unchanged(directory: Path, early: EarlyHashes, listing: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """The entries of ``early`` whose file is listed and unchanged since it was hashed."""
    return {name: entry for name, (stamp, entry) in early.items() if name in listing and _stamp(directory / name) == stamp}


class StreamHashes:
    """Files hashed as they are written: :meth:`recording` makes every storage writer of the
    portable state created meanwhile (:func:`~acc_train.checkpoint.portable.write_portable_state`,
    also in an asynchronous save's background writes) feed each write to sha256 in a thread
    beside it, so hashing overlaps the write instead of following it. A stream that seeks or
    fails records nothing (its file is hashed afterwards); :func:`hash_share` rechecks stamps."""

    _active: StreamHashes | None = None

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        self.entries: EarlyHashes = {}
        self._lock = threading.Lock()

    @classmethod
    @contextmanager
    def recording(cls, root: Path) -> Iterator[StreamHashes]:
        cls._active = hashes = cls(root)
        try:
            yield hashes
        finally:
            cls._active = None

    @classmethod
    def wrap_active(cls, fs: Any) -> Any:
        """``fs`` (DCP's file system object), hashing what it writes if a recording is active."""
        return fs if cls._active is None else _HashingFileSystem(fs, cls._active)

    def add(self, path: Path, entry: dict[str, Any]) -> None:
        if path.is_relative_to(self.root):
            with self._lock:
                self.entries[path.relative_to(self.root).as_posix()] = (_stamp(path), entry)


class _HashingStream:
    """A write stream that hashes, in a thread of its own, each write while it is written."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._sha = hashlib.sha256()
        self._size = 0
        self._sequential = True
        self._pool = ThreadPoolExecutor(1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def write(self, data: Any) -> Any:
        chunk = data if isinstance(data, bytes) else bytes(data)  # the writer may reuse its buffer
        self._size += len(chunk)
        self._pool.submit(self._sha.update, chunk)  # hashlib lets go of the GIL, as the write does
        written = self._stream.write(chunk)
        if written is not None and written != len(chunk):  # a short write: the caller writes the rest again
            self._sequential = False
        return written

    def seek(self, *args: Any) -> int:
        self._sequential = False
        return int(self._stream.seek(*args))

    def result(self) -> dict[str, Any] | None:
        self._pool.shutdown(wait=True)
        return {"size": self._size, "sha256": self._sha.hexdigest()} if self._sequential else None


class _HashingFileSystem:
    def __init__(self, fs: Any, hashes: StreamHashes) -> None:
        self._fs = fs
        self._hashes = hashes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode or "b" not in mode or "+" in mode:  # binary writes only
            with self._fs.create_stream(path, mode) as stream:
                yield stream
            return
        with self._fs.create_stream(path, mode) as stream:
            hashing = _HashingStream(stream)
            try:
                yield hashing
            finally:
                entry = hashing.result()
        # reached only when the writer closed the stream without an error
        if entry is not None and Path(path).stat().st_size == entry["size"]:
            self._hashes.add(Path(path).resolve(), entry)


def list_files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (relative path -> size), the manifest itself excepted."""
    out = {}
    for p in sorted(directory.rglob("*")):
        name = p.relative_to(directory).as_posix()
        try:
            if p.is_file() and name != MANIFEST:
                out[name] = p.stat().st_size
        except FileNotFoundError:  # removed since listed (another rank's temporary file)
            continue
    return out


def file_table(directory: Path) -> dict[str, dict[str, Any]]:
    """The manifest's ``files`` in one process: every file under ``directory`` by relative
    path, with its size and sha256."""
    return hash_files(directory, list_files(directory))


def writer_rank(name: str) -> int | None:
    """The rank whose name a file carries (the rank that writes and reads it), or None."""
    for pattern, offset in _RANK_NAMES:
        match = pattern.search(name)
        if match:
            return int(match.group(1)) - offset
    return None


def assign_files(sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Which rank hashes which file, the same on every rank: a file named by a rank of this
    world goes to that rank (it wrote it, or reads it back); the others are spread so every
    rank hashes about as many bytes (largest first, to the least loaded)."""
    shares: list[list[str]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    rest = []
    for name in sorted(sizes):
        rank = writer_rank(name)
        if rank is not None and 0 <= rank < world_size:
            shares[rank].append(name)
            load[rank] += sizes[name]
        else:
            rest.append(name)
    for name in sorted(rest, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += sizes[name]
    return shares


def merge_tables(tables: Iterable[Mapping[str, Mapping[str, Any]]], listing: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """The manifest's ``files``, from the ranks' tables: every file of ``listing`` hashed,
    nothing else, and at the size it was listed with (else a file changed during the save)."""
    files: dict[str, dict[str, Any]] = {}
    problems = []
    for table in tables:
        for name, entry in table.items():
            if name in files and files[name] != dict(entry):
                problems.append(f"{name}: hashed twice with different results")
            files[name] = dict(entry)
    problems += [f"{name}: not hashed by any rank" for name in listing if name not in files]
    problems += [f"{name}: hashed but not in the checkpoint" for name in files if name not in listing]
    problems += [
        f"{name}: {files[name]['size']} bytes hashed, {size} listed" for name, size in listing.items() if name in files and files[name]["size"] != size
    ]
    if problems:
        raise RuntimeError("checkpoint files changed while they were being committed:\n  " + "\n  ".join(problems[:8]))
    return {name: files[name] for name in sorted(files)}


def from_every_rank(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj``, on every rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
