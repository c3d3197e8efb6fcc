"""Workers die with their launcher: after a SIGKILL of the command (or the OOM killer), no worker
goes on training unsupervised, and what the launch kept outside the output directory is removed
by the next command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from acc_train.launch.scratch import LAUNCHES_DIR

from tests.conftest import run_cli, tiny_job_args

pytestmark = pytest.mark.launch


def test_killing_the_launcher_stops_its_workers(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    out = tmp_path / "run"
    args = tiny_job_args(tiny_model_dir, tiny_data, out, "--num-processes", "2", "--max-steps", "3000", "--set", "checkpoint.every=0")
    proc = subprocess.Popen([sys.executable, "-m", "acc_train_cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (metrics.is_file() and metrics.read_text()):
        time.sleep(0.05)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len(workers) >= 2
    folder = next(p for p in LAUNCHES_DIR.iterdir() if p.name.startswith(f"{proc.pid}-"))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, f"workers outlived their launcher: {[p.pid for p in alive]}"
    assert not (out / "final").exists() and not (out / "run.json").exists()
    # the killed command could not remove its launch folder; the next launch on the machine does
    # (another test's launch may already have: the tests run side by side)
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, tmp_path / "next", "--max-steps", "1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not folder.exists()
