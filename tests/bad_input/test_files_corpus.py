"""Bad input in the files a user hands acc-train: data files, model directories, a run's
``metrics.jsonl``/``run.json``/``config.yaml`` under ``report``, damaged checkpoints under
``checkpoint inspect``, the ``ACC_TRAIN_FAULT`` variable, and odd arguments to the listing
commands.

Each case runs ``acc-train`` in this process inside a workspace (``tests.bad_input.harness``; a
few again in a fresh interpreter, which must answer the same) and must end in exit 2, one ``error:`` message naming the file (and line, key or variable), no
traceback, and every file under the workspace unchanged. Cases that would train are refused
before any worker starts; the one input only a worker can find (a parquet file damaged inside)
is a single launch of one process.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.bad_input.harness import Case, check_case, run_acc_train

GOOD_ROWS = "".join(json.dumps({"text": f"the quick brown fox jumps over a lazy dog {i}"}) + "\n" for i in range(300))
BROKEN_AT_200 = "".join(
    (json.dumps({"text": f"the quick brown fox {i}"}) if i != 199 else '{"text": "a line cut in the middle') + "\n" for i in range(300)
)

#: a case's setup: given (workspace, tiny model dir), puts files there before the snapshot
Setup = Callable[[Path, Path], None]


def train(*extra: str) -> list[str]:
    """A tiny one-process training command (the model is copied to {ws}/model by the fixture)."""
    return [
        "--set", "model.name_or_path={ws}/model",
        "--set", "data.train_files=[{ws}/train.jsonl]",
        "--set", "data.seq_len=16",
        "--micro-batch-size", "2",
        "--mixed-precision", "no",
        "--num-processes", "1",
        "--max-steps", "1",
        "--set", "training.progress_bar=false",
        "--output-dir", "{ws}/out",
        *extra,
    ]  # fmt: skip


def train_on(path: str, *extra: str) -> list[str]:
    return train("--set", f"data.train_files=[{{ws}}/{path}]", *extra)


def edit_config(change: Callable[[dict], object]) -> Setup:
    """Copy the tiny model and change its config.json."""

    def setup(ws: Path, model: Path) -> None:
        config = json.loads((ws / "model" / "config.json").read_text())
        change(config)
        (ws / "model" / "config.json").write_text(json.dumps(config))

    return setup


def write_config(content: bytes) -> Setup:
    def setup(ws: Path, model: Path) -> None:
        (ws / "model" / "config.json").write_bytes(content)

    return setup


def _unset_head_dim(c: dict, hidden: int) -> None:
    c.pop("head_dim", None)
    c["hidden_size"] = hidden


MODEL_EDITS: dict[str, tuple[Setup, list[str]]] = {
    "no-model-type": (edit_config(lambda c: c.pop("model_type")), ["config.json", "model_type"]),
    "hidden-not-divisible": (edit_config(lambda c: _unset_head_dim(c, 33)), ["config.json", "33"]),
    "vocab-abc": (edit_config(lambda c: c.update(vocab_size="abc")), ["config.json", "vocab_size"]),
    "vocab-negative": (edit_config(lambda c: c.update(vocab_size=-5)), ["config.json"]),
    "heads-zero": (edit_config(lambda c: c.update(num_attention_heads=0)), ["config.json"]),
    "layers-absurd": (edit_config(lambda c: c.update(num_hidden_layers=10**7)), ["config.json", "num_hidden_layers"]),
    "unknown-model-type": (edit_config(lambda c: c.update(model_type="nosuchmodel")), ["config.json", "nosuchmodel"]),
    "config-a-list": (write_config(b"[1, 2, 3]"), ["config.json"]),
    "config-binary": (write_config(b"\xff\xfe\x00\x81binary"), ["config.json"]),
    "config-not-json": (write_config(b"model_type: llama\n"), ["config.json"]),
    "config-empty": (write_config(b""), ["config.json"]),
}

CASES: list[tuple[Case, Setup | None]] = []


def case(id: str, args: list[str], names: list[str], files: dict | None = None, env: dict | None = None, setup: Setup | None = None) -> None:
    CASES.append((Case(id, args, names, files or {}, env or {}), setup))


# --- data files, refused before any worker starts ------------------------------------------------
case("data-jsonl-broken-line", train(), ["train.jsonl", "line 200"], {"train.jsonl": BROKEN_AT_200})
case("data-jsonl-empty", train(), ["train.jsonl", "empty"], {"train.jsonl": ""})
case("data-jsonl-blank-lines", train(), ["train.jsonl"], {"train.jsonl": "\n\n  \n"})
case("data-jsonl-binary", train(), ["train.jsonl", "utf-8"], {"train.jsonl": b"\xff\xfe\x00\x81" * 64})
case("data-jsonl-latin1", train(), ["train.jsonl", "utf-8"], {"train.jsonl": GOOD_ROWS.encode() + b'{"text": "caf\xe9"}\n'})
case("data-jsonl-rows-are-lists", train(), ["train.jsonl", "line 1"], {"train.jsonl": "[1, 2]\n[3]\n"})
case("data-jsonl-rows-are-numbers", train(), ["train.jsonl", "line 1"], {"train.jsonl": "1\n2\n3\n"})
case("data-jsonl-truncated-last-line", train(), ["train.jsonl", "line 301"], {"train.jsonl": GOOD_ROWS + '{"text": "cut sh'})
case("data-jsonl-no-text-field", train(), ["train.jsonl", "data.text_field"], {"train.jsonl": '{"content": "a b c"}\n' * 50})
case("data-json-array-of-numbers", train_on("train.json"), ["train.json"], {"train.json": "[1, 2, 3]"})
case("data-json-not-json", train_on("train.json"), ["train.json"], {"train.json": "this is { not json"})
case("data-txt-binary", train_on("train.txt"), ["train.txt", "utf-8"], {"train.txt": b"some text\n\xff\xfe\x80\n" * 20})
case("data-txt-utf16", train_on("train.txt"), ["train.txt", "utf-8"], {"train.txt": "hello world\n".encode("utf-16") * 10})
case("data-txt-empty", train_on("train.txt"), ["train.txt", "empty"], {"train.txt": ""})
case("data-parquet-not-parquet", train_on("train.parquet"), ["train.parquet", "parquet"], {"train.parquet": "hello, not parquet\n"})
case("data-parquet-empty", train_on("train.parquet"), ["train.parquet"], {"train.parquet": b""})
case("data-format-says-parquet", train("--set", "data.format=parquet"), ["train.jsonl", "parquet"], {"train.jsonl": GOOD_ROWS})
case("data-train-is-directory", train_on("adir"), ["data.train_files", "adir"], {"adir/x.jsonl": GOOD_ROWS})
case("data-train-missing", train_on("missing.jsonl"), ["data.train_files", "missing.jsonl"], {"train.jsonl": GOOD_ROWS})
case("data-unknown-extension", train_on("train.csv"), ["data.train_files"], {"train.csv": "text\nhello\n"})
case(
    "data-eval-broken",
    train("--set", "data.eval_files=[{ws}/eval.jsonl]"),
    ["data.eval_files", "eval.jsonl", "line 3"],
    {"train.jsonl": GOOD_ROWS, "eval.jsonl": '{"text": "a"}\n{"text": "b"}\n{oops\n'},
)

# --- model directories: `plan --model DIR` and training on model.name_or_path ------------------
for _name, (_setup, _names) in MODEL_EDITS.items():
    case(f"plan-model-{_name}", ["plan", "--model", "{ws}/model"], _names, setup=_setup)
for _name in ("no-model-type", "hidden-not-divisible", "vocab-abc", "layers-absurd", "config-binary", "heads-zero"):
    _setup, _names = MODEL_EDITS[_name]
    case(f"train-model-{_name}", train(), _names, {"train.jsonl": GOOD_ROWS}, setup=_setup)
def write_model_file(name: str, content: bytes) -> Setup:
    def setup(ws: Path, model: Path) -> None:
        (ws / "model" / name).write_bytes(content)

    return setup


case("train-tokenizer-json-wrong-shape", train(), ["model.name_or_path", "tokenizer.json"], {"train.jsonl": GOOD_ROWS}, setup=write_model_file("tokenizer.json", b'{"model": 5}'))
case("train-tokenizer-json-binary", train(), ["model.name_or_path", "tokenizer.json"], {"train.jsonl": GOOD_ROWS}, setup=write_model_file("tokenizer.json", b"\xff\xfe\x00"))
case("plan-model-config-file-binary", ["plan", "--model", "{ws}/model/config.json"], ["config.json"], setup=write_config(b"\x00\xff" * 40))

# --- report: a run's files of the wrong shape or bytes -------------------------------------------
ROW1 = json.dumps({"step": 1, "loss": 2.5, "lr": 0.001, "grad_norm": 1.0, "tokens": 64, "tokens_per_s": 10.0, "elapsed_s": 1.0})
ROW2 = json.dumps({"step": 2, "loss": 2.4, "lr": 0.001, "grad_norm": 1.0, "tokens": 128, "tokens_per_s": 10.0, "elapsed_s": 2.0})
RUN_JSON = json.dumps({"strategy": "ddp", "distributed_type": "DistributedType.MULTI_CPU", "world_size": 1, "steps": 2, "final_loss": 2.4, "tokens_per_s": 10.0, "elapsed_s": 2.0})


def report_case(id: str, names: list[str], **files: str | bytes) -> None:
    run = {"run/metrics.jsonl": ROW1 + "\n" + ROW2 + "\n", "run/run.json": RUN_JSON, "run/config.yaml": "strategy: ddp\n"}
    run.update({f"run/{k.replace('_jsonl', '.jsonl').replace('_json', '.json').replace('_yaml', '.yaml')}": v for k, v in files.items()})
    case(f"report-{id}", ["report", "--no-png", "{ws}/run"], names, run)


report_case("metrics-binary", ["metrics.jsonl"], metrics_jsonl=b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
report_case("metrics-loss-a-string", ["metrics.jsonl", "line 2", "loss"], metrics_jsonl=ROW1 + "\n" + ROW2.replace("2.4", '"2.4"') + "\n")
report_case("metrics-step-a-string", ["metrics.jsonl", "line 1", "step"], metrics_jsonl=ROW1.replace('"step": 1', '"step": "one"') + "\n")
report_case("metrics-lr-a-list", ["metrics.jsonl", "line 2", "lr"], metrics_jsonl=ROW1 + "\n" + ROW2.replace('"lr": 0.001', '"lr": [1]') + "\n")
report_case("metrics-eval-loss-a-string", ["metrics.jsonl", "line 3", "eval_loss"], metrics_jsonl=ROW1 + "\n" + ROW2 + '\n{"step": 2, "eval_loss": "low"}\n')
report_case("metrics-tokens-per-s-a-string", ["metrics.jsonl", "line 1", "tokens_per_s"], metrics_jsonl=ROW1.replace('"tokens_per_s": 10.0', '"tokens_per_s": "fast"') + "\n")
report_case("metrics-mfu-a-string", ["metrics.jsonl", "line 1", "mfu"], metrics_jsonl=ROW1.replace('"tokens_per_s": 10.0', '"tokens_per_s": 10.0, "mfu": "high"') + "\n")
report_case("metrics-line-a-list", ["metrics.jsonl", "line 1"], metrics_jsonl="[1, 2, 3]\n" + ROW2 + "\n")
report_case("metrics-line-a-number", ["metrics.jsonl", "line 2"], metrics_jsonl=ROW1 + "\n42\n")
report_case("metrics-broken-middle-line", ["metrics.jsonl", "line 2"], metrics_jsonl=ROW1 + '\n{"step": 2, "loss\n' + ROW2 + "\n")
report_case("metrics-deeply-nested", ["metrics.jsonl", "line 1"], metrics_jsonl="[" * 200_000 + "]" * 200_000 + "\n")
report_case("metrics-step-bool", ["metrics.jsonl", "line 1", "step"], metrics_jsonl=ROW1.replace('"step": 1', '"step": true') + "\n")
HARNESS_ROWS = ROW1 + "\n" + ROW2 + "\n" + '{"step": 2, "harness": {"t": {"acc": 0.5}}}\n'
report_case("metrics-harness-score-a-string", ["metrics.jsonl", "line 3", "harness.t.acc"], metrics_jsonl=HARNESS_ROWS.replace("0.5", '"x"') * 2)
report_case("metrics-harness-task-a-number", ["metrics.jsonl", "line 3", "harness.t"], metrics_jsonl=HARNESS_ROWS.replace('{"acc": 0.5}', "5"))
report_case("metrics-harness-a-string", ["metrics.jsonl", "line 3", "harness"], metrics_jsonl=HARNESS_ROWS.replace('{"t": {"acc": 0.5}}', '"good"'))
report_case("run-json-a-list", ["run.json"], run_json="[1, 2]")
report_case("run-json-harness-score-a-string", ["run.json", "harness.t.acc"], run_json=RUN_JSON.replace("{", '{"harness": {"t": {"acc": "x"}}, ', 1))
report_case("run-json-harness-task-a-number", ["run.json", "harness.t"], run_json=RUN_JSON.replace("{", '{"harness": {"t": 5}, ', 1))
BAD_BASIS = '{"mfu": 0.1, "mfu_basis": {"peak_flops": "1e12"}, '
report_case("run-json-mfu-basis-peak-a-string", ["run.json", "mfu_basis.peak_flops"], run_json=RUN_JSON.replace("{", BAD_BASIS, 1))
report_case("run-json-binary", ["run.json"], run_json=b"\xff\xd8\xff\xe0 jpeg")
report_case("run-json-not-json", ["run.json"], run_json="{strategy: ddp")
report_case("run-json-elapsed-a-string", ["run.json", "elapsed_s"], run_json=RUN_JSON.replace('"elapsed_s": 2.0', '"elapsed_s": "long"'))
report_case("run-json-distributed-type-a-number", ["run.json", "distributed_type"], run_json=RUN_JSON.replace('"DistributedType.MULTI_CPU"', "7"))
report_case("run-json-tokens-per-s-a-string", ["run.json", "tokens_per_s"], run_json=RUN_JSON.replace('"tokens_per_s": 10.0', '"tokens_per_s": "1e4"'))
report_case("run-json-mfu-a-string", ["run.json", "mfu"], run_json=RUN_JSON.replace('"tokens_per_s": 10.0', '"tokens_per_s": 10.0, "mfu": "0.4"'))
report_case("config-yaml-a-list", ["config.yaml"], config_yaml="- strategy\n- ddp\n")
report_case("config-yaml-binary", ["config.yaml"], config_yaml=b"strategy: \xff\xfe\n")
report_case("config-yaml-not-yaml", ["config.yaml"], config_yaml="strategy: [ddp\n")
case("report-metrics-a-directory", ["report", "--no-png", "{ws}/run"], ["metrics.jsonl"], {"run/metrics.jsonl/x": "x"})

# --- checkpoint inspect on damaged checkpoints (nothing that depends on the manifest's fields) ---
case("inspect-manifest-binary", ["checkpoint", "inspect", "{ws}/ckpt"], ["manifest.json"], {"ckpt/manifest.json": b"\xff\xfe\x00\x00garbage"})
case("inspect-manifest-not-json", ["checkpoint", "inspect", "{ws}/ckpt"], ["manifest.json"], {"ckpt/manifest.json": "{not json"})
case("inspect-manifest-empty", ["checkpoint", "inspect", "{ws}/ckpt"], ["manifest.json"], {"ckpt/manifest.json": ""})
case("inspect-path-a-binary-file", ["checkpoint", "inspect", "{ws}/blob.bin"], ["blob.bin"], {"blob.bin": b"\x00\x01\xff" * 100})
case("inspect-empty-directory", ["checkpoint", "inspect", "{ws}/ckpt"], ["ckpt"], {"ckpt/.keep": ""})

# --- ACC_TRAIN_FAULT, read once and refused before launch ----------------------------------------
for _id, _value in (
    ("unknown-point", "no-such-point"),
    ("step-not-a-number", "train-step@abc"),
    ("rank-not-a-number", "train-step@3:x"),
    ("no-point", "@5"),
    ("negative-step", "train-step@-1"),
    ("binary-like", "\udcff\udcfe"),
):
    case(f"fault-{_id}", train(), ["ACC_TRAIN_FAULT", "train-step"], {"train.jsonl": GOOD_ROWS}, env={"ACC_TRAIN_FAULT": _value})


@pytest.fixture()
def workspace(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A fresh workspace holding a copy of the tiny model (cases corrupt their own copy)."""
    ws = tmp_path / "ws"
    shutil.copytree(tiny_model_dir, ws / "model")
    return ws


@pytest.mark.parametrize(("case", "setup"), [c for c in CASES], ids=[c.id for c, _ in CASES])
def test_bad_file_is_refused(case: Case, setup: Setup | None, workspace: Path, tiny_model_dir: Path) -> None:
    if setup is not None:
        setup(workspace, tiny_model_dir)
    check_case(case, workspace)


#: cases of each family run again in a fresh interpreter: the in-process runs answer as the command does
FRESH = ["data-jsonl-broken-line", "data-train-missing", "train-tokenizer-json-binary", "plan-model-config-file-binary", "report-metrics-binary", "inspect-manifest-not-json", "fault-unknown-point"]


@pytest.mark.parametrize(("case", "setup"), [{c.id: (c, s) for c, s in CASES}[i] for i in FRESH], ids=FRESH)
def test_a_fresh_interpreter_gives_what_the_in_process_run_gives(case: Case, setup: Setup | None, workspace: Path, tiny_model_dir: Path) -> None:
    if setup is not None:
        setup(workspace, tiny_model_dir)
    fresh = check_case(case, workspace, fresh=True)
    here = check_case(case, workspace)
    assert (here.returncode, here.stdout, here.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


@pytest.mark.launch
def test_data_only_a_worker_can_read_is_refused_by_the_worker(workspace: Path, tmp_path: Path) -> None:
    """A parquet file with the magic bytes at both ends but garbage inside passes every cheap
    check; the worker's ``datasets`` error comes back as one message naming the file. (The run's
    output directory lies outside the watched workspace: a refusal inside a worker may leave it.)"""
    out = tmp_path / "out"
    bad = Case(
        "data-parquet-damaged-inside",
        [a.replace("{ws}/out", str(out)) for a in train_on("train.parquet")],
        ["train.parquet"],
        {"train.parquet": b"PAR1" + b"\x15\x00\x15\xff" * 64 + b"\x10\x00\x00\x00PAR1"},
    )
    result = check_case(bad, workspace, fresh=True)  # workers launched: from a process of its own
    assert result.stderr.count("error:") == 1, result.stderr
    assert len(result.stderr.strip().splitlines()) < 15, result.stderr


#: click's own usage errors print ``Error:``; checked here, case-insensitively, as the config corpus does
CLICK_CASES = [("env", "--json"), ("env", "extra"), ("strategies", "--all"), ("strategies", "ddp"), ("plugins", "--verbose"), ("plugins", "x", "y")]


@pytest.mark.parametrize("args", CLICK_CASES, ids=["-".join(a) for a in CLICK_CASES])
def test_listing_commands_refuse_odd_arguments(args: tuple[str, ...], tmp_path: Path) -> None:
    result = run_acc_train(args, tmp_path)
    shown = f"exit {result.returncode}\n{result.stderr[-2000:]}"
    assert result.returncode == 2, shown
    assert "Traceback" not in result.stderr, shown
    assert "error:" in result.stderr.lower(), shown
    assert args[-1] in result.stderr, shown
    assert not list(tmp_path.iterdir()), "a refused listing command wrote files"
