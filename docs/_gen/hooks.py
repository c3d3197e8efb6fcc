"""mkdocs hook for the CLI reference: click keeps a paragraph after a ``\\b`` line as written
(``acc-train --help``'s examples), but mkdocs-click (0.9) passes it to Markdown as prose, which
joins its lines into one. Here such a paragraph becomes a code block, as the terminal shows it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mkdocs_click._docs as click_docs

_make_description = click_docs._make_description


def _description(ctx: Any, remove_ascii_art: bool = False) -> Iterator[str]:
    verbatim = False
    for line in _make_description(ctx, remove_ascii_art=remove_ascii_art):
        if line.strip() == "\b":
            verbatim = True
            yield "```text"
            continue
        if verbatim and not line.strip():
            verbatim = False
            yield "```"
        yield line
    if verbatim:
        yield "```"


click_docs._make_description = _description
