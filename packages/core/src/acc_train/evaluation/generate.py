"""``acc-train generate``: a quick look at what a run trained. The model is read from a run's
``final/`` (a full model, or LoRA adapters on their base), from any checkpoint whatever strategy
and world size wrote it (its portable state, adapters applied), or from a ``save_pretrained``
directory (:func:`acc_train.evaluation.trained.load_trained_model`); the prompt is tokenized as training tokenized text (the run's tokenizer, bytes for
the demo model), or with ``chat`` rendered by the tokenizer's chat template; the text streams to
the terminal as it is made (``transformers.TextStreamer``: word by word, line by line). One
process, on the GPU when there is one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from acc_train.model.byte_tokenizer import byte_tokenizer
from acc_train.model.prompt_text import decode_tokens, encode_prompt

__all__ = ["generate", "text_stream"]


def text_stream(tokenizer: Any | None, emit: Callable[[str], None] | None) -> Any:
    """A ``transformers.TextStreamer`` that hands its text to ``emit`` (None: keeps it to itself)
    and keeps the new ids in ``made``. The streamer skips the prompt and holds text back until it
    is final (a word, a line, a character whose bytes came in several tokens), so what is emitted
    adds up to the decoded completion."""
    from transformers import TextStreamer

    class Stream(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer if tokenizer is not None else byte_tokenizer(), skip_prompt=True, skip_special_tokens=True)
            self.made: list[int] = []

        def put(self, value: Any) -> None:
            if not self.next_tokens_are_prompt:
                self.made.extend(int(t) for t in value.reshape(-1).tolist())
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if emit is not None and text:
                emit(text)

    return Stream()


def generate(
    model: Any,
    tokenizer: Any | None,
    prompt: str,
    *,
    chat: bool = False,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    emit: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The completion of ``prompt`` (greedy when ``temperature`` is 0), each new piece of text
    passed to ``emit`` as it is final (:func:`text_stream`); returns ``{"completion", "tokens", "tokens_per_s"}``."""
    import time

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    encoded = encode_prompt(tokenizer, prompt, where="--chat" if chat else "--prompt", chat=chat)
    ids = torch.tensor([encoded], dtype=torch.long, device=device)
    stream = text_stream(tokenizer, emit)
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=max_new_tokens, streamer=stream, pad_token_id=eos if eos is not None else 0, eos_token_id=eos, **sampling)
    seconds = time.perf_counter() - start
    return {"completion": decode_tokens(tokenizer, stream.made), "tokens": len(stream.made), "tokens_per_s": len(stream.made) / seconds if seconds > 0 else None}
