"""``samples.jsonl``: the completions a run generates at its evaluations (``eval.samples``),
one JSON object a line, and the one reader of that file.

A row: ``step``, ``index`` (the prompt's position in ``eval.samples``), ``prompt`` (as the
config gives it: a string, or chat messages), ``completion``, ``new_tokens`` and
``tokens_per_s``. Rank 0 appends each row with one write; a resumed run keeps the rows up to
the step it resumes from, as ``metrics.jsonl`` does, and writes the later ones again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from acc_train.files.output_paths import replace_file

__all__ = ["SAMPLES_FILE", "read_samples", "start_samples_file", "append_rows"]

#: The file in a run's output directory.
SAMPLES_FILE = "samples.jsonl"


def _row(line: str) -> dict[str, Any] | None:
    """The row on one line, or None for a line cut short by a crash or one that is not a row."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("step"), int) or isinstance(data.get("step"), bool):
        return None
    if not isinstance(data.get("completion"), str):
        return None
    return data


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """The rows of ``samples.jsonl`` (a file, or the run's output directory holding it), in the
    order they were written; lines that are not rows (a crash's last line) are left out, and a
    missing file has none."""
    p = Path(path)
    if p.is_dir():
        p = p / SAMPLES_FILE
    try:
        text = p.read_text(errors="replace")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return []
    return [row for line in text.splitlines() if (row := _row(line)) is not None]


def start_samples_file(path: Path, resumed_step: int) -> int:
    """Open ``path`` for appending, keeping the rows of steps up to ``resumed_step`` (none on a
    fresh start): a new file renamed into place, as the reporter does for ``metrics.jsonl``, so
    a hard-linked copy of the run keeps its own. Returns the file descriptor."""
    keep: list[str] = []
    if resumed_step and path.is_file():
        keep = [ln for ln in path.read_text(errors="replace").splitlines() if (row := _row(ln)) is not None and row["step"] <= resumed_step]
    replace_file(path, "".join(ln + "\n" for ln in keep).encode())
    return os.open(path, os.O_WRONLY | os.O_APPEND)


def append_rows(fd: int, rows: Sequence[dict[str, Any]]) -> None:
    """Append each row as one line, in one write each (a reader never sees half a row but the
    last, after a crash)."""
    for row in rows:
        os.write(fd, (json.dumps(row, ensure_ascii=False) + "\n").encode())
