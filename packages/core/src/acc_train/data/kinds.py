"""Core's kinds of training example: ``text`` (pretraining documents, every token in the loss),
``prompt_completion`` and ``chat`` (loss on the completion / assistant tokens only)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar

from acc_train.contracts.data_kind import DataKind, Tokenized
from acc_train.errors import UserError

if TYPE_CHECKING:
    from acc_train.config import DataConfig

__all__ = ["TextKind", "PromptCompletionKind", "ChatKind", "BUILTIN_KINDS"]

#: a chat template that marks assistant text for ``return_assistant_tokens_mask``
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
#: the conversation a chat template is tried on before launch
PROBE_CHAT = [
    {"role": "user", "content": "Hello there."},
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "Say yes."},
    {"role": "assistant", "content": "Yes."},
]


class TextKind(DataKind):
    """Documents from ``data.text_field`` (the line, for ``.txt`` files), each followed by the
    tokenizer's EOS token; every token counts in the loss."""

    name: ClassVar[str] = "text"
    description: ClassVar[str] = "pretraining text: documents joined with EOS, cut into seq_len rows"
    continuous: ClassVar[bool] = True
    packs_by_default: ClassVar[bool] = True

    def fields(self, cfg: DataConfig) -> list[str]:
        return [cfg.text_field]

    def check_row(self, row: dict[str, Any], cfg: DataConfig) -> str | None:
        return None  # rows without the text (or with an empty one) are skipped; a file with none is refused

    def tokenize(self, batch: dict[str, list[Any]], tokenizer: Any, cfg: DataConfig) -> Tokenized:
        texts = [t if isinstance(t, str) else "" for t in batch[cfg.text_field]]
        if tokenizer is None:  # byte level: the demo model's vocabulary is the 256 byte values
            ids = [list(t.encode("utf-8")) for t in texts]
        else:
            eos = tokenizer.eos_token_id
            ids = [enc + ([eos] if eos is not None and enc else []) for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        return {"input_ids": ids}  # every token counts


def _first_token_after(offsets: list[tuple[int, int]], char: int) -> int:
    """The index of the first token holding a character at or after ``char`` (zero-width
    special tokens are skipped), or ``len(offsets)``."""
    return next((i for i, (start, end) in enumerate(offsets) if end > start and end > char), len(offsets))


class PromptCompletionKind(DataKind):
    """Rows of ``data.prompt_field`` and ``data.completion_field``, tokenized as TRL's
    ``SFTTrainer`` does: the tokenizer's EOS text is appended to the completion (unless it ends
    with it), ``prompt`` and ``prompt + completion`` are tokenized with the tokenizer's own
    special tokens (BOS as it adds it), and the first ``len(prompt ids)`` tokens are the prompt
    (loss 0), the rest, EOS included, the completion (loss 1). Where the prompt's tokens are not
    the start of the whole's (a token merged across the seam, where TRL warns), the seam is
    found by character offsets: a token holding any completion character counts.

    With the demo's byte-level vocabulary (no tokenizer) the ids are the UTF-8 bytes of prompt
    and completion, without EOS (256 byte values hold none)."""

    name: ClassVar[str] = "prompt_completion"
    description: ClassVar[str] = "prompt/completion pairs: loss on the completion and EOS only"

    def fields(self, cfg: DataConfig) -> list[str]:
        return [cfg.prompt_field, cfg.completion_field]

    def check_tokenizer(self, tokenizer: Any, cfg: DataConfig) -> None:
        if tokenizer is not None and not getattr(tokenizer, "eos_token", None):
            raise UserError(
                f"data.kind {self.name!r} ends each completion with the tokenizer's EOS token, and tokenizer "
                f"{getattr(tokenizer, 'name_or_path', '')!r} has none",
                where="data.kind",
                hint="set eos_token in the tokenizer's tokenizer_config.json, or use a tokenizer that has one",
            )

    def tokenize(self, batch: dict[str, list[Any]], tokenizer: Any, cfg: DataConfig) -> Tokenized:
        rows = list(zip(batch[cfg.prompt_field], batch[cfg.completion_field]))
        good = [isinstance(p, str) and isinstance(c, str) for p, c in rows]
        prompts = [p if ok else "" for (p, _), ok in zip(rows, good)]
        completions = [c if ok else "" for (_, c), ok in zip(rows, good)]
        if tokenizer is None:
            ids = [list((p + c).encode("utf-8")) for p, c in zip(prompts, completions)]
            mask = [[0] * len(p.encode("utf-8")) + [1] * len(c.encode("utf-8")) for p, c in zip(prompts, completions)]
        else:
            eos = tokenizer.eos_token
            wholes = [p + (c if c.endswith(eos) else c + eos) for p, c in zip(prompts, completions)]
            prompt_ids = tokenizer(prompts)["input_ids"]
            fast = getattr(tokenizer, "is_fast", False)
            enc = tokenizer(wholes, return_offsets_mapping=fast)
            ids, mask = [], []
            for i, whole in enumerate(enc["input_ids"]):
                n = len(prompt_ids[i])
                if whole[:n] != prompt_ids[i]:
                    n = _first_token_after(enc["offset_mapping"][i], len(prompts[i])) if fast else _common_prefix(whole, prompt_ids[i])
                ids.append(list(whole))
                mask.append([0] * n + [1] * (len(whole) - n))
        return {"input_ids": [x if ok else [] for x, ok in zip(ids, good)], "loss_mask": [m if ok else [] for m, ok in zip(mask, good)]}


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def messages_problem(messages: Any, field: str) -> str | None:
    """What is wrong with one row's conversation, or None."""
    if not isinstance(messages, list):
        return f"field {field!r} is a {type(messages).__name__}, not a list of messages ({{\"role\": ..., \"content\": ...}})"
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            return f"{field} entry {number} is a {type(message).__name__}, not an object with 'role' and 'content'"
        for key in ("role", "content"):
            if key not in message:
                return f"{field} entry {number} has no {key!r}"
            if not isinstance(message[key], str):
                return f"{field} entry {number}'s {key!r} is a {type(message[key]).__name__}, not a string"
    if not any(m["role"] == "assistant" for m in messages):
        return f"{field} has no assistant message (the loss covers only what the assistant says)"
    return None


def _chat_template(tokenizer: Any) -> str | None:
    try:
        template = tokenizer.get_chat_template()
    except (ValueError, AttributeError):
        return None
    return template if isinstance(template, str) and template.strip() else None


class ChatKind(DataKind):
    """Conversations in ``data.messages_field`` (a list of ``{"role", "content"}``), rendered
    with the tokenizer's chat template; the loss covers each assistant message and the
    end-of-turn text the template puts after it, nothing else.

    A template with ``{% generation %}`` markers says itself which text is the assistant's
    (``return_assistant_tokens_mask``). Without them, the assistant's text of message ``i`` is
    what the rendering of messages ``0..i`` adds to that of ``0..i-1`` with the generation
    prompt; both must be prefixes of the whole conversation's rendering, or the template is
    refused. Text spans become tokens through the fast tokenizer's offsets: a token holding any
    assistant character counts (as in transformers' own assistant mask). An assistant message
    that opens a conversation has no prompt to follow and stays context there."""

    name: ClassVar[str] = "chat"
    description: ClassVar[str] = "conversations rendered with the chat template: loss on assistant messages only"

    def fields(self, cfg: DataConfig) -> list[str]:
        return [cfg.messages_field]

    def check_row(self, row: dict[str, Any], cfg: DataConfig) -> str | None:
        if cfg.messages_field not in row:
            return f"has no field {cfg.messages_field!r}"
        return messages_problem(row[cfg.messages_field], cfg.messages_field)

    def check_tokenizer(self, tokenizer: Any, cfg: DataConfig) -> None:
        if tokenizer is None:
            raise UserError(
                f"data.kind {self.name!r} renders conversations with a tokenizer's chat template, and the demo model reads bytes (no tokenizer)",
                where="data.kind",
                hint="set model.name_or_path (or model.tokenizer) to a chat model's directory or hub id",
            )
        name = getattr(tokenizer, "name_or_path", "")
        if _chat_template(tokenizer) is None:
            raise UserError(
                f"tokenizer {name!r} has no chat template, which data.kind {self.name!r} renders conversations with",
                where="data.kind",
                hint="use a tokenizer with a chat template (chat_template in tokenizer_config.json or a chat_template.jinja file), "
                "set model.tokenizer to one, or use data.kind prompt_completion",
            )
        if not getattr(tokenizer, "is_fast", False):
            raise UserError(
                f"tokenizer {name!r} is not a fast (Rust) tokenizer; data.kind {self.name!r} needs its offsets to find the assistant tokens",
                where="data.kind",
                hint="save the tokenizer with a tokenizer.json (AutoTokenizer.from_pretrained(...) then save_pretrained)",
            )
        encoded = self._encode([PROBE_CHAT], tokenizer)
        if not any(encoded["loss_mask"][0]):
            raise UserError(
                f"the chat template of tokenizer {name!r} marks no assistant text in a two-turn conversation",
                where="data.kind",
                hint="check its {% generation %} ... {% endgeneration %} markers",
            )

    def tokenize(self, batch: dict[str, list[Any]], tokenizer: Any, cfg: DataConfig) -> Tokenized:
        chats = batch[cfg.messages_field]
        good = [messages_problem(c, cfg.messages_field) is None for c in chats]
        encoded = self._encode([c for c, ok in zip(chats, good) if ok], tokenizer)
        ids: list[list[int]] = []
        mask: list[list[int]] = []
        rows = iter(zip(encoded["input_ids"], encoded["loss_mask"]))
        for ok in good:
            x, m = next(rows) if ok else ([], [])
            ids.append(x)
            mask.append(m)
        return {"input_ids": ids, "loss_mask": mask}

    def _encode(self, chats: list[list[dict[str, str]]], tokenizer: Any) -> Tokenized:
        if not chats:
            return {"input_ids": [], "loss_mask": []}
        chats = [[{"role": m["role"], "content": m["content"]} for m in chat] for chat in chats]
        name = getattr(tokenizer, "name_or_path", "")
        try:
            if GENERATION_TAG.search(_chat_template(tokenizer) or ""):
                out = tokenizer.apply_chat_template(chats, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                return {"input_ids": [list(x) for x in out["input_ids"]], "loss_mask": [list(m) for m in out["assistant_masks"]]}
            texts, spans = zip(*(_assistant_spans(chat, tokenizer, name) for chat in chats))
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template's own refusal (jinja's raise_exception) of a conversation
            raise UserError(
                f"the chat template of tokenizer {name!r} cannot render a conversation: {type(exc).__name__}: {exc}".splitlines()[0],
                where="data.kind",
                hint="check the conversations against what the template accepts (roles, their order)",
            ) from None
        enc = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
        masks = [
            [int(end > start and any(end > s and start < e for s, e in chat_spans)) for start, end in offsets]
            for offsets, chat_spans in zip(enc["offset_mapping"], spans)
        ]
        return {"input_ids": [list(x) for x in enc["input_ids"]], "loss_mask": masks}


def _assistant_spans(chat: list[dict[str, str]], tokenizer: Any, name: str) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering of ``chat`` and the character spans of its assistant messages."""

    def render(messages: list[dict[str, str]], prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)

    whole = render(chat, False)
    spans = []
    for i, message in enumerate(chat):
        if message["role"] != "assistant" or i == 0:
            continue
        before, through = render(chat[:i], True), render(chat[: i + 1], False)
        for part, how in ((before, "with the generation prompt"), (through, "")):
            if not whole.startswith(part):
                raise UserError(
                    f"the chat template of tokenizer {name!r} renders the messages before assistant message {i + 1}"
                    f"{' ' + how if how else ' and that message'} differently from the start of the whole conversation, "
                    "so its assistant tokens cannot be found",
                    where="data.kind",
                    hint="use a template whose rendering of a conversation starts with the rendering of its beginning, "
                    "or add {% generation %} ... {% endgeneration %} markers around the assistant text",
                )
        spans.append((len(before), len(through)))
    return whole, spans


BUILTIN_KINDS: list[DataKind] = [TextKind(), PromptCompletionKind(), ChatKind()]
