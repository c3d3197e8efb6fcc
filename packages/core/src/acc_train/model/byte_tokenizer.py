"""The demo model's text as a Hugging Face tokenizer: token id = UTF-8 byte value, as the demo
job tokenizes its training text, so anything that takes a tokenizer (lm-evaluation-harness,
transformers' streamers, ``generate``) reads and writes bytes the way the model learned them.

Built with the ``tokenizers`` library rather than by hand: a BPE model with no merges over the
256 byte-level symbols (GPT-2's byte-to-character table, so every byte has one token and ids are
byte values), and its byte-level decoder, which turns an incomplete or invalid UTF-8 sequence
into U+FFFD exactly as ``bytes.decode("utf-8", errors="replace")`` does. One special token
follows the bytes: ``<|endoftext|>`` (id 256), the end-of-text lm-eval and ``generate`` ask a
tokenizer for; the demo's data holds none, so a model never learned it (and a 256-id model
cannot emit it). Text that spells it is still read as its bytes, as training reads it. Padding
is byte 0: every byte model has an embedding for it, and padding is hidden by the attention mask.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BYTE_VOCAB", "END_OF_TEXT", "PAD_ID", "PREFIX_ID", "byte_tokenizer"]

#: the byte values: ids 0-255
BYTE_VOCAB = 256
#: the one special token, id 256 (never in the demo's data)
END_OF_TEXT = "<|endoftext|>"
#: padding: byte 0, which every byte model can embed (the attention mask hides it)
PAD_ID = 0
#: what a scorer puts before a text that has no context of its own (lm-eval's rolling
#: log-likelihood, an empty context): a newline, where the demo's source files start their lines
#: and the next file starts; the end-of-text token would be an id the model never trained (or has no row for)
PREFIX_ID = ord("\n")


def byte_tokenizer() -> Any:
    """A fresh ``PreTrainedTokenizerFast`` over bytes (fresh: its callers may set
    ``padding_side`` and the like on it). Builds in about a millisecond; imports transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbol = bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={symbol[b]: b for b in range(BYTE_VOCAB)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=END_OF_TEXT, split_special_tokens=True, name_or_path="acc-train-bytes")
    tokenizer.pad_token_id = PAD_ID
    return tokenizer
