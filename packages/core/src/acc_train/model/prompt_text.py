"""Prompts as token ids and token ids as text, for generation: text is tokenized as training
tokenizes it (the run's tokenizer, or bytes for the demo model, which has none: read and written
by :func:`acc_train.model.byte_tokenizer.byte_tokenizer`, the one byte tokenizer, which lm-evaluation-harness
gets too), chat messages are rendered with the tokenizer's chat template and its generation
prompt. ``acc-train generate`` and the samples a run writes at its evaluations (``eval.samples``)
share it."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from acc_train.errors import UserError

__all__ = ["chat_template", "check_prompts", "encode_prompt", "decode_tokens", "prompt_label"]


@functools.cache
def _bytes() -> Any:
    """The byte tokenizer, built once for this module's reads (never changed here)."""
    from acc_train.model.byte_tokenizer import byte_tokenizer

    return byte_tokenizer()


def chat_template(tokenizer: Any) -> str | None:
    """The tokenizer's chat template, or None where it has none (or is None: bytes)."""
    if tokenizer is None:
        return None
    try:
        template = tokenizer.get_chat_template()
    except (ValueError, AttributeError):
        return None
    return template if isinstance(template, str) and template.strip() else None


def _messages(prompt: Any) -> list[dict[str, str]]:
    """Chat messages as plain dicts (config sections, or dicts already)."""
    return [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in prompt]


def _no_template(tokenizer: Any, where: str, drop: str) -> UserError:
    if tokenizer is None:
        return UserError("the demo model reads bytes: it has no tokenizer, so no chat template to render messages with", where=where, hint=drop)
    name = getattr(tokenizer, "name_or_path", "") or "the model's"
    return UserError(
        f"tokenizer {name!r} has no chat template to render chat messages with",
        where=where,
        hint=f"{drop}, or use a tokenizer with a chat template (chat_template in tokenizer_config.json or a chat_template.jinja file; model.tokenizer)",
    )


def check_prompts(prompts: Sequence[Any], tokenizer: Any, key: str = "eval.samples") -> None:
    """Refuse chat messages among ``prompts`` (the config's ``key``) where the tokenizer has no
    chat template; before any worker trains, so the run is not refused at its first evaluation."""
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) and chat_template(tokenizer) is None:
            raise _no_template(tokenizer, f"{key}[{i}]", "give that prompt as a string")


def encode_prompt(tokenizer: Any, prompt: str | Sequence[Any], *, where: str, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``: a string (rendered as one user turn of the chat template with
    ``chat``), or a list of chat messages (``{role, content}``); the generation prompt follows a
    chat. Refused (``where`` names the prompt) without a chat template, or when it is empty."""
    messages = _messages(prompt) if not isinstance(prompt, str) else [{"role": "user", "content": prompt}] if chat else None
    if messages is not None:
        if chat_template(tokenizer) is None:
            raise _no_template(tokenizer, where, "drop --chat" if chat else "give the prompt as a string")
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    elif tokenizer is None:
        ids = list(_bytes().encode(str(prompt)))
    else:
        ids = list(tokenizer(prompt)["input_ids"])
    if not ids:
        raise UserError("the prompt is empty: it has no tokens", where=where, hint="give a prompt with some text")
    return ids


def decode_tokens(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of generated ids (special tokens left out; bytes for the demo model)."""
    return str((_bytes() if tokenizer is None else tokenizer).decode(list(ids), skip_special_tokens=True))


def prompt_label(prompt: Any) -> str:
    """A prompt as one line of text for people (reports, trackers): the string, or a chat's
    messages as ``role: content`` joined by `` | ``."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " | ".join(f"{m.get('role')}: {m.get('content')}" if isinstance(m, dict) else str(m) for m in _messages(prompt))
    return str(prompt)
