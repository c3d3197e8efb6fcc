"""`acc-train report OUTPUT_DIR`: the summary a user reads and the PNG they look at, from a
run's files alone."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import cli_in_process


def summary_of(stdout: str) -> dict[str, str]:
    """The summary table's rows (up to the first blank line; the samples come after it): key,
    two or more spaces, value."""
    table = stdout.strip().split("\n\n")[0]
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in table.splitlines() if line.strip())


def fake_run(out: Path, finished: bool = True) -> Path:
    out.mkdir(parents=True)
    lines = []
    for step in range(1, 31):
        lines.append({"step": step, "epoch": 0, "loss": 5.0 - step * 0.1, "lr": 1e-3 * min(1, step / 5), "grad_norm": 1.0, "tokens": step * 512, "tokens_per_s": 900.0 + step, "mfu": 0.1 + step * 0.001, "elapsed_s": step * 0.5})
        if step % 10 == 0:
            lines.append({"step": step, "eval_loss": 4.5 - step * 0.05})
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 31, "lo')  # a line cut short
    (out / "config.yaml").write_text("strategy:\n  name: zero3\n")
    for step in (20, 30):
        d = out / "checkpoints" / f"step-{step:06d}"
        d.mkdir(parents=True)
        (d / "manifest.json").write_text(json.dumps({"step": step}))
    (out / "checkpoints" / ".staging-step-000040").mkdir()
    (out / "checkpoints" / "latest").write_text("step-000030\n")
    if finished:
        summary = {"strategy": "zero3", "distributed_type": "DistributedType.DEEPSPEED", "world_size": 2, "steps": 30, "start_step": 0,
                   "final_loss": 2.0, "best_loss": 2.0, "final_eval_loss": 3.0, "tokens_per_s": 930.5, "elapsed_s": 15.0,
                   "mfu": 0.125, "mfu_basis": {"flops_per_token": 9150336.0, "peak_flops": 3.185e11, "precision": "fp32"}}  # fmt: skip
        (out / "run.json").write_text(json.dumps(summary))
    return out


def test_report_prints_the_summary_and_draws_the_png(tmp_path: Path) -> None:
    out = fake_run(tmp_path / "run")
    proc = cli_in_process("report", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_of(proc.stdout)
    assert rows["strategy"] == "zero3 (DEEPSPEED)" and rows["world size"] == "2" and rows["steps"] == "30"
    assert rows["tokens/s"] == "930" and rows["final loss"] == "2.0000"
    assert rows["MFU"] == "12.5% of 318 GFLOP/s fp32 peak (9.15 MFLOPs/token)"
    assert rows["best loss"] == "2.0000 (step 30)" and rows["eval loss"] == "3.0000 (step 30)"
    assert rows["checkpoints"] == "step-000020 (step 20), step-000030 (step 30, latest)"  # complete ones only
    png = out / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 30_000  # three panels with lines, not an empty canvas
    assert not list(out.glob("*.tmp"))


def test_an_unfinished_run_is_reported_from_its_metrics(tmp_path: Path) -> None:
    out = fake_run(tmp_path / "run", finished=False)
    proc = cli_in_process("report", str(out), "--no-png")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_of(proc.stdout)
    assert "unfinished" in rows["run"] and rows["strategy"] == "zero3" and rows["steps"] == "30"
    assert rows["tokens/s"] == "930" and rows["world size"] == "-"  # the last logged mean; the size is in run.json only
    assert rows["MFU"] == "13.0%"  # the last logged row's; its basis is in run.json only
    assert not (out / "report.png").exists()


@pytest.mark.parametrize("make", [False, True])
def test_a_directory_without_metrics_is_exit_2(tmp_path: Path, make: bool) -> None:
    target = tmp_path / "nothing"
    if make:
        target.mkdir()
    proc = cli_in_process("report", str(target))
    assert proc.returncode == 2
    assert "metrics.jsonl" in proc.stderr or "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.launch
@pytest.mark.xdist_group("reference-runs")
@pytest.mark.parametrize("pointer", [b"step-000099\n", b"\xff\xfe", b""], ids=["dangling", "not-utf8", "empty"])
def test_a_damaged_latest_pointer_shows_the_checkpoint_resume_auto_finds(ddp_run: Path, tmp_path: Path, pointer: bytes) -> None:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(ddp_run, out)
    (out / "checkpoints" / "latest").write_bytes(pointer)
    proc = cli_in_process("report", str(out), "--no-png")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary_of(proc.stdout)["checkpoints"] == "step-000010 (step 10), step-000020 (step 20, latest)"


def report_in_process(out: Path, *args: str) -> Any:
    """``acc-train report OUT ARGS`` in this process (click's runner), as the command runs it."""
    from click.testing import CliRunner

    from acc_train_cli.main import cli

    return CliRunner().invoke(cli, ["report", str(out), *args])


def append_rows(out: Path, *rows: dict) -> None:
    """Add rows to a fake run's metrics.jsonl before its last line, the one cut short (lines
    34, 35, ...: the run logged 33 whole lines)."""
    path = out / "metrics.jsonl"
    whole, _, cut = path.read_text().rpartition("\n")
    path.write_text(whole + "\n" + "".join(json.dumps(r) + "\n" for r in rows) + cut)


HARNESS_ROW = {"step": 30, "harness": {"hellaswag": {"acc": 0.25, "acc_norm": 0.5}}}


@pytest.mark.parametrize(
    ("bad", "key"),
    [
        ({"step": 30, "harness": {"t": {"acc": "x"}}}, "`harness.t.acc` must be a number"),  # crashed the summary's history
        ({"step": 30, "harness": {"t": 5}}, "`harness.t` must be an object"),  # crashed MetricsRow.numbers()
        ({"step": 30, "harness": [1, 2]}, "`harness` must be an object"),
        ({"step": 30, "harness": {"t": {"acc": True}}}, "`harness.t.acc` must be a number"),
    ],
    ids=["score-a-string", "task-a-number", "harness-a-list", "score-a-bool"],
)
def test_a_damaged_harness_row_is_exit_2_naming_file_line_and_key(tmp_path: Path, bad: dict, key: str) -> None:
    """A harness row of the wrong shape at any depth is refused where it is read, naming the file,
    the line and the key, so neither the summary nor a tracker meets a score that is not a number."""
    from acc_train.errors import UserError
    from acc_train.outputs.metrics import read_metrics

    out = fake_run(tmp_path / "run")
    append_rows(out, bad, bad, HARNESS_ROW)
    with pytest.raises(UserError) as caught:
        read_metrics(out)
    assert caught.value.where == str(out / "metrics.jsonl") and caught.value.message.startswith(f"line 34: {key}")
    result = report_in_process(out, "--no-png")
    assert result.exit_code == 2, result.output[-3000:]
    assert result.exception is None or isinstance(result.exception, SystemExit)  # a message, not a traceback
    assert f"error: {out / 'metrics.jsonl'}: line 34: {key}" in result.output


def test_harness_scores_are_shown_with_their_history(tmp_path: Path) -> None:
    out = fake_run(tmp_path / "run")
    later = {"step": 30, "harness": {"hellaswag": {"acc": 0.5, "acc_stderr": 0.1}}}
    append_rows(out, HARNESS_ROW, later)
    result = report_in_process(out, "--no-png")
    assert result.exit_code == 0, result.output[-3000:]
    assert summary_of(result.output)["harness hellaswag"] == "acc 0.5000 (step 30); acc by evaluation: 0.2500 -> 0.5000"
    from acc_train.outputs.metrics import read_metrics

    assert read_metrics(out).evals[-1].numbers() == {"harness/hellaswag/acc": 0.5, "harness/hellaswag/acc_stderr": 0.1}


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"harness": {"t": {"acc": "x"}}, "harness_step": 30}, "`harness.t.acc` must be a number"),
        ({"harness": {"t": 5}}, "`harness.t` must be an object"),
        ({"harness_step": "30"}, "`harness_step` must be an integer"),
        ({"mfu_basis": {"peak_flops": "3e11", "flops_per_token": 9e6}}, "`mfu_basis.peak_flops` must be a number"),
        ({"mfu_basis": [1]}, "`mfu_basis`"),
        ({"world_size": 2.0}, "`world_size` must be an integer"),
    ],
    ids=["harness-score-a-string", "harness-task-a-number", "harness-step-a-string", "peak-flops-a-string", "mfu-basis-a-list", "world-size-a-float"],
)
def test_a_damaged_run_json_is_exit_2_naming_file_and_key(tmp_path: Path, change: dict, key: str) -> None:
    out = fake_run(tmp_path / "run")
    summary = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**summary, **change}, indent=2))
    result = report_in_process(out, "--no-png")
    assert result.exit_code == 2, result.output[-3000:]
    assert f"error: {out / 'run.json'}: {key}" in result.output
