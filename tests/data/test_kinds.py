"""Core's kinds of data on a tiny BPE tokenizer: which tokens count in the loss (what a user
relies on: prompt, system and user text never; completions, assistant turns and their end of
turn always), and that the kinds travel into ``datasets.map`` worker processes."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from acc_train.config import DataConfig
from acc_train.data.kinds import BUILTIN_KINDS, ChatKind, PromptCompletionKind, TextKind
from acc_train.errors import UserError
from tests.data.conftest import CHATML_LAST_DIFFERS, train_tokenizer

CHAT = [
    {"role": "system", "content": "You help with numbers."},
    {"role": "user", "content": "what is two plus four?"},
    {"role": "assistant", "content": "six"},
    {"role": "user", "content": "thank you, and five plus five?"},
    {"role": "assistant", "content": "ten. you say please next time!"},
]


def runs(ids: list[int], mask: list[int], flag: int) -> list[list[int]]:
    """The maximal runs of consecutive tokens whose loss flag is ``flag``."""
    out: list[list[int]] = []
    for i, (token, m) in enumerate(zip(ids, mask)):
        if m == flag:
            if i == 0 or mask[i - 1] != flag:
                out.append([])
            out[-1].append(token)
    return out


def one(kind: Any, row: dict[str, Any], tokenizer: Any, cfg: DataConfig) -> tuple[list[int], list[int]]:
    out = kind.tokenize({k: [v] for k, v in row.items()}, tokenizer, cfg)
    assert set(out) == {"input_ids", "loss_mask"}
    ids, mask = out["input_ids"][0], out["loss_mask"][0]
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    return ids, mask


# --- prompt_completion ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "completion"),
    [("what is two plus four?", " six"), ("Question: capital of france?\nAnswer:", " paris is the city."), ("say yes", "\nyes")],
)
def test_prompt_completion_counts_the_completion_and_eos_only(bpe_tokenizer: Any, prompt: str, completion: str) -> None:
    tok, cfg = bpe_tokenizer, DataConfig(kind="prompt_completion")
    ids, mask = one(PromptCompletionKind(), {"prompt": prompt, "completion": completion}, tok, cfg)
    n = mask.index(1)
    assert mask == [0] * n + [1] * (len(ids) - n), "the prompt comes first, then the completion"
    assert ids[:n] == tok(prompt)["input_ids"], "as TRL: the prompt's own tokens (with the tokenizer's BOS) are context"
    assert ids[0] == tok.bos_token_id and mask[0] == 0
    assert ids[-1] == tok.eos_token_id and mask[-1] == 1, "EOS ends the completion and counts"
    assert tok.decode(ids[n:]) == completion + tok.eos_token


def test_prompt_completion_does_not_add_a_second_eos(bpe_tokenizer: Any) -> None:
    ids, mask = one(PromptCompletionKind(), {"prompt": "say yes", "completion": " yes</s>"}, bpe_tokenizer, DataConfig())
    assert ids.count(bpe_tokenizer.eos_token_id) == 1 and mask[-1] == 1


def test_a_token_merged_across_the_seam_counts_and_no_pure_prompt_token_does(bpe_tokenizer: Any) -> None:
    """``"Answer: " + "six"`` tokenizes as ``... ":", " six"``: the prompt's tokens are not the
    start of the whole's (TRL warns there); the token holding completion text counts."""
    tok = bpe_tokenizer
    prompt, completion = "Answer: ", "six"
    ids, mask = one(PromptCompletionKind(), {"prompt": prompt, "completion": completion}, tok, DataConfig())
    offsets = tok(prompt + completion + tok.eos_token, return_offsets_mapping=True)["offset_mapping"]
    assert ids == tok(prompt + completion + tok.eos_token)["input_ids"]
    for (start, end), m in zip(offsets, mask):
        if end > start:
            assert m == int(end > len(prompt)), "a token counts exactly when it holds completion text"
    assert tok.decode([i for i, m in zip(ids, mask) if m]).strip() == completion + tok.eos_token


def test_prompt_completion_at_byte_level_without_a_tokenizer() -> None:
    ids, mask = one(PromptCompletionKind(), {"prompt": "ab", "completion": "é!"}, None, DataConfig())
    assert ids == list("abé!".encode()) and mask == [0, 0, 1, 1, 1]


def test_rows_of_the_wrong_type_give_empty_examples(bpe_tokenizer: Any) -> None:
    out = PromptCompletionKind().tokenize({"prompt": ["a", None, "b"], "completion": [" yes", "x", 5]}, bpe_tokenizer, DataConfig())
    assert [len(x) for x in out["input_ids"]][1:] == [0, 0] and out["input_ids"][0]


# --- chat -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("marked", [False, True], ids=["incremental", "generation-markers"])
def test_every_assistant_turn_counts_and_nothing_else(bpe_tokenizer: Any, bpe_tokenizer_generation: Any, marked: bool) -> None:
    tok = bpe_tokenizer_generation if marked else bpe_tokenizer
    cfg = DataConfig(kind="chat")
    ids, mask = one(ChatKind(), {"messages": CHAT}, tok, cfg)
    assert ids == tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"], "the template's own tokens"
    # the template ends an assistant turn with <|im_end|>; without markers the newline it writes after it belongs to the turn too
    end = "<|im_end|>" if marked else "<|im_end|>\n"
    assistant = [m["content"] for m in CHAT if m["role"] == "assistant"]
    assert [tok.decode(r) for r in runs(ids, mask, 1)] == [a + end for a in assistant]
    context = tok.decode([i for i, m in zip(ids, mask) if m == 0])
    for m in CHAT:
        if m["role"] != "assistant":
            assert m["content"] in context, f"the {m['role']} text is context"
    assert "<|im_start|>assistant\n" in context, "the template's assistant header is context"


@pytest.mark.parametrize("marked", [False, True], ids=["incremental", "generation-markers"])
def test_chat_batches_keep_rows_apart(bpe_tokenizer: Any, bpe_tokenizer_generation: Any, marked: bool) -> None:
    tok = bpe_tokenizer_generation if marked else bpe_tokenizer
    short = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes."}]
    out = ChatKind().tokenize({"messages": [CHAT, "not a chat", short]}, tok, DataConfig(kind="chat"))
    assert out["input_ids"][1] == [] and out["loss_mask"][1] == []
    assert out["input_ids"][2] == one(ChatKind(), {"messages": short}, tok, DataConfig())[0]
    assert [tok.decode(r) for r in runs(out["input_ids"][2], out["loss_mask"][2], 1)][0].startswith("yes.<|im_end|>")


def test_a_chat_template_breaking_the_prefix_property_is_refused(bpe_tokenizer: Any) -> None:
    tok = train_tokenizer(CHATML_LAST_DIFFERS)
    with pytest.raises(UserError, match="differently from the start") as info:
        ChatKind().check_tokenizer(tok, DataConfig(kind="chat"))
    assert info.value.where == "data.kind" and "generation" in (info.value.hint or "")


def test_chat_needs_a_chat_template_and_a_tokenizer() -> None:
    cfg = DataConfig(kind="chat")
    with pytest.raises(UserError, match="no chat template"):
        ChatKind().check_tokenizer(train_tokenizer(None), cfg)
    with pytest.raises(UserError, match="demo model reads bytes"):
        ChatKind().check_tokenizer(None, cfg)


def test_prompt_completion_accepts_the_demo_tokenizer_and_needs_an_eos(bpe_tokenizer: Any) -> None:
    PromptCompletionKind().check_tokenizer(None, DataConfig())
    PromptCompletionKind().check_tokenizer(bpe_tokenizer, DataConfig())
    no_eos = train_tokenizer(None)
    no_eos.eos_token = None
    with pytest.raises(UserError, match="EOS"):
        PromptCompletionKind().check_tokenizer(no_eos, DataConfig())


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ("hello", "field 'messages' is a str, not a list"),
        ([{"role": "user", "content": "a"}, "b"], "messages entry 2 is a str"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "messages entry 2 has no 'role'"),
        ([{"role": "user"}], "messages entry 1 has no 'content'"),
        ([{"role": "user", "content": ["a"]}], "messages entry 1's 'content' is a list"),
        ([{"role": "user", "content": "a"}], "no assistant message"),
    ],
)
def test_chat_check_row_names_the_problem(messages: object, problem: str) -> None:
    assert problem in (ChatKind().check_row({"messages": messages}, DataConfig(kind="chat")) or "")


def test_check_row_of_good_rows_and_missing_fields() -> None:
    cfg = DataConfig(kind="chat", messages_field="conv", prompt_field="q", completion_field="a")
    assert ChatKind().check_row({"conv": CHAT}, cfg) is None
    assert ChatKind().check_row({"messages": CHAT}, cfg) == "has no field 'conv'"
    assert PromptCompletionKind().check_row({"q": "x", "a": "y"}, cfg) is None
    assert PromptCompletionKind().check_row({"q": "x"}, cfg) == "has no field 'a'"
    assert "is a int" in (PromptCompletionKind().check_row({"q": "x", "a": 3}, cfg) or "")


# --- the kinds as the pipeline uses them ------------------------------------------------------------
def test_builtin_kinds_are_registered_and_pickle() -> None:
    from acc_train.plugins import data_kinds

    assert {k.name for k in BUILTIN_KINDS} == {"text", "prompt_completion", "chat"}
    for kind in BUILTIN_KINDS:
        assert type(data_kinds().get(kind.name)) is type(kind)
        assert type(pickle.loads(pickle.dumps(kind))) is type(kind)
    assert TextKind.continuous and not PromptCompletionKind.continuous and not ChatKind.continuous


def test_chat_tokenizes_in_datasets_worker_processes(bpe_tokenizer: Any) -> None:
    import datasets

    cfg = DataConfig(kind="chat")
    kind = ChatKind()
    ds = datasets.Dataset.from_dict({"messages": [CHAT] * 4})
    mapped = ds.map(lambda b: kind.tokenize(b, bpe_tokenizer, cfg), batched=True, batch_size=2, num_proc=2, remove_columns=["messages"])
    assert mapped["input_ids"] == [one(kind, {"messages": CHAT}, bpe_tokenizer, cfg)[0]] * 4


def test_the_hooks_page_example_kind_works_as_a_plugin(tmp_path: Any, bpe_tokenizer: Any) -> None:
    """docs/hooks.md's data-kind plugin, registered in-process: selected by data.kind, its
    rows checked before launch with the line, its tokens masked as it says."""
    import json
    import re
    import types
    from pathlib import Path

    from acc_train import plugins
    from acc_train.data import check_data_files, data_kind

    page = (Path(__file__).resolve().parents[2] / "docs" / "hooks.md").read_text()
    section = page.split("## acc_train_register_data_kinds", 1)[1].split("\n## ", 1)[0]
    example = re.findall(r"```python\n(.*?)```", section, flags=re.S)[1]
    module = types.ModuleType("qa_plugin")
    exec(compile(example, "docs/hooks.md", "exec"), module.__dict__)
    plugins.reset()
    try:
        plugins.get_plugin_manager().register(module, name="qa-plugin")
        cfg = DataConfig(kind="qa", train_files=[str(tmp_path / "qa.jsonl")])
        (tmp_path / "qa.jsonl").write_text(json.dumps({"question": "two plus four?", "answer": "six"}) + "\n" + json.dumps({"question": "x"}) + "\n")
        with pytest.raises(UserError, match=r"qa.jsonl', line 2: has no field 'answer'"):
            check_data_files(cfg)
        kind = data_kind(cfg)
        kind.check_tokenizer(bpe_tokenizer, cfg)
        with pytest.raises(UserError, match="EOS"):
            kind.check_tokenizer(None, cfg)
        out = kind.tokenize({"question": ["two plus four?", None], "answer": ["six", "y"]}, bpe_tokenizer, cfg)
        ids, mask = out["input_ids"][0], out["loss_mask"][0]
        assert bpe_tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "six</s>" and out["input_ids"][1] == []
    finally:
        plugins.reset()


def test_a_conversation_the_template_refuses_is_a_user_error() -> None:
    strict = "{% for m in messages %}{% if m['role'] == 'user' and loop.index0 % 2 %}{{ raise_exception('roles must alternate') }}{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    tok = train_tokenizer(strict)
    ChatKind().check_tokenizer(tok, DataConfig(kind="chat"))
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(UserError, match="cannot render a conversation: .*roles must alternate"):
        ChatKind().tokenize({"messages": [twice]}, tok, DataConfig(kind="chat"))
