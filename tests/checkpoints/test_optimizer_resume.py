"""Every built-in optimizer's state goes into the portable checkpoint and comes back: sgd
(momentum buffers) and adafactor (factored row/column moments) resume exactly, under DDP and,
for sgd, from DDP into FSDP2's shards; where an optimizer cannot run or be saved under a
strategy, the command refuses before launch (2 CPU processes over gloo, the tiniest model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import read_metrics, reference_args, run_cli, shared_runs

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("optimizers")]

#: each uninterrupted run: 20 steps, checkpoints at 10 and 20 (the reference job)
OPTIMIZERS = {
    "sgd": ("--set", "optimizer.name=sgd", "--lr", "0.05", "--set", "optimizer.nesterov=true"),
    "adafactor": ("--set", "optimizer.name=adafactor", "--set", "optimizer.options={beta1: 0.9}"),
}


@pytest.fixture(scope="module")
def runs(no_dropout_model: Path, tiny_data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted DDP runs, one per optimizer, made on first use and shared."""
    return shared_runs(tmp_path_factory, lambda optimizer, out: reference_args(no_dropout_model, tiny_data, out, "--strategy", "ddp", *OPTIMIZERS[optimizer]))


@pytest.mark.parametrize(
    ("optimizer", "strategy", "state_key"),
    [("sgd", "ddp", "momentum_buffer"), ("adafactor", "ddp", "exp_avg_sq_row"), ("sgd", "fsdp", "momentum_buffer")],
)
def test_resume_continues_the_uninterrupted_run(
    optimizer: str, strategy: str, state_key: str, runs, no_dropout_model: Path, tiny_data: dict[str, Path], tmp_path: Path
) -> None:
    """From DDP's step-10 checkpoint, under ``strategy``: steps 11-20 have the uninterrupted
    run's losses, and its optimizer state at step 20 is the uninterrupted run's (restarted
    state would hold 10 steps' worth). FSDP2 computes DDP's updates in fp32 (to 6 decimals)."""
    from acc_train.checkpoint import read_portable_full

    full = runs(optimizer)
    saved = full / "checkpoints" / "step-000010"
    out = tmp_path / "resumed"
    proc = run_cli(*reference_args(no_dropout_model, tiny_data, out, "--strategy", strategy, *OPTIMIZERS[optimizer], "--resume", str(saved)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["start_step"] == 10 and summary["optimizer"]["name"] == optimizer
    assert summary["resumed_via"] == "native"  # dcp under both: DCP reshards the replica into shards
    again, uninterrupted = read_metrics(out), read_metrics(full)
    assert sorted(again) == list(range(11, 21))
    for step in range(11, 21):
        assert again[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], abs=1e-4), (optimizer, strategy, step)

    import torch

    mine = read_portable_full(out / "checkpoints" / "step-000020")
    theirs = read_portable_full(full / "checkpoints" / "step-000020")
    keys = [k for k in theirs if k.startswith("optim.state.") and k.endswith("." + state_key)]
    assert keys and set(keys) <= set(mine)
    for key in keys:
        torch.testing.assert_close(mine[key], theirs[key], rtol=2e-3, atol=1e-7)
    if optimizer == "sgd":
        assert json.loads((full / "run.json").read_text())["optimizer"] == {"name": "sgd"}


@pytest.mark.parametrize(
    ("optimizer", "strategy", "says"),
    [
        ("adafactor", "fsdp", "optimizer 'adafactor' keeps state not shaped like its parameters"),
        ("sgd", "zero2", "optimizer 'sgd' keeps momentum_buffer, which the 'deepspeed' checkpoint format"),
        ("adamw_8bit", "ddp", "optimizer 'adamw_8bit' needs the 'bitsandbytes' package"),
    ],
)
def test_an_optimizer_a_strategy_cannot_run_or_save_is_refused_before_launch(
    optimizer: str, strategy: str, says: str, no_dropout_model: Path, tiny_data: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "refused"
    proc = run_cli(*reference_args(no_dropout_model, tiny_data, out, "--strategy", strategy, "--set", f"optimizer.name={optimizer}"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr and "optimizer.name" in proc.stderr
    assert "Traceback" not in proc.stderr and not (out / "run.json").exists()


def test_a_resume_under_another_optimizer_is_refused(runs, no_dropout_model: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    """sgd's momentum buffers are not AdamW's moments: resuming them under adamw is an error
    naming both, not a run that silently starts AdamW afresh."""
    saved = runs("sgd") / "checkpoints" / "step-000010"
    out = tmp_path / "resumed"
    proc = run_cli(*reference_args(no_dropout_model, tiny_data, out, "--strategy", "ddp", "--resume", str(saved)))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "checkpoint was written with optimizer 'sgd', whose state is not 'adamw''s" in proc.stderr
    assert "optimizer.name: sgd" in proc.stderr and "Traceback" not in proc.stderr
