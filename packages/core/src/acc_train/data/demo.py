"""The demo corpus: the Python standard library's own sources, which every machine has."""

from __future__ import annotations

import sysconfig
from pathlib import Path

__all__ = ["demo_text_bytes"]


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


