"""``acc-train generate``: a quick look at what a run trained. The model is read from a run's
``final/`` (a full model, or LoRA adapters on their base), from any checkpoint whatever strategy
and world size wrote it (its portable state, adapters applied), or from a ``save_pretrained``
directory; the prompt is tokenized as training tokenized text (the run's tokenizer, bytes for
the demo model), or with ``chat`` rendered by the tokenizer's chat template; the text streams to
the terminal as it is made (``transformers.TextStreamer``: word by word, line by line). One
process, on the GPU when there is one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from acc_train.model.byte_tokenizer import byte_tokenizer
from acc_train.errors import UserError
from acc_train.model.prompt_text import decode_tokens, encode_prompt

__all__ = ["load_for_generation", "generate", "text_stream"]


def _is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file() or (p / "adapter_config.json").is_file()


def _run_tokenizer(run_dir: Path) -> Any | None:
    """The tokenizer of the run whose ``config.yaml`` is in ``run_dir`` (None: byte level)."""
    from acc_train.config import load_resolved
    from acc_train.model.build import load_tokenizer

    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    return load_tokenizer(load_resolved(config).config.model)


def _from_directory(p: Path) -> tuple[Any, Any | None]:
    """A ``save_pretrained`` directory: a full model, or adapters on the base their config names."""
    import transformers

    if (p / "adapter_config.json").is_file():
        from peft import PeftModel

        base_name = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base_name:
            raise UserError(f"{p} holds LoRA adapters but does not name their base model", where="PATH", hint="export the merged model (checkpoint export --merge) and pass that")
        model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_name), p)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(p)
    has_tokenizer = (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file()
    tokenizer = transformers.AutoTokenizer.from_pretrained(p) if has_tokenizer else _run_tokenizer(p.parent)
    return model, tokenizer


def load_for_generation(path: str) -> tuple[Any, Any | None, str]:
    """(the model, its tokenizer or None for bytes, what was read): ``path`` is a run's output
    directory (its ``final/``, else its latest checkpoint), a checkpoint, or a model directory."""
    from acc_train.checkpoint_tools import export_model, resolve_checkpoint

    p = Path(path).expanduser()
    try:
        if (p / "final").is_dir() and _is_model_dir(p / "final"):
            model, tokenizer = _from_directory(p / "final")
            source = str(p / "final")
        elif _is_model_dir(p):
            model, tokenizer = _from_directory(p)
            source = str(p)
        else:
            ckpt = resolve_checkpoint(path)
            model, tokenizer, source = export_model(ckpt), _run_tokenizer(ckpt.parent.parent), str(ckpt)
    except OSError as exc:  # a model or base model that cannot be read
        raise UserError(f"cannot load the model from {path!r}: {exc}".splitlines()[0], where="RUN_OR_CHECKPOINT") from None
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0) or 0
    if tokenizer is None and vocab > 256:  # bytes are the demo model's text, not this model's
        raise UserError(
            f"found no tokenizer for {source} (vocabulary of {vocab}): neither in the directory nor in its run's config.yaml",
            where="RUN_OR_CHECKPOINT",
            hint="pass the run's output directory or its final/ (which hold the tokenizer), or save the tokenizer beside the model",
        )
    return model, tokenizer, source


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
