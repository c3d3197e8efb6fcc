"""The one way acc-train reads a file the user gave it: text that is not UTF-8, a directory, a
missing or unreadable file, or JSON of the wrong shape become a :class:`UserError` naming the
file, never a ``UnicodeDecodeError`` or ``JSONDecodeError`` traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from acc_train.errors import UserError

__all__ = ["read_user_text", "read_user_json"]


def read_user_text(path: str | Path, *, what: str, where: str | None = None, hint: str | None = None) -> str:
    """The UTF-8 text of ``path``; ``what`` says what the file is ("config file", "metrics file")
    and ``where`` the flag or key that named it (defaults to the path)."""
    p = Path(path)
    loc = where or str(p)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{what} {str(p)!r} does not exist", where=loc, hint=hint) from None
    except IsADirectoryError:
        raise UserError(f"{what} {str(p)!r} is a directory, not a file", where=loc, hint=hint) from None
    except OSError as exc:
        raise UserError(f"{what} {str(p)!r} cannot be read: {exc.strerror or exc}", where=loc, hint=hint) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UserError(
            f"{what} {str(p)!r} is not UTF-8 text (byte {exc.start}, line {line}: {data[exc.start:exc.start + 1]!r})",
            where=loc,
            hint=hint or "save it as UTF-8 text, or check that the path names the file you meant",
        ) from None


def read_user_json(path: str | Path, *, what: str, where: str | None = None, hint: str | None = None, kind: type = object) -> Any:
    """The JSON document in ``path``, refused (naming the file and line) when it is not JSON or,
    with ``kind`` (``dict``, ``list``), not a document of that type."""
    text = read_user_text(path, what=what, where=where, hint=hint)
    loc = where or str(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{what} {str(path)!r} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", where=loc, hint=hint) from None
    except RecursionError:
        raise UserError(f"{what} {str(path)!r} nests too deeply to read", where=loc, hint=hint) from None
    if kind is not object and not isinstance(data, kind):
        raise UserError(f"{what} {str(path)!r} must hold a JSON {'object' if kind is dict else kind.__name__}, not {type(data).__name__}", where=loc, hint=hint)
    return data
