"""``acc_train.evaluation.generate``: the completion streams through transformers' ``TextStreamer``, and
what it emits adds up to the decoded completion."""

from __future__ import annotations

from pathlib import Path

import torch

from acc_train.evaluation.generate import generate, text_stream


def test_the_byte_stream_skips_the_prompt_and_never_splits_a_character() -> None:
    """The demo model's bytes, one token at a time: the prompt is not shown, a character whose
    bytes come in several tokens is held back until it is whole, and the pieces add up."""
    pieces: list[str] = []
    stream = text_stream(None, pieces.append)
    completion = "héllo wörld\nnext line ✓ done"
    stream.put(torch.tensor([list(b"the prompt ")]))  # generate hands the prompt first
    seen_before_end = 0
    for byte in completion.encode():
        stream.put(torch.tensor([byte]))
        seen_before_end = len(pieces)
    stream.end()
    assert seen_before_end > 2  # it streamed before the end, word by word
    assert "".join(pieces) == completion and not any("\ufffd" in p for p in pieces)
    assert "the prompt" not in "".join(pieces) and bytes(stream.made) == completion.encode()


def test_generate_emits_the_completion_it_returns(tiny_model_dir: Path) -> None:
    """A model with a tokenizer: the streamed text is the completion, and the count is the new tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pieces: list[str] = []
    done = generate(model, tokenizer, "the quick brown", max_new_tokens=12, emit=pieces.append)
    assert 0 < done["tokens"] <= 12 and done["completion"].strip() and "".join(pieces) == done["completion"]
    assert generate(model, tokenizer, "the quick brown", max_new_tokens=12)["completion"] == done["completion"]  # greedy
