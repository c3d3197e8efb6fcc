"""Saves are atomic and crashes lose nothing beyond the last checkpoint: a rank SIGKILLed at
any point of a save leaves the previous checkpoint complete, resumable and pointed to; a rank
SIGKILLed mid-training under ``--max-restarts 1`` is restarted and the job finishes with the
losses of an uninterrupted run. (``ACC_TRAIN_FAULT`` makes a rank kill itself at a named point.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from acc_train.checkpoint import verify_checkpoint
from tests.conftest import read_metrics, reference_args, run_cli, tiny_job_args

pytestmark = [pytest.mark.launch]

#: 12 steps, checkpoints at 6 and 12: the kill comes while step 12 is being saved
SHORT = ("--num-processes", "2", "--max-steps", "12", "--set", "checkpoint.every=6", "--set", "checkpoint.keep_last=null", "--set", "data.eval_fraction=0")


@pytest.mark.xdist_group("crash")
@pytest.mark.parametrize(
    "fault",
    [
        "save-state-written@12:1",  # rank 1 has written its part of the state
        "save-before-manifest@12:0",  # every rank is done; rank 0 has not written the manifest
        "save-before-rename@12:0",  # the manifest is in the staging directory
        "save-before-pointer@12:0",  # step-000012 is in place; `latest` still names step 6
    ],
)
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_intact(
    fault: str, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    out = tmp_path / "run"
    args = tiny_job_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", *SHORT)
    proc = run_cli(*args, env={"ACC_TRAIN_FAULT": fault})
    assert proc.returncode != 0, "the killed run must fail"
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000006"
    manifest = verify_checkpoint(ckpts / "step-000006")  # complete: every file matches
    assert manifest["step"] == 6
    staging = ckpts / ".staging-step-000012"
    if fault.startswith("save-before-pointer"):
        verify_checkpoint(ckpts / "step-000012")  # committed whole; only the pointer lagged
    else:
        assert not (ckpts / "step-000012").exists()
        assert not staging.exists(), "the command removes what the killed save left once its workers have ended"
        # a staging directory the command could not remove (the command itself was killed) is never resumed from
        shutil.copytree(ckpts / "step-000006", staging)
        (staging / "manifest.json").unlink()
        refused = run_cli(*args, "--resume", str(staging))
        assert refused.returncode == 2, refused.stderr
        assert "staging directory of a save that did not finish" in refused.stderr and "Traceback" not in refused.stderr
    if fault.startswith("save-before-manifest"):  # and the run resumes from step 6 to the end
        resumed = run_cli(*args, "--resume", "latest")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert (ckpts / "latest").read_text().strip() == "step-000012"
        assert not staging.exists(), "a killed save's staging directory is cleaned up"
        verify_checkpoint(ckpts / "step-000012")
        assert json.loads((out / "run.json").read_text())["steps"] == 12


@pytest.mark.xdist_group("reference-runs")
def test_a_rank_killed_mid_training_is_restarted_and_the_job_finishes_exactly(
    ddp_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    out = tmp_path / "run"
    args = reference_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", "--max-restarts", "1", "--resume", "auto")
    proc = run_cli(*args, env={"ACC_TRAIN_FAULT": "train-step@15:1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary, reference = json.loads((out / "run.json").read_text()), json.loads((ddp_run / "run.json").read_text())
    assert summary["start_step"] == 10 and summary["steps"] == 20  # the restarted workers resumed at step 10
    assert summary["final_loss"] == pytest.approx(reference["final_loss"], abs=1e-6)
    again, full = read_metrics(out), read_metrics(ddp_run)
    assert sorted(again) == list(range(1, 21))
    for step in range(1, 21):
        assert again[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-6), step
