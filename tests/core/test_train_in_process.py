"""The loop in one process (no launch): the demo job, hooks, and the final model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from acc_train import hookimpl, plugins
from acc_train.config import load_job
from acc_train.outputs.metrics import read_metrics
from acc_train.trainer import check_output_dir, train
from tests.conftest import assert_model_card


#: the demo job at its smallest, fp32, no progress bar (one process, in this module's tests)
TINY_DEMO = [
    "model.config={hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2}",
    "data.seq_len=16",
    "data.demo_max_bytes=20000",
    "training.micro_batch_size=2",
    "training.mixed_precision=no",
    "training.progress_bar=false",
]


@pytest.fixture(autouse=True)
def _one_process(single_process: None) -> None:
    """Every test here runs the loop in this process (tests/conftest.py ``single_process``)."""


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    @hookimpl
    def acc_train_train_start(self, run: Any) -> None:
        self.calls.append(("train_start", run.step))

    @hookimpl
    def acc_train_step_end(self, run: Any, step: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("step_end", step))

    @hookimpl
    def acc_train_log(self, run: Any, step: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("log", step))

    @hookimpl
    def acc_train_eval_end(self, run: Any, step: int, metrics: dict[str, Any]) -> None:
        self.calls.append(("eval_end", step))

    @hookimpl
    def acc_train_checkpoint_saved(self, run: Any, step: int, path: str) -> None:
        self.calls.append(("checkpoint_saved", step))

    @hookimpl
    def acc_train_train_end(self, run: Any, summary: dict[str, Any]) -> None:
        self.calls.append(("train_end", summary["steps"]))


def test_demo_job_trains_fires_hooks_in_order_and_exports_a_transformers_model(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    recorder = Recorder()
    plugins.get_plugin_manager().register(recorder, name="recorder")
    job = load_job(
        flags={"output_dir": (str(tmp_path / "run"), "--output-dir"), "training.max_steps": (6, "--max-steps")},
        sets=[
            "model.config={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2}",
            "data.seq_len=32",
            "data.demo_max_bytes=60000",
            "training.micro_batch_size=4",
            "training.mixed_precision=no",
            "training.progress_bar=false",
            "training.eval_every=3",
            "checkpoint.every=4",
            'eval.samples=["import "]',
            "eval.max_new_tokens=6",
        ],
    )
    out = check_output_dir(job)
    summary = train(job)

    # the rows are read (acc_train_log) only at the run's first step (the progress bar's first
    # loss), before an evaluation, a save and the end (training.read_every is 10), each step's
    # row then, in order
    assert recorder.calls == [
        ("train_start", 0),
        ("step_end", 1), ("log", 1), ("step_end", 2), ("step_end", 3), ("log", 2), ("log", 3), ("eval_end", 3),
        ("step_end", 4), ("log", 4), ("checkpoint_saved", 4), ("step_end", 5),
        ("step_end", 6), ("log", 5), ("log", 6), ("checkpoint_saved", 6), ("eval_end", 6),  # saved before evaluating
        ("train_end", 6),
    ]  # fmt: skip
    assert summary["distributed_type"] == "DistributedType.NO" and summary["world_size"] == 1
    assert json.loads((out / "run.json").read_text())["steps"] == 6
    losses = [row.loss for row in read_metrics(out).training]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000006"
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.vocab_size == 256 and model.config.hidden_size == 32
    assert assert_model_card(out, "ddp").get("base_model") is None  # the demo model: no base
    # acc-train generate's path: the demo model reads and writes bytes; greedy is deterministic
    from acc_train.evaluation.generate import generate
    from acc_train.evaluation.trained import load_trained_model

    loaded, tokenizer, source = load_trained_model(str(out))
    assert tokenizer is None and source == str(out / "final")
    pieces: list[str] = []
    first = generate(loaded, tokenizer, "import ", max_new_tokens=6, emit=pieces.append)
    assert first["tokens"] == 6 and "".join(pieces) == first["completion"]
    assert generate(loaded, tokenizer, "import ", max_new_tokens=6)["completion"] == first["completion"]
    assert torch.isfinite(model(torch.tensor([list(b"import os")])).logits).all()
    # eval.samples on the demo job (bytes in, bytes out): a row at each evaluation, the last one
    # the final model's own greedy completion, and acc-train report shows them
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"], r["new_tokens"]) for r in rows] == [(3, "import ", 6), (6, "import ", 6)]
    assert rows[-1]["completion"] == first["completion"]
    from click.testing import CliRunner

    from acc_train_cli.main import cli

    report = CliRunner().invoke(cli, ["report", str(out), "--no-png"])
    assert report.exit_code == 0 and "samples at step 6 (samples.jsonl):" in report.stdout, report.output[-2000:]
    from acc_train.outputs.report import format_samples, read_run

    assert format_samples(read_run(out)) in report.stdout
    assert "      -> " + rows[-1]["completion"].replace("\n", "\n" + " " * 9) in report.stdout


def test_a_run_that_fails_writes_the_rows_it_held_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between reads (every ``training.read_every`` steps) the steps' values wait on the device;
    a failure writes their rows before the error goes on, so metrics.jsonl shows every step up to
    the one that failed."""
    from acc_train.loop import loop

    def failing(name: str, step: int) -> None:
        if name == "train-step" and step == 7:
            raise RuntimeError("the step failed")

    monkeypatch.setattr(loop, "fault_point", failing)
    job = load_job(
        flags={"output_dir": (str(tmp_path / "run"), "--output-dir"), "training.max_steps": (12, "--max-steps")},
        sets=[*TINY_DEMO, "checkpoint.every=0"],
    )
    out = check_output_dir(job)
    with pytest.raises(RuntimeError, match="the step failed"):
        train(job)
    rows = read_metrics(out).training
    assert [row.step for row in rows] == list(range(1, 8))
    assert all(row.loss > 0 and row.grad_norm is not None for row in rows)


def test_resume_refuses_settings_that_change_the_data_order(tmp_path: Path) -> None:
    from acc_train.errors import UserError

    sets = TINY_DEMO
    out = str(tmp_path / "run")
    job = load_job(flags={"output_dir": (out, "--output-dir"), "training.max_steps": (2, "--max-steps")}, sets=sets)
    check_output_dir(job)
    train(job)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    again = load_job(
        flags={"output_dir": (out, "--output-dir"), "training.max_steps": (4, "--max-steps"), "resume": ("latest", "--resume")},
        sets=[*sets, "training.seed=1"],
    )
    with pytest.raises(UserError, match=r"would not continue the checkpoint's data order:\n  seed: checkpoint 42, this run 1"):
        train(again)


def test_a_worker_imports_no_library_its_job_does_not_use(tmp_path: Path) -> None:
    """Accelerate imports ``deepspeed`` and ``datasets`` to ask isinstance questions whenever they
    are installed (about 20 and 85 MiB of RSS per rank); a DDP demo job on two ranks needs
    neither, and matplotlib comes only with the report, after run.json's peak memory is read."""
    import subprocess
    import sys

    job = load_job(
        flags={"output_dir": (str(tmp_path / "run"), "--output-dir"), "training.max_steps": (2, "--max-steps")},
        sets=TINY_DEMO,
    )
    check_output_dir(job)
    config = tmp_path / "job.yaml"  # as the command hands it to the workers
    config.write_text(job.to_yaml())
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\n"
        "from acc_train.config import load_resolved\n"
        "from acc_train.loop import finish\n"
        "from acc_train.trainer import train\n"
        "summarize, seen = finish.summarize, []\n"
        "def spy(*args, **kwargs):\n"
        "    seen.extend(m for m in ('deepspeed', 'datasets', 'matplotlib', 'wandb', 'mlflow') if m in sys.modules)\n"
        "    return summarize(*args, **kwargs)\n"
        "finish.summarize = spy\n"
        "train(load_resolved(sys.argv[1]))\n"
        "print('imported before run.json:', sorted(seen))\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(probe), str(config)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("imported before run.json: []") == 2, proc.stdout[-2000:]


def test_padded_rows_train_real_tokens_and_every_row_has_mfu(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Rows padded per batch (``data.packing: false``): ``tokens`` and ``tokens_per_s`` count the
    examples' tokens, not the padded positions, and every logged row and run.json carry an MFU
    against this machine's probed peak."""
    import random

    from tests.conftest import WORDS

    rng = random.Random(1)
    data = tmp_path / "train.jsonl"
    lengths = [2, 12, 3, 9, 1, 14, 4, 6]  # one epoch: 2 steps of 4 rows, each padded to its batch's longest
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(n))}) + "\n" for n in lengths))
    job = load_job(
        flags={"output_dir": (str(tmp_path / "run"), "--output-dir"), "training.max_steps": (2, "--max-steps")},
        sets=[
            f"model.name_or_path={tiny_model_dir}",
            f"data.train_files=[{data}]",
            "data.packing=false",
            "data.seq_len=16",
            "data.shuffle=false",
            "training.micro_batch_size=4",
            "training.mixed_precision=no",
            "training.progress_bar=false",
            "checkpoint.every=0",
        ],
    )
    out = check_output_dir(job)
    summary = train(job)
    real = sum(n + 1 for n in lengths)  # each example's words and its EOS
    assert summary["data"]["tokens"] == real
    rows = read_metrics(out).training
    assert rows[-1].tokens == real  # the padded positions: 4 * 13 + 4 * 15 = 112, not 58
    for row in rows:
        assert 0 < row.mfu < 1, row
        assert row.tokens_per_s == pytest.approx(row.tokens / row.elapsed_s, rel=0.05)
        assert row.mfu == pytest.approx(row.tokens_per_s * summary["mfu_basis"]["flops_per_token"] / summary["mfu_basis"]["peak_flops"])
    basis = summary["mfu_basis"]
    assert basis["precision"] == "fp32" and basis["devices"] == 1 and "probe" in basis["peak_source"]
    assert basis["flops_per_token"] == 6 * (basis["parameters"] - 64 * 32) + 12 * 1 * 32 * 16  # the tiny model: 1 layer, hidden 32, vocab 64
    assert 0 < summary["mfu"] < 1
    assert summary["tokens"] == real
    assert 0 < summary["tokens_per_s"] <= rows[-1].tokens_per_s  # over the loop's wall time, the last save included


class Chatty:
    """A plugin that prints while the bar is drawn: a Python warning and a line of its own."""

    @hookimpl
    def acc_train_step_end(self, run: Any, step: int, metrics: dict[str, Any]) -> None:
        if step == 2:
            import sys
            import warnings

            # what the warnings module writes to sys.stderr for warnings.warn (which pytest records instead)
            sys.stderr.write(warnings.formatwarning(UserWarning("the plugin warns"), UserWarning, __file__, 1))
            sys.stderr.write("warning: the plugin's own line\n")


def test_what_a_plugin_prints_during_training_gets_its_own_line_above_the_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41: a plugin's warning printed during training landed glued onto the bar's line."""
    import sys

    chatty = Chatty()
    plugins.get_plugin_manager().register(chatty, name="chatty")
    stderr = sys.stderr
    try:
        job = load_job(
            flags={"output_dir": (str(tmp_path / "run"), "--output-dir"), "training.max_steps": (3, "--max-steps")},
            sets=[*TINY_DEMO, "training.progress_bar=true", "checkpoint.every=0", "training.eval_every=0"],
        )
        check_output_dir(job)
        train(job)
    finally:
        plugins.get_plugin_manager().unregister(name="chatty")
    assert sys.stderr is stderr, "the streams are given back when the bar closes"
    err = capsys.readouterr().err
    assert "train:" in err and "3/3" in err, err[-2000:]
    for message in ("UserWarning: the plugin warns", "warning: the plugin's own line"):
        line = next(ln for ln in err.split("\n") if message in ln)
        shown = line.split("\r")[-1].strip()  # what is left on the terminal's line
        assert not shown.startswith("train:"), f"{message!r} printed onto the progress bar: {line!r}"
        assert message.startswith("warning:") <= shown.startswith(message), line
