"""A tiny byte-level BPE tokenizer trained here, wrapped as transformers' fast tokenizer with
BOS/EOS/pad and a ChatML chat template, with and without ``{% generation %}`` markers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: the same rendering, the assistant's text and its end of turn marked for the assistant mask
CHATML_GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: renders the last message differently from the same message followed by others: no prefix property
CHATML_LAST_DIFFERS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if loop.last %}<|im_end|>{% else %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)

CORPUS_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small models train on two tiny processes "
    "question answer what is two plus four five six seven eight nine ten yes no hello there how can i help "
    "you say please thank system user assistant again capital of france paris is city river bank tree house "
    "write a short poem about sea sun moon star cold warm water fire earth air number add subtract "
).split()


def train_tokenizer(template: str | None) -> Any:
    """A byte-level BPE of a few hundred words, as a transformers fast tokenizer adding BOS."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    lines = [" ".join(rng.choice(CORPUS_WORDS) for _ in range(12)) + rng.choice(["?", ".", "!", ":", "\n"]) for _ in range(600)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )  # fmt: skip
    if template is not None:
        wrapped.chat_template = template
    return wrapped


@pytest.fixture(scope="session")
def bpe_tokenizer() -> Any:
    return train_tokenizer(CHATML)


@pytest.fixture(scope="session")
def bpe_tokenizer_generation() -> Any:
    return train_tokenizer(CHATML_GENERATION)


def save_tokenizer_into(model_dir: Path, template: str | None) -> Path:
    """Replace the tokenizer of a (copied) model directory with the BPE one."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (model_dir / name).unlink(missing_ok=True)
    train_tokenizer(template).save_pretrained(model_dir)
    return model_dir
