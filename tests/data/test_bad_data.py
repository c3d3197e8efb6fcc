"""Bad data under each kind, refused by ``acc-train`` before any worker starts: exit 2, one
``error:`` message naming the file and the line (or the key), no traceback, and no output
directory written. Plus the same checks in-process for parquet and ``.txt`` files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from acc_train.config import DataConfig
from acc_train.data import check_data_files
from acc_train.errors import UserError
from tests.conftest import cli_in_process
from tests.data.conftest import CHATML, save_tokenizer_into

GOOD_CHAT = {"messages": [{"role": "user", "content": "what is two plus four?"}, {"role": "assistant", "content": "six"}]}
GOOD_PC = {"prompt": "what is two plus four?", "completion": " six"}


def jsonl(*rows: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def refused(tmp_path: Path, model: Path, kind: str, files: dict[str, str | bytes], names: list[str], *extra: str) -> str:
    """Run a tiny training job on ``train.*`` of ``files`` and assert it was refused before launch."""
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    train = next(n for n in files if n.startswith("train"))
    out = tmp_path / "out"
    proc = cli_in_process(
        "--set", f"model.name_or_path={model}",
        "--set", f"data.train_files=[{tmp_path / train}]",
        "--set", f"data.kind={kind}",
        "--set", "data.seq_len=16",
        "--micro-batch-size", "2", "--mixed-precision", "no", "--num-processes", "1", "--max-steps", "1",
        "--set", "training.progress_bar=false",
        "--output-dir", str(out),
        *extra,
        timeout=300,
    )  # fmt: skip
    shown = f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback (most recent call last)" not in proc.stderr + proc.stdout, shown
    assert proc.returncode == 2, shown
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, shown
    missing = [n for n in names if n.lower() not in proc.stderr.lower()]
    assert not missing, f"the message does not name {missing}:\n{shown}"
    assert not out.exists(), "a refused job writes no output directory"
    return proc.stderr


CASES = [
    ("broken-json-line", "chat", {"train.jsonl": jsonl(GOOD_CHAT, GOOD_CHAT, '{"messages": [{"role": "user"', GOOD_CHAT)}, ["train.jsonl", "line 3", "not JSON"]),
    ("empty-file", "prompt_completion", {"train.jsonl": ""}, ["train.jsonl", "empty"]),
    ("missing-field-text", "text", {"train.jsonl": jsonl({"body": "a b"}, {"body": "c d"})}, ["train.jsonl", "data.text_field", "'text'"]),
    ("missing-field-prompt-completion", "prompt_completion", {"train.jsonl": jsonl(GOOD_PC, GOOD_PC, {"prompt": "hi"})}, ["train.jsonl", "line 3", "no field 'completion'"]),
    ("missing-field-chat", "chat", {"train.jsonl": jsonl(GOOD_CHAT, {"conversation": []})}, ["train.jsonl", "line 2", "no field 'messages'"]),
    ("messages-a-string", "chat", {"train.jsonl": jsonl(GOOD_CHAT, {"messages": "user: hi"})}, ["train.jsonl", "line 2", "not a list"]),
    ("messages-entry-no-role", "chat", {"train.jsonl": jsonl(GOOD_CHAT, GOOD_CHAT, GOOD_CHAT, {"messages": [{"role": "user", "content": "a"}, {"content": "b"}]})}, ["train.jsonl", "line 4", "messages entry 2 has no 'role'"]),
    ("messages-entry-a-list", "chat", {"train.jsonl": jsonl(GOOD_CHAT, {"messages": [["user", "hi"]]})}, ["train.jsonl", "line 2", "messages entry 1 is a list"]),
    ("messages-no-assistant", "chat", {"train.jsonl": jsonl({"messages": [{"role": "user", "content": "hi"}]})}, ["train.jsonl", "line 1", "no assistant message"]),
    ("not-utf8", "chat", {"train.jsonl": jsonl(GOOD_CHAT).encode() + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'}, ["train.jsonl", "utf-8", "line 2"]),
    ("unknown-kind", "chatml", {"train.jsonl": jsonl(GOOD_CHAT)}, ["data.kind", "chatml", "prompt_completion", "did you mean 'chat'"]),
    ("txt-under-chat", "chat", {"train.txt": "hello there\n"}, ["train.txt", "data.kind", "plain text"]),
]


@pytest.mark.parametrize(("kind", "files", "names"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_data_is_refused_before_launch(tmp_path: Path, tiny_model_dir: Path, kind: str, files: dict, names: list[str]) -> None:
    refused(tmp_path, tiny_model_dir, kind, files, names)


def test_a_tokenizer_without_chat_template_under_kind_chat(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The tiny model's word-level tokenizer has no chat template."""
    refused(tmp_path, tiny_model_dir, "chat", {"train.jsonl": jsonl(GOOD_CHAT)}, ["no chat template", "data.kind", str(tiny_model_dir)])


def test_the_demo_job_under_kind_chat(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = cli_in_process("--set", "data.kind=chat", "--num-processes", "1", "--max-steps", "1", "--output-dir", str(out), timeout=300)
    assert proc.returncode == 2 and "data.kind 'chat'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


def test_a_chat_template_without_the_prefix_property_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tests.data.conftest import CHATML_LAST_DIFFERS

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    save_tokenizer_into(model, CHATML_LAST_DIFFERS)
    refused(tmp_path, model, "chat", {"train.jsonl": jsonl(GOOD_CHAT)}, ["chat template", "differently from the start", "data.kind"])


# --- in-process: what passes, parquet, json lists ----------------------------------------------------
def test_good_files_of_each_kind_pass(tmp_path: Path) -> None:
    (tmp_path / "chat.jsonl").write_text(jsonl(GOOD_CHAT, GOOD_CHAT))
    (tmp_path / "pc.json").write_text(json.dumps([GOOD_PC, GOOD_PC], indent=2))
    check_data_files(DataConfig(kind="chat", train_files=[str(tmp_path / "chat.jsonl")]))
    check_data_files(DataConfig(kind="prompt_completion", train_files=[str(tmp_path / "pc.json")]))


def test_a_json_list_names_the_row(tmp_path: Path) -> None:
    (tmp_path / "pc.json").write_text(json.dumps([GOOD_PC, {"prompt": "x", "completion": 1}], indent=2))
    with pytest.raises(UserError, match=r"pc.json', row 2: field 'completion' is a int"):
        check_data_files(DataConfig(kind="prompt_completion", train_files=[str(tmp_path / "pc.json")]))


def test_parquet_columns_and_rows_are_checked(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [" x", " y"]}), path)
    with pytest.raises(UserError, match=r"has no column 'completion' \(columns: \['prompt', 'answer'\]\)"):
        check_data_files(DataConfig(kind="prompt_completion", train_files=[str(path)]))
    check_data_files(DataConfig(kind="prompt_completion", completion_field="answer", train_files=[str(path)]))
    pq.write_table(pa.table({"messages": [GOOD_CHAT["messages"], [{"role": "user", "content": "no reply"}]]}), path)
    with pytest.raises(UserError, match=r"train.parquet', row 2: messages has no assistant message"):
        check_data_files(DataConfig(kind="chat", train_files=[str(path)]))
    with pytest.raises(UserError, match=r"has no column 'text'") as info:
        check_data_files(DataConfig(kind="text", train_files=[str(path)]))
    assert info.value.where == "data.text_field"
    with pytest.raises(UserError) as info:
        check_data_files(DataConfig(kind="prompt_completion", train_files=[str(path)]))
    assert info.value.where == "data.prompt_field"


def test_a_chat_row_checks_with_the_templated_tokenizer_in_process(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A good chat job passes every check before launch (the tokenizer's too)."""
    from acc_train.data import data_kind
    from acc_train.model.build import load_tokenizer
    from acc_train.config import ModelConfig

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    save_tokenizer_into(model, CHATML)
    (tmp_path / "chat.jsonl").write_text(jsonl(GOOD_CHAT))
    cfg = DataConfig(kind="chat", train_files=[str(tmp_path / "chat.jsonl")])
    check_data_files(cfg)
    data_kind(cfg).check_tokenizer(load_tokenizer(ModelConfig(name_or_path=str(model))), cfg)
