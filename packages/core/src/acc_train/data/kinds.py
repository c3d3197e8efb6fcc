"""Core's kinds of training example: ``text`` (pretraining documents, every token in the loss),
``prompt_completion`` and ``chat`` (loss on the completion / assistant tokens only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from acc_train.data_kind import DataKind, Tokenized

if TYPE_CHECKING:
    from acc_train.config import DataConfig

__all__ = ["TextKind", "BUILTIN_KINDS"]


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
        return {"input_ids": ids, "loss_mask": [[1] * len(x) for x in ids]}


BUILTIN_KINDS: list[DataKind] = [TextKind()]
