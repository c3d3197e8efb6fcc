"""A lost machine: two machines (one process each, fsdp, on this host), machine 1's command and
worker SIGKILLed mid-run. Machine 0 stops in seconds and says so once, without a traceback: a
peer was lost, the last complete checkpoint, and the command that restarts every machine with
``--resume auto``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_job_args

pytestmark = pytest.mark.launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_lost_machine_is_one_message_with_the_checkpoint_and_the_restart(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    out = tmp_path / "run"
    port = str(_free_port())
    common = ["--strategy", "fsdp", "--num-processes", "1", "--num-machines", "2", "--main-process-ip", "127.0.0.1", "--main-process-port", port,
              "--max-steps", "100000", "--set", "checkpoint.every=3"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def machine(rank: int) -> subprocess.Popen[str]:
        args = tiny_job_args(tiny_model_dir, tiny_data, out, *common, "--machine-rank", str(rank))
        cmd = [sys.executable, "-m", "acc_train_cli", *args]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)

    first, second = machine(0), machine(1)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "latest").is_file():  # a complete checkpoint, then the machine goes
            assert first.poll() is None and second.poll() is None, (first.poll(), second.poll(), first.stderr.read()[-3000:] if first.poll() is not None else "")
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        os.killpg(second.pid, signal.SIGKILL)  # its command and its worker, as when the machine is lost
        lost = time.monotonic()
        _, stderr = first.communicate(timeout=120)
        noticed = time.monotonic() - lost
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    assert first.returncode not in (0, 2), stderr[-3000:]
    assert noticed < 60, f"machine 0 took {noticed:.0f} s to stop"
    assert "error: lost a peer: rank 0 lost its connection to another rank (" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr and "GLHF" not in stderr and "pair.cc" not in stderr, stderr[-3000:]
    assert "last complete checkpoint: " + str(out / "checkpoints" / "step-") in stderr
    restart = next(line for line in stderr.splitlines() if line.startswith("  restart on each of the 2 machines"))
    assert restart.endswith("--resume auto") and "--machine-rank 0" in restart and f"--output-dir {out}" in restart
