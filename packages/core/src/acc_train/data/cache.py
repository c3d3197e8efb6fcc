"""Prepared data: tokenized once per machine into a cache keyed by a fingerprint of everything
the tokens depend on, read on demand by every rank at every later launch, restart and resume.

The cache lives in ``data.cache_dir`` (default ``$XDG_CACHE_HOME/acc-train/data``, that is
``~/.cache/acc-train/data``), one directory per fingerprint::

    <fingerprint>/meta.json          what was prepared from what, and its counts
    <fingerprint>/train.*.npy        (see acc_train.data.build)
    <fingerprint>/eval.*.npy         when data.eval_files are given

The fingerprint covers each data file's absolute path, size and modification time, the file
format, the kind and its fields, ``seq_len``, packing, ``overlong`` and the tokenizer (its
vocabulary and rules, special tokens and chat template). A directory is built under a fresh
temporary name and renamed into place, so a cache entry is always whole; when two machines
sharing the directory build the same entry, the first rename wins and the other is discarded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from acc_train.data import build, pack
from acc_train.data.files import data_kind
from acc_train.data.rows import Split
from acc_train.errors import UserError
from acc_train.files.output_paths import replace_file

if TYPE_CHECKING:
    from acc_train.config import DataConfig
    from acc_train.contracts.data_kind import DataKind

__all__ = ["FORMAT_VERSION", "PreparedData", "cache_root", "fingerprint", "prepare_data", "demo_data"]

#: bumped whenever what is written changes meaning
FORMAT_VERSION = 1


@dataclass
class PreparedData:
    """The job's data, ready to read: the training split, the eval split (or None), and what
    ``run.json`` reports about them."""

    train: Split
    eval: Split | None
    kind: str
    packing: bool | str
    #: counts of the training split (documents, tokens, loss_tokens, truncated, dropped, empty, rows)
    #: and its packing_efficiency, as meta.json records them
    counts: dict[str, Any]
    max_token: int
    #: "hit", "built" or "none" (the demo corpus is made in memory)
    cache: str = "none"
    path: str | None = None
    fingerprint: str | None = None
    eval_counts: dict[str, int] = field(default_factory=dict)

    #: rows of the training split are at most this many tokens
    seq_len: int | None = None

    def packing_efficiency(self) -> float | None:
        """Packed rows' real tokens over their ``seq_len`` slots (None: rows not packed). Read
        from the cache entry's ``meta.json``, where it is computed once when the entry is built:
        a worker that summarises its data reads nothing that grows with the corpus."""
        if not self.packing or self.seq_len is None:
            return None
        if "packing_efficiency" in self.counts:
            return self.counts["packing_efficiency"]
        return pack.fill(self.train.rows, self.seq_len)  # (a read-only entry built before: bounded reads)

    def summary(self) -> dict[str, Any]:
        efficiency = self.packing_efficiency()
        return {
            "kind": self.kind,
            "packing": self.packing,
            "packing_efficiency": None if efficiency is None else round(efficiency, 4),
            "streaming": False,
            **{k: self.counts[k] for k in ("documents", "tokens", "loss_tokens", "truncated", "dropped", "empty", "rows")},
            "cache": {"status": self.cache, "path": self.path},
        }


def cache_root(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "acc-train" / "data"


def _tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        rules = hashlib.sha256(backend.to_str().encode()).hexdigest()
    else:  # a slow (Python) tokenizer: datasets' own hasher, as its map cache uses
        from datasets.fingerprint import Hasher

        rules = Hasher.hash(tokenizer)
    return {
        "class": type(tokenizer).__name__,
        "rules": rules,
        "size": len(tokenizer),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": getattr(tokenizer, "chat_template", None),
    }


def _file_identity(files: list[str]) -> list[list[Any]]:
    out = []
    for f in files:
        st = os.stat(f)
        out.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    return out


def fingerprint(cfg: DataConfig, tokenizer: Any) -> str:
    kind = data_kind(cfg)
    key = {
        "version": FORMAT_VERSION,
        "train": _file_identity(cfg.train_files),
        "eval": _file_identity(cfg.eval_files),
        "format": cfg.format,
        "kind": [kind.name, type(kind).__module__, type(kind).__qualname__],
        "fields": [cfg.text_field, cfg.prompt_field, cfg.completion_field, cfg.messages_field],
        "seq_len": cfg.seq_len,
        "packing": build.packing(cfg, kind),
        "overlong": cfg.overlong,
        "tokenizer": None if tokenizer is None else _tokenizer_identity(tokenizer),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _rows_maker(cfg: DataConfig, kind: DataKind) -> Any:
    if not build.packing(cfg, kind):
        return pack.single_rows
    if kind.continuous:
        return lambda starts: pack.text_rows(int(starts[-1]), cfg.seq_len)
    return lambda starts: pack.packed_rows(starts, cfg.seq_len)


def _vocab(tokenizer: Any) -> int:
    return 256 if tokenizer is None else len(tokenizer)


def _build(cfg: DataConfig, tokenizer: Any, root: Path, key: str, num_proc: int) -> None:
    """Tokenize and write the cache entry ``root/key`` (a no-op when another process wins)."""
    kind = data_kind(cfg)
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}.building-", dir=root))
    try:
        meta: dict[str, Any] = {"format_version": FORMAT_VERSION, "fingerprint": key, "kind": kind.name, "packing": build.packing(cfg, kind)}
        meta["seq_len"], meta["train_files"], meta["eval_files"] = cfg.seq_len, cfg.train_files, cfg.eval_files
        dtype = build.token_dtype(_vocab(tokenizer))
        meta["dtype"] = np.dtype(dtype).name
        t0 = time.perf_counter()
        for name, files in (("train", cfg.train_files), ("eval", cfg.eval_files)):
            if not files:
                continue
            table = build.tokenize_files(files, f"data.{name}_files", cfg, kind, tokenizer, work, num_proc)
            best_fit = cfg.seq_len if build.packing(cfg, kind) == "best_fit" and not kind.continuous else None
            meta[name] = build.write_split(table, name, work, dtype, _rows_maker(cfg, kind), best_fit=best_fit)
            meta[name]["files"] = sorted(p.name for p in work.glob(f"{name}.*.npy"))  # what verify_entry expects
            meta[name]["digest"] = split_digest(work, meta[name]["files"])
            meta[name]["packing_efficiency"] = _efficiency(work, name, meta)
            del table
        meta["build_s"] = round(time.perf_counter() - t0, 3)
        meta["created"] = time.time()
        shutil.rmtree(work / "hf", ignore_errors=True)  # datasets' Arrow copies: the .npy files are the cache
        replace_file(work / "meta.json", json.dumps(meta, indent=2).encode())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(work, 0o777 & ~umask)  # mkdtemp's 0700 would hide a shared cache from other users
        try:
            os.rename(work, root / key)
        except OSError:
            if not (root / key / "meta.json").is_file():
                raise
    except Exception as exc:
        from acc_train.files.disk_full import disk_full_error

        full = disk_full_error(exc, work, what="while building the token cache in", done="the partial cache entry was removed",
                               hint="free space there, or set data.cache_dir to a filesystem with room, then run the same command again")
        if full is None:
            raise
        raise full from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def split_digest(entry: Path, files: list[str]) -> str:
    """A digest of a split's content (its tokens, loss flags, example boundaries and rows, as
    written): what a resumed run checks it trains on the same data, wherever the files now are."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(files):
        digest.update(name.encode() + b"\0")
        with (entry / name).open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def _efficiency(entry: Path, name: str, meta: dict[str, Any]) -> float | None:
    """A split's packing efficiency (rounded as ``run.json`` reports it), None where rows are not
    packed: computed from its rows file a chunk at a time."""
    if not meta.get("packing") or not meta.get("seq_len"):
        return None
    value = pack.fill(build.open_split(entry, name).rows, int(meta["seq_len"]))
    return None if value is None else round(value, 4)


def _upgraded(entry: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with each split's digest and the training split's packing efficiency; an entry
    built before either gets it now (written back atomically, once: the command that launches
    the workers opens the entry first, so the workers find it written)."""
    missing = [name for name in ("train", "eval") if name in meta and "digest" not in meta[name]]
    for name in missing:
        files = meta[name].get("files") or sorted(p.name for p in entry.glob(f"{name}.*.npy"))
        meta[name]["digest"] = split_digest(entry, files)
    if "packing_efficiency" not in meta["train"]:
        meta["train"]["packing_efficiency"] = _efficiency(entry, "train", meta)
        missing.append("train")
    if missing:
        with contextlib.suppress(OSError):  # a read-only shared cache: computed again next time
            replace_file(entry / "meta.json", json.dumps(meta, indent=2).encode())
    return meta


#: the arrays every split has; a loss-flag file exists only where some token does not count
_SPLIT_ARRAYS = ("tokens", "starts", "rows")


def verify_entry(entry: Path) -> str | None:
    """What is wrong with a cache entry, or None: ``meta.json`` readable, every file its splits
    list present, and every array's file as long as its header says, with the token, row and
    document counts meta.json records. Cheap (headers and sizes, no hashing)."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        splits = [name for name in ("train", "eval") if name in meta]
        if "train" not in splits:
            return "meta.json lists no training split"
    except (OSError, ValueError, TypeError) as exc:
        return f"meta.json: {exc}"
    for name in splits:
        info = meta[name]
        files = info.get("files") or [f"{name}.{a}.npy" for a in _SPLIT_ARRAYS]  # (entries written before the list)
        expected_len = {f"{name}.tokens.npy": info.get("tokens"), f"{name}.rows.npy": info.get("rows"), f"{name}.loss.npy": info.get("tokens")}
        if isinstance(info.get("documents"), int):
            expected_len[f"{name}.starts.npy"] = info["documents"] + 1
        for file in files:
            path = entry / file
            if not path.is_file():
                return f"{file} is missing"
            try:
                with path.open("rb") as f:
                    version = np.lib.format.read_magic(f)
                    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                    shape, _, dtype = read(f)
                    header = f.tell()
            except (OSError, ValueError) as exc:
                return f"{file}: {exc}"
            want = header + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            size = path.stat().st_size
            if size != want:
                return f"{file} holds {size:,} bytes, its header says {want:,}"
            if expected_len.get(file) is not None and shape[0] != expected_len[file]:
                return f"{file} holds {shape[0]:,} entries, meta.json says {expected_len[file]:,}"
    return None


def _discard(entry: Path) -> None:
    """Remove a cache entry: renamed out of the way first, so no reader opens half of it."""
    aside = Path(tempfile.mkdtemp(prefix=f".{entry.name}.damaged-", dir=entry.parent))
    os.rmdir(aside)
    try:
        os.rename(entry, aside)
    except OSError:  # another process already moved it
        return
    shutil.rmtree(aside, ignore_errors=True)


def _default_num_proc() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def prepare_data(cfg: DataConfig, tokenizer: Any, since: float | None = None) -> PreparedData:
    """The job's data files, from the cache or tokenized into it now. ``since``: when this
    launch began (a cache entry created after it counts as built by this launch)."""
    data_kind(cfg).check_tokenizer(tokenizer, cfg)  # as the command did (workers started otherwise)
    root = cache_root(cfg)
    key = fingerprint(cfg, tokenizer)
    entry = root / key
    status = "hit"
    damage = verify_entry(entry) if entry.is_dir() else None
    if damage is not None:  # trusted, it would fail in the workers (or train on the wrong tokens): rebuilt
        sys.stderr.write(f"warning: the data cache entry {entry} is damaged ({damage}): rebuilding it\n")
        _discard(entry)
    if not (entry / "meta.json").is_file():
        try:
            _build(cfg, tokenizer, root, key, cfg.num_proc or _default_num_proc())
        except OSError as exc:
            raise UserError(f"cannot write the data cache in {str(root)!r}: {exc}", where="data.cache_dir", hint="set data.cache_dir to a writable directory") from None
        status = "built"
    meta = _upgraded(entry, json.loads((entry / "meta.json").read_text()))
    if since is not None and meta.get("created", 0) >= since:
        status = "built"
    train = build.open_split(entry, "train")
    ev = build.open_split(entry, "eval") if "eval" in meta else None
    top = max(meta["train"]["max_token"], meta.get("eval", {}).get("max_token", 0))
    prepared = PreparedData(train, ev, meta["kind"], meta["packing"], meta["train"], top, status, str(entry), key, meta.get("eval", {}), cfg.seq_len)
    return _check_rows(prepared, cfg)


def demo_data(cfg: DataConfig) -> PreparedData:
    """The demo corpus (the standard library's source, byte level), made in memory."""
    from acc_train.data.demo import demo_text_bytes

    ids = np.frombuffer(demo_text_bytes(cfg.demo_max_bytes), dtype=np.uint8).astype(np.uint16)
    split = build.in_memory_split(ids, cfg.seq_len)
    counts = {"documents": 1, "tokens": len(ids), "loss_tokens": len(split) * cfg.seq_len, "truncated": 0, "dropped": 0, "empty": 0, "rows": len(split)}
    counts["packing_efficiency"] = None if not len(split) else 1.0  # the stream cut every seq_len tokens: every row full
    return _check_rows(PreparedData(split, None, "text", True, counts, int(ids.max()) if len(ids) else 0, seq_len=cfg.seq_len), cfg)


def _check_rows(prepared: PreparedData, cfg: DataConfig) -> PreparedData:
    if len(prepared.train) == 0:
        c = prepared.counts
        raise UserError(
            f"the training data gives no row of data.seq_len={cfg.seq_len} tokens ({c['tokens']} tokens in {c['documents']} examples; {c['dropped']} dropped as overlong, {c['empty']} empty)",
            where="data",
            hint="add data, lower data.seq_len, or set data.overlong=truncate",
        )
    return prepared
