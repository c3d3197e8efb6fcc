"""Save on a signal, then stop: a SIGTERM or SIGINT to the launcher (Kubernetes' eviction, Ctrl-C)
or to every process (Slurm at preemption) makes the workers agree at a step boundary, write a
checkpoint of that step and stop; the command prints one line and exits 128 + the signal's
number, no traceback; ``--resume auto`` then gives the uninterrupted run's losses.

The workers are suspended while the signal is sent and resumed after it, so the step it lands on
does not depend on how fast the machine is."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import assert_same_losses, read_metrics, reference_args, run_cli

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("signals")]  # its own: not serialized behind the reference runs' group


def _stop_mid_run(
    args: list[str], out: Path, signum: int, to_every_process: bool, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], int]:
    """Start ``acc-train ARGS``; once it has trained a few steps, send ``signum`` to the launcher
    (or to it and every worker); return the finished command and the step its workers were at."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "acc_train_cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.02)
    workers = psutil.Process(proc.pid).children(recursive=True)
    for w in workers:
        w.suspend()
    step = metrics.read_text().count("\n")
    os.kill(proc.pid, signum)
    if to_every_process:  # as Slurm signals a job step: each process, the launcher's copy arriving too
        for w in workers:
            os.kill(w.pid, signum)
    for w in workers:
        w.resume()
    stdout, stderr = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), step


@pytest.mark.parametrize(
    ("strategy", "signum", "to_every_process"),
    [
        ("ddp", signal.SIGTERM, False),
        ("fsdp", signal.SIGTERM, False),
        ("zero3", signal.SIGTERM, False),
        ("ddp", signal.SIGTERM, True),
        ("ddp", signal.SIGINT, True),
    ],
    ids=["ddp-launcher", "fsdp-launcher", "zero3-launcher", "ddp-every-process", "ddp-sigint"],
)
def test_a_signal_saves_the_step_stops_and_resumes_to_the_same_losses(
    strategy: str, signum: int, to_every_process: bool, ddp_run: Path, tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    args = reference_args(tiny_model_dir, tiny_data, out, "--strategy", strategy)
    env = None
    if to_every_process and signum == signal.SIGTERM:  # as Slurm does it: a job submitted with --requeue asks to be requeued
        env = _fake_slurm(tmp_path)
        args += ["--set", "launch.requeue=true", "--resume", "auto"]  # the requeued job runs this same command
    stopped, step = _stop_mid_run(args, out, signum, to_every_process, env)
    assert stopped.returncode == 128 + signum, stopped.stderr[-3000:]
    if env is not None:
        assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # asked once, by the command, after the save
        assert "requeued Slurm job 4242: when it starts again, it continues from the latest checkpoint (resume: auto)" in stopped.stderr
    name = signal.Signals(signum).name
    line = re.search(rf"stopped by {name} at step (\d+): checkpoint (\S+) saved; continue with `acc-train \.\.\. --output-dir {out} --resume auto`", stopped.stderr)
    assert line, stopped.stderr[-3000:]
    saved_at = int(line.group(1))
    # the signal lands in the step after the last logged one (or in the logged one's last moments,
    # before its line is written): saved at the next step boundary
    assert step <= saved_at <= step + 2 < 20
    assert Path(line.group(2)) == out / "checkpoints" / f"step-{saved_at:06d}"
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{saved_at:06d}"
    assert "Traceback" not in stopped.stderr
    assert not (out / "run.json").exists() and not (out / "final").exists()  # the run is not over
    reference = read_metrics(ddp_run)
    before = read_metrics(out)
    assert sorted(before) == list(range(1, saved_at + 1))  # every step up to the save logged once
    for s in before:
        assert before[s]["loss"] == pytest.approx(reference[s]["loss"], abs=1e-6), s
    if signum == signal.SIGINT:  # the resume path is SIGTERM's
        return
    resumed = run_cli(*args, env=env) if env is not None else run_cli(*args, "--resume", "auto")  # the requeued job, or the user
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_losses(read_metrics(out), reference)
    if env is not None:  # a run that finishes is not requeued
        assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"


def _fake_slurm(tmp_path: Path) -> dict[str, str]:
    """A Slurm job's variables and an ``scontrol`` that logs what it was asked."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    scontrol.chmod(0o755)
    return {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
