"""``checkpoint.async_save``: the state is written in the background while training goes on,
and the run, its checkpoints and a resume from them are exactly those of synchronous saves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acc_train.checkpoint import verify_checkpoint
from tests.conftest import read_metrics, reference_args, run_cli

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("reference-runs")]


def test_async_saves_commit_complete_checkpoints_and_resume_exactly(
    ddp_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    out = tmp_path / "run"
    args = reference_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", "--set", "checkpoint.async_save=true")
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "run.json").read_text())
    saves = summary["checkpoint_saves"]
    assert saves["mode"] == "async" and len(saves["blocked_s"]) == 2
    assert json.loads((ddp_run / "run.json").read_text())["checkpoint_saves"]["mode"] == "sync"
    assert summary["checkpoints"] == [str(out / "checkpoints" / "step-000010"), str(out / "checkpoints" / "step-000020")]
    for step in (10, 20):
        assert verify_checkpoint(out / "checkpoints" / f"step-{step:06d}")["step"] == step
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000020"
    full, mine = read_metrics(ddp_run), read_metrics(out)
    for step in range(1, 21):  # saving in the background changes nothing in the training
        assert mine[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-6), step

    resumed = tmp_path / "resumed"
    proc = run_cli(*reference_args(tiny_model_dir, tiny_data, resumed, "--strategy", "ddp", "--resume", str(out / "checkpoints" / "step-000010")))
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = read_metrics(resumed)
    for step in range(11, 21):
        assert again[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-6), step


def test_async_save_under_a_format_that_cannot_is_refused_before_launch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli("--strategy", "zero3", "--set", "checkpoint.async_save=true", "--output-dir", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "checkpoint.async_save" in proc.stderr and "'deepspeed'" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
