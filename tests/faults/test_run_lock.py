"""One run per output directory: the command holds a lock on it for the run's life."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from acc_train import UserError
from acc_train.outputs.run_lock import LOCK_NAME, run_lock

from tests.conftest import cli_in_process, read_metrics, tiny_job_args


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with run_lock(str(out)):
        holder = json.loads((out / LOCK_NAME).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(UserError) as err:
            with run_lock(str(out)):
                pass
        assert f"is in use by another run (pid {os.getpid()} on {holder['host']}, since {holder['since']})" in str(err.value)
    assert not out.exists()  # the run wrote nothing: no directory left behind


def test_the_lock_leaves_a_users_directory_as_it_was(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with run_lock(str(tmp_path)):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    with run_lock(str(tmp_path)):
        (tmp_path / "metrics.jsonl").write_text("")
    assert (tmp_path / LOCK_NAME).read_text() == ""  # kept beside the run's files, held by nobody


@pytest.mark.launch
def test_a_second_run_into_a_busy_output_dir_is_refused_and_the_first_finishes(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    out = tmp_path / "run"
    args = tiny_job_args(tiny_model_dir, tiny_data, out, "--num-processes", "2", "--max-steps", "150", "--set", "checkpoint.every=50")
    first = subprocess.Popen([sys.executable, "-m", "acc_train_cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped: list[psutil.Process] = []
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 300
        while not (metrics.is_file() and metrics.read_text()) and time.time() < deadline and first.poll() is None:
            time.sleep(0.05)
        # the first run trains: hold its workers still while the second starts (no race with its end)
        stopped = psutil.Process(first.pid).children(recursive=True)
        for proc in stopped:
            proc.suspend()
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == first.pid
        # --overwrite would replace the run: refused before anything is touched
        second = cli_in_process(*args, "--overwrite")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by another run (pid {first.pid} on" in second.stderr and "Traceback" not in second.stderr
    finally:
        for proc in stopped:
            proc.resume()
        _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert sorted(read_metrics(out)) == list(range(1, 151))  # every step written once
