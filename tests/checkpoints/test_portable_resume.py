"""Checkpoints outlive strategies: a run saved under one strategy and world size resumes
under another, with its optimizer state, and continues as an uninterrupted run under the new
setting would have (2 CPU processes over gloo, the tiniest model, dropout off so that runs on
different world sizes draw no random numbers that could differ)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import read_metrics, reference_args, run_cli, shared_runs

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("portable")]

#: each writer: 20 steps, checkpoints at 10 and 20; the global batch is 8 sequences everywhere
SETTINGS = {
    "zero3-2": ("--strategy", "zero3"),
    "zero2-2": ("--strategy", "zero2"),
    "fsdp2-2": ("--strategy", "fsdp"),
    "ddp-2": ("--strategy", "ddp"),
    "ddp-1": ("--strategy", "ddp", "--num-processes", "1", "--micro-batch-size", "8"),
}


@pytest.fixture(scope="module")
def runs(no_dropout_model: Path, tiny_data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted runs, made on first use and shared by the module's tests."""
    return shared_runs(tmp_path_factory, lambda setting, out: reference_args(no_dropout_model, tiny_data, out, *SETTINGS[setting]))


def _portable_tensors(checkpoint: Path) -> dict:
    from acc_train.checkpoint import read_portable_full

    return read_portable_full(checkpoint)


@pytest.mark.parametrize(
    ("writer", "reader", "via"),
    [
        # another format, same world size: deepspeed's files -> the portable state -> FSDP2 (and back)
        ("zero3-2", "fsdp2-2", "portable"),
        ("fsdp2-2", "zero2-2", "portable"),
        # another format and world size
        ("zero3-2", "ddp-1", "portable"),
        # the same format (dcp) under another strategy: DCP itself reshards DDP's replica into FSDP2's shards
        ("ddp-2", "fsdp2-2", "native"),
    ],
)
def test_resume_under_another_strategy_or_world_size_continues_its_run(
    writer: str, reader: str, via: str, runs, no_dropout_model: Path, tiny_data: dict[str, Path], tmp_path: Path
) -> None:
    import torch

    saved = runs(writer) / "checkpoints" / "step-000010"
    out = tmp_path / "resumed"
    proc = run_cli(*reference_args(no_dropout_model, tiny_data, out, *SETTINGS[reader], "--resume", str(saved)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["start_step"] == 10 and summary["resumed_from"] == str(saved)
    assert summary["resumed_via"] == via, (writer, reader, summary["resumed_via"])  # the path the load really took
    written = json.loads((saved / "manifest.json").read_text())
    native = json.loads((runs(reader) / "checkpoints" / "step-000010" / "manifest.json").read_text())
    same = (written["format"], written["world_size"]) == (native["format"], native["world_size"])
    assert same == (via == "native"), (written["format"], written["world_size"], native["format"], native["world_size"])

    uninterrupted = runs(reader)
    again, full = read_metrics(out), read_metrics(uninterrupted)
    assert sorted(again) == list(range(11, 21))
    for step in range(11, 21):
        assert again[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-4), (writer, reader, step)
        assert again[step]["lr"] == pytest.approx(full[step]["lr"], rel=1e-6), step

    # the optimizer state was carried, not started afresh: Adam's step count and moments at step
    # 20 are those of the uninterrupted run (restarted moments would hold only 10 steps' worth)
    mine = _portable_tensors(out / "checkpoints" / "step-000020")
    theirs = _portable_tensors(uninterrupted / "checkpoints" / "step-000020")
    moments = [k for k in theirs if k.startswith("optim.state.") and k.endswith(".exp_avg_sq")]
    assert moments and set(moments) <= set(mine)
    for key in moments:
        torch.testing.assert_close(mine[key], theirs[key], rtol=2e-3, atol=1e-9)
        assert float(mine[key.removesuffix("exp_avg_sq") + "step"]) == 20.0
    for key in (k for k in theirs if k.startswith("model.")):
        torch.testing.assert_close(mine[key], theirs[key], rtol=1e-3, atol=1e-5)


def test_a_resume_that_changes_the_global_batch_is_refused(runs, no_dropout_model: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    saved = runs("zero3-2") / "checkpoints" / "step-000010"
    out = tmp_path / "resumed"
    proc = run_cli(*reference_args(no_dropout_model, tiny_data, out, "--strategy", "ddp", "--num-processes", "1", "--resume", str(saved)))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "global_batch: checkpoint 8, this run 4" in proc.stderr
    assert "Traceback" not in proc.stderr
