"""Generation samples (``eval.samples``) without a launch: prompts as tokens (chat messages through
the chat template), generation on its own random stream, ``samples.jsonl`` kept up to a resumed
step, the report's view of it, and the refusals of bad prompts. The launched runs (ddp, fsdp,
zero3, a resume, the trackers) are in the strategy tests and tests/core/test_trackers.py."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from acc_train.config.evaluation import EvalConfig
from acc_train.errors import UserError
from acc_train.loop.samples import complete
from acc_train.model.prompt_text import check_prompts, encode_prompt
from acc_train.outputs.samples_file import SAMPLES_FILE, append_rows, read_samples, start_samples_file
from tests.conftest import run_cli, tiny_job_args
from tests.data.conftest import CHATML, train_tokenizer


class OneProcess:
    """What :func:`complete` uses of an Accelerator, for one CPU process."""

    num_processes = 1

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")

    def autocast(self) -> Any:
        return contextlib.nullcontext()


#: the strategy contract's default, for a model with no wrapper
UNWRAPPED = SimpleNamespace(generation_model=lambda accelerator, model: contextlib.nullcontext(model))


@pytest.fixture(scope="module")
def chat_tokenizer() -> Any:
    return train_tokenizer(CHATML)


@pytest.fixture(scope="module")
def chat_model(chat_tokenizer: Any) -> Any:
    """A tiny random Llama over the chat tokenizer's vocabulary, with dropout on (in train mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(chat_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=128, attention_dropout=0.1, eos_token_id=chat_tokenizer.eos_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(config).train()


CHAT = [{"role": "system", "content": "say yes"}, {"role": "user", "content": "what is two plus four"}]


def test_chat_messages_are_rendered_with_the_template_and_its_generation_prompt(chat_tokenizer: Any) -> None:
    ids = encode_prompt(chat_tokenizer, CHAT, where="eval.samples[0]")
    text = chat_tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nwhat is two plus four<|im_end|>\n<|im_start|>assistant\n"), text
    assert "<|im_start|>system\nsay yes<|im_end|>" in text
    assert ids != encode_prompt(chat_tokenizer, "what is two plus four", where="eval.samples[1]"), "a string is text, not a chat"


def test_chat_prompts_are_refused_without_a_chat_template(chat_tokenizer: Any) -> None:
    plain = train_tokenizer(None)
    check_prompts(["hello", CHAT], chat_tokenizer)  # has one
    with pytest.raises(UserError) as refused:
        check_prompts(["hello", CHAT], plain)
    assert refused.value.where == "eval.samples[1]" and "no chat template" in str(refused.value)
    assert "give that prompt as a string" in (refused.value.hint or "")
    with pytest.raises(UserError, match="demo model reads bytes"):
        check_prompts([CHAT], None)


def test_generation_leaves_trainings_random_streams_and_the_train_mode_alone(chat_model: Any, chat_tokenizer: Any) -> None:
    """Sampled (temperature 1) twice with one seed: the same completions; with another seed,
    others; and torch's generator as it was, so dropout and data order draw what they would have."""
    import torch

    prompts = ["the quick brown fox", CHAT]
    ids = [encode_prompt(chat_tokenizer, p, where="eval.samples") for p in prompts]
    settings = EvalConfig(samples=prompts, max_new_tokens=12, temperature=1.0)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = complete(OneProcess(), chat_model, UNWRAPPED, chat_tokenizer, prompts, ids, settings, seed=5, step=10)
    assert torch.equal(torch.get_rng_state(), before), "generation drew from training's generator"
    assert chat_model.training, "the model goes back to train mode"
    again = complete(OneProcess(), chat_model, UNWRAPPED, chat_tokenizer, prompts, ids, settings, seed=5, step=10)
    other = complete(OneProcess(), chat_model, UNWRAPPED, chat_tokenizer, prompts, ids, settings, seed=6, step=10)
    text = [r["completion"] for r in first]
    assert text == [r["completion"] for r in again]
    assert text != [r["completion"] for r in other], "the seed decides the samples"
    assert [(r["step"], r["index"], r["prompt"]) for r in first] == [(10, 0, prompts[0]), (10, 1, CHAT)]
    assert all(r["new_tokens"] >= 1 and r["tokens_per_s"] > 0 for r in first)


def test_greedy_decoding_is_the_argmax_of_the_model_in_eval_mode(chat_model: Any, chat_tokenizer: Any) -> None:
    import torch

    ids = encode_prompt(chat_tokenizer, "the quick brown fox", where="eval.samples[0]")
    (row,) = complete(OneProcess(), chat_model, UNWRAPPED, chat_tokenizer, ["p"], [ids], EvalConfig(max_new_tokens=3), seed=0, step=1)
    chat_model.eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        for _ in range(3):
            x = torch.cat([x, chat_model(x).logits[:, -1:].argmax(-1)], dim=1)
    chat_model.train()
    made = x[0, len(ids) :].tolist()
    eos = chat_tokenizer.eos_token_id
    made = made[: made.index(eos) + 1] if eos in made else made
    assert row["completion"] == chat_tokenizer.decode(made, skip_special_tokens=True) and row["new_tokens"] == len(made)


def test_the_file_keeps_the_rows_up_to_the_resumed_step(tmp_path: Path) -> None:
    path = tmp_path / SAMPLES_FILE
    rows = [{"step": s, "index": i, "prompt": "p", "completion": f"{s}-{i}", "new_tokens": 1, "tokens_per_s": 1.0} for s in (10, 20) for i in (0, 1)]
    fd = start_samples_file(path, 0)
    append_rows(fd, rows)
    import os

    os.close(fd)
    with path.open("a") as f:
        f.write('{"step": 30, "index": 0, "compl')  # a crash's last line
    assert read_samples(tmp_path) == rows
    os.close(start_samples_file(path, 10))  # resumed at step 10: 20's rows (and the torn line) go
    assert read_samples(path) == rows[:2]
    os.close(start_samples_file(path, 0))  # a fresh start: none
    assert read_samples(path) == []


def test_report_shows_the_last_evaluation_and_one_prompt_across_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0, "lr": 1e-3}) + "\n" for s in (1, 2, 3)))
    chat = [{"role": "user", "content": "hi"}]
    rows = [(1, 0, "once upon", "a time"), (1, 1, chat, "hello"), (3, 0, "once upon", "a time there\nwas"), (3, 1, chat, "hello there")]
    (run / SAMPLES_FILE).write_text("".join(json.dumps({"step": s, "index": i, "prompt": p, "completion": c, "new_tokens": 2}) + "\n" for s, i, p, c in rows))
    proc = run_cli("report", str(run), "--no-png", "--prompt", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = proc.stdout.split("\n\n", 1)[1].splitlines()
    assert shown == [
        "samples at step 3 (samples.jsonl):",
        "  [0] once upon",
        "      -> a time there",
        "         was",
        "  [1] user: hi",
        "      -> hello there",
        "prompt [0] across steps: once upon",
        "  step 1  a time",
        "  step 3  a time there",
        "          was",
    ]
    from acc_train.outputs.report import format_samples, read_run

    with pytest.raises(UserError, match=r"no samples of prompt 2") as missing:
        format_samples(read_run(run), prompt=2)
    assert missing.value.where == "--prompt" and "[0, 1]" in (missing.value.hint or "")


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        ("[3]", ["eval.samples.0 (--set eval.samples=[3])", "a prompt is a string, or a list of chat messages"]),
        ("one prompt", ["eval.samples", "valid list"]),
        ("[ok, [{role: user}]]", ["eval.samples.1.messages.0.content", "Field required"]),
        ("[ok, []]", ["eval.samples", "prompt 1 is an empty list of chat messages"]),
        ("[[{role: user, content: hi, name: x}]]", ["eval.samples.0.messages.0.name", "unknown key"]),
    ],
)
def test_a_bad_prompt_is_refused_naming_it(value: str, fragments: list[str]) -> None:
    from acc_train.config import load_job

    with pytest.raises(UserError) as refused:
        load_job(sets=[f"eval.samples={value}"])
    assert all(f in str(refused.value) for f in fragments), str(refused.value)


def test_chat_messages_without_a_chat_template_are_refused_before_launch(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """The tiny model's tokenizer has no chat template: exit 2 naming the prompt, no worker started."""
    out = tmp_path / "run"
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, out, "--set", "eval.samples=[fine, [{role: user, content: hi}]]", "--max-steps", "1"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "eval.samples[1]" in proc.stderr and "has no chat template" in proc.stderr and "give that prompt as a string" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
