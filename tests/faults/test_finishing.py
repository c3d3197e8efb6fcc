"""Finishing is recoverable: ``final/`` is replaced whole or not at all, and a run that trained
to its last step but died while finishing is finished by ``--resume auto`` instead of refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from acc_train.files.output_paths import replace_directory

from tests.conftest import cli_in_process, reference_args, run_cli


def test_replace_directory_swaps_in_the_new_one_whole(tmp_path: Path) -> None:
    target, new = tmp_path / "final", tmp_path / ".final-new"
    target.mkdir()
    (target / "model.safetensors").write_text("old")
    new.mkdir()
    (new / "model.safetensors").write_text("new")
    replace_directory(new, target)
    assert (target / "model.safetensors").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    fresh = tmp_path / ".final-2"
    fresh.mkdir()
    replace_directory(fresh, tmp_path / "absent")
    assert (tmp_path / "absent").is_dir() and not fresh.exists()


@pytest.mark.launch
@pytest.mark.xdist_group("reference-runs")
def test_resume_auto_finishes_a_run_that_died_while_finishing(ddp_run: Path, tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(ddp_run, out)
    shutil.rmtree(out / "final")
    (out / "run.json").unlink()  # killed (or out of disk) after the last checkpoint, while writing final/
    partial = out / ".final-k9x2"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 100)
    proc = run_cli(*reference_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", "--resume", "auto"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, reference = json.loads((out / "run.json").read_text()), json.loads((ddp_run / "run.json").read_text())
    assert summary["steps"] == 20 and summary["start_step"] == 20
    assert summary["final_loss"] == pytest.approx(reference["final_loss"], abs=1e-6)
    assert (out / "final" / "config.json").is_file() and not list(out.glob(".final-*"))
    assert sorted(p.name for p in (out / "final").iterdir()) == sorted(p.name for p in (ddp_run / "final").iterdir())
    # a finished run is not finished twice
    again = cli_in_process(*reference_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", "--resume", "auto"))
    assert again.returncode == 2 and "the checkpoint is at step 20, and this run stops at step 20" in again.stderr
