"""Data files a user names, checked before any worker starts: present, readable, UTF-8, each
JSON line an object whose fields the job's kind of data (``data.kind``) can read."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.errors import UserError
from acc_train.files.user_files import read_user_text

if TYPE_CHECKING:
    from acc_train.config import DataConfig
    from acc_train.contracts.data_kind import DataKind

__all__ = ["FORMATS", "CHECK_BYTES", "infer_format", "data_kind", "check_data_files", "load_error"]

FORMATS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".parquet": "parquet"}


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


def data_kind(cfg: DataConfig) -> DataKind:
    """The kind ``data.kind`` names, from the registered ones (core's and plugins')."""
    from acc_train.plugins import data_kinds

    return data_kinds().lookup(cfg.kind, "data.kind")


def check_data_files(cfg: DataConfig) -> None:
    """Fail before launch on data files that cannot load: missing, a directory, empty, not
    UTF-8, a broken JSON line (named by its line number), not parquet, a row the kind of data
    cannot read (:meth:`DataKind.check_row`, with its line), no ``data.text_field``. Needs no
    torch; files over :data:`CHECK_BYTES` get only the cheap checks."""
    kind = data_kind(cfg)
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
                _check_file(Path(f), fmt, kind, cfg, where)
    if not cfg.train_files and not kind.continuous:
        raise UserError(
            f"data.kind {kind.name!r} reads the fields {kind.fields(cfg)} of data files, and no data.train_files are given "
            "(the demo job trains on plain text)",
            where="data.train_files",
            hint="list the training files, or leave data.kind at text",
        )


def _check_file(path: Path, fmt: str, kind: DataKind, cfg: DataConfig, where: str) -> None:
    def refuse(problem: str, hint: str | None = None, at: str = where) -> UserError:
        return UserError(f"data file {str(path)!r} {problem}", where=at, hint=hint)

    size = path.stat().st_size
    if size == 0:
        raise refuse("is empty", "give a file holding the training text")
    if fmt == "text" and not kind.continuous:
        raise refuse(
            f"is plain text (a document a line), and data.kind {kind.name!r} reads the fields {kind.fields(cfg)} of JSON or parquet rows",
            "give .jsonl or .parquet files, or set data.kind to text",
            "data.kind",
        )
    if fmt == "parquet":
        with path.open("rb") as fh:
            head = fh.read(4)
            fh.seek(max(0, size - 4))
            tail = fh.read(4)
        if size < 12 or head != b"PAR1" or tail != b"PAR1":
            raise refuse("is not a parquet file (no PAR1 magic bytes at its start and end)", "check the file, or set data.format to its real format")
        _check_parquet(path, kind, cfg, refuse, where)
        return
    if size > CHECK_BYTES:
        return
    text = read_user_text(path, what="data file", where=where)
    if not text.strip():
        raise refuse("holds only blank lines", "give a file holding the training text")
    if fmt == "json":
        rows = _json_rows(path, text, where)
        for at, row in rows:
            problem = kind.check_row(row, cfg)
            if problem is not None:
                raise UserError(f"data file {str(path)!r}, {at}: {problem}", where=where, hint=_fields_hint(kind, cfg))
        if kind.continuous and not any(isinstance(row.get(cfg.text_field), str) for _, row in rows):
            fields = sorted({k for _, row in rows for k in row})[:12]
            raise refuse(f"has no row with a text field {cfg.text_field!r} (fields: {fields})", "set data.text_field to the column holding the text", "data.text_field")


#: the options that name the fields core's kinds read
FIELD_KEYS = ("text_field", "prompt_field", "completion_field", "messages_field")


def _field_key(cfg: DataConfig, field: str) -> str:
    """The option naming ``field`` (``data.completion_field``), or ``data.kind``."""
    return next((f"data.{k}" for k in FIELD_KEYS if getattr(cfg, k) == field), "data.kind")


def _fields_hint(kind: DataKind, cfg: DataConfig) -> str:
    keys = [k for k in dict.fromkeys(_field_key(cfg, f) for f in kind.fields(cfg)) if k != "data.kind"]
    return f"data.kind {kind.name!r} reads the fields {kind.fields(cfg)} of every row" + (f" (named by {', '.join(keys)})" if keys else "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_parquet(path: Path, kind: DataKind, cfg: DataConfig, refuse: Callable[..., UserError], where: str) -> None:
    """The kind's columns in the parquet schema (its footer: cheap); a file up to
    :data:`CHECK_BYTES` has every row of them checked too."""
    import pyarrow.parquet as pq

    try:
        columns = pq.read_schema(path).names
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors about the user's bytes
        raise refuse(f"is not a readable parquet file: {_first_line(exc)}", "check the file, or set data.format to its real format") from None
    missing = [f for f in kind.fields(cfg) if f not in columns]
    if missing:
        raise refuse(f"has no column {missing[0]!r} (columns: {columns[:12]})", _fields_hint(kind, cfg), _field_key(cfg, missing[0]))
    if path.stat().st_size > CHECK_BYTES or kind.continuous:
        return
    try:
        rows = pq.read_table(path, columns=kind.fields(cfg)).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors about the user's bytes
        raise refuse(f"cannot be read as parquet: {_first_line(exc)}", "check the file") from None
    for number, row in enumerate(rows, 1):
        problem = kind.check_row(row, cfg)
        if problem is not None:
            raise UserError(f"data file {str(path)!r}, row {number}: {problem}", where=where, hint=_fields_hint(kind, cfg))


def _json_rows(path: Path, text: str, where: str) -> list[tuple[str, dict[str, Any]]]:
    """The rows of a JSON Lines file, or of a file holding one JSON list of objects (both are
    what ``datasets``' json loader reads), each with where it is (``line 7``, ``row 7``); the
    first line that is neither is a UserError."""
    rows: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:
            problem = f"is not JSON ({exc.msg if isinstance(exc, json.JSONDecodeError) else 'nested too deeply'})"
        else:
            if isinstance(row, dict):
                rows.append((f"line {number}", row))
                continue
            problem = f"is a JSON {type(row).__name__}, not an object (one row of data)"
        try:  # a single JSON document, e.g. a list of rows over many lines
            whole = json.loads(text)
        except (ValueError, RecursionError):
            whole = None
        if isinstance(whole, list) and whole and all(isinstance(r, dict) for r in whole):
            return [(f"row {i}", r) for i, r in enumerate(whole, 1)]
        raise UserError(
            f"data file {str(path)!r}, line {number}: {problem}",
            where=where,
            hint="every line of a .jsonl file is one JSON object, e.g. {\"text\": \"...\"}",
        )
    return rows


def load_error(files: list[str], fmt: str, exc: BaseException, where: str) -> UserError:
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


