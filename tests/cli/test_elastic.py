"""Elastic restarts: workers the elastic agent starts again (``--max-restarts N``) continue the
run from the latest complete checkpoint, or start it when there is none yet, without refusing
the output directory their own first attempt wrote; on one machine, and with two "machines" of
one process each on 127.0.0.1 (``--rdzv-backend c10d``) when one of them leaves and comes back.
``run.json`` records ``restarts`` and ``resumed_from``; the launch log says what happened."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import assert_same_losses, read_metrics, reference_args, run_cli, tiny_job_args



def test_a_launch_that_claimed_the_run_continues_it_even_under_overwrite(tmp_path: Path) -> None:
    """The claim marker next to the launch's config (left once its workers claimed the output
    directory) says a later attempt of the same launch, restarted or re-rendezvoused, continues
    the run --overwrite started, whatever the clocks say of config.yaml."""
    import os

    from acc_train.config import load_job
    from acc_train.trainer import claimed_marker, restart_resumes

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("the old run's\n")
    os.utime(out / "config.yaml", ns=(1, 1))  # older than the launch: the checks were never passed
    launched = tmp_path / "launched.yaml"
    launched.write_text("this run's\n")
    job = load_job(flags={"output_dir": (str(out), "--output-dir"), "overwrite": (True, "--overwrite")})
    assert not restart_resumes(job, str(launched))
    claimed_marker(str(launched)).touch()
    assert restart_resumes(job, str(launched))


def test_a_bad_fault_signal_is_refused_naming_the_variable(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """Before any worker starts, as a bad ACC_TRAIN_FAULT is."""
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, tmp_path / "run", "--max-steps", "1"), env={"ACC_TRAIN_FAULT": "train-step", "ACC_TRAIN_FAULT_SIGNAL": "SIGSTP"})
    assert proc.returncode == 2 and "ACC_TRAIN_FAULT_SIGNAL='SIGSTP' is not a signal name" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.launch
@pytest.mark.xdist_group("reference-runs")
def test_a_restart_after_a_checkpoint_continues_from_it_with_the_losses_of_an_uninterrupted_run(
    ddp_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    """No ``--resume``: rank 1 is SIGKILLed at step 15, the agent restarts both workers, and
    they continue from step 10's checkpoint in the output directory their first attempt wrote."""
    out = tmp_path / "run"
    proc = run_cli(*reference_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", "--max-restarts", "1"), env={"ACC_TRAIN_FAULT": "train-step@15:1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["restarts"] == 1 and summary["start_step"] == 10 and summary["steps"] == 20
    assert summary["resumed_from"] == str(out / "checkpoints" / "step-000010")
    assert f"elastic: up to 1 restart(s) (one machine); restarted workers resume from the latest checkpoint in {out} (checkpoints every 10 steps)" in proc.stderr
    assert f"workers restarted (1 restart so far): resuming from {out / 'checkpoints' / 'step-000010'}" in proc.stderr
    assert "elastic: the workers were restarted 1 time(s)" in proc.stdout
    assert_same_losses(read_metrics(out), read_metrics(ddp_run))


@pytest.mark.launch
def test_a_restart_before_the_first_checkpoint_starts_the_run_again(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """Killed at step 2, before any checkpoint: the restarted worker starts at step 0 in the
    directory its first attempt claimed (its config.yaml and metrics.jsonl), without refusing it."""
    out = tmp_path / "run"
    args = tiny_job_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", "--num-processes", "1", "--max-steps", "4", "--max-restarts", "1")
    proc = run_cli(*args, env={"ACC_TRAIN_FAULT": "train-step@2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["restarts"] == 1 and summary["start_step"] == 0 and summary["steps"] == 4 and summary["resumed_from"] is None
    assert f"no complete checkpoint in {str(out)!r} yet: starting from step 0" in proc.stderr
    assert "already holds a run" not in proc.stderr
    assert sorted(read_metrics(out)) == [1, 2, 3, 4]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _machine(args: list[str], rank: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``acc-train ARGS`` as machine ``rank``."""
    return subprocess.Popen(
        [sys.executable, "-m", "acc_train_cli", *args, "--machine-rank", str(rank)],
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill_machine(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a "machine": its acc-train and every process under it (the elastic agent starts
    each worker in a session of its own, so the process group alone would leave them)."""
    import psutil

    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def _wait_for_checkpoint(latest: Path, step: int, procs: list[subprocess.Popen[str]]) -> None:
    """Until ``latest`` names step ``step``'s checkpoint (each machine still running)."""
    name = f"step-{step:06d}"
    while not (latest.is_file() and latest.read_text().strip() == name):
        for p in procs:
            if p.poll() is not None:
                _, err = p.communicate()
                pytest.fail(f"a machine ended before the checkpoint (exit code {p.returncode}):\n{err[-4000:]}")
        time.sleep(0.05)


@pytest.mark.launch
@pytest.mark.xdist_group("reference-runs")
def test_a_machine_that_leaves_and_comes_back_resumes_the_run_from_the_latest_checkpoint(
    ddp_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    """Two machines of one process each on 127.0.0.1 under ``--rdzv-backend c10d
    --max-restarts 1``, sharing the output directory. Machine 1's worker hangs at step 15
    (SIGSTOP, so the run cannot get past it), then machine 1 is killed whole, agent and worker;
    machine 0's agent restarts its worker and waits in the rendezvous; machine 1 is started
    again with the same command, and the run continues from step 10's checkpoint to the end
    with a 2-process run's losses."""
    out = tmp_path / "run"
    args = reference_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", "--num-processes", "1", "--num-machines", "2")
    args += ["--main-process-ip", "127.0.0.1", "--main-process-port", str(_free_port()), "--rdzv-backend", "c10d", "--max-restarts", "1"]
    run_id = {"ACC_TRAIN_RUN_ID": f"elastic-{os.getpid()}"}
    first = _machine(args, 0, run_id)
    leaving = _machine(args, 1, {**run_id, "ACC_TRAIN_FAULT": "train-step@15", "ACC_TRAIN_FAULT_SIGNAL": "SIGSTOP"})
    back = None
    try:
        _wait_for_checkpoint(out / "checkpoints" / "latest", 10, [first, leaving])
        _kill_machine(leaving)  # the node is gone
        leaving.communicate(timeout=60)
        back = _machine(args, 1, run_id)  # the node comes back: the same command
        logs = [p.communicate(timeout=600) for p in (first, back)]
    finally:
        for p in (first, leaving, back):
            if p is not None and p.poll() is None:
                _kill_machine(p)
    for rank, (p, (_, err)) in enumerate(zip((first, back), logs)):
        assert p.returncode == 0, f"machine {rank}:\n{err[-4000:]}"
    summary = json.loads((out / "run.json").read_text())
    assert summary["world_size"] == 2 and summary["restarts"] == 1
    assert summary["start_step"] == 10 and summary["steps"] == 20
    assert summary["resumed_from"] == str(out / "checkpoints" / "step-000010")
    assert "elastic: up to 1 restart(s) (c10d rendezvous of 2 machines)" in logs[1][1]
    assert any("workers restarted (1 restart so far): resuming from" in err for _, err in logs)  # rank 0's machine says it
    assert "elastic: the workers were restarted 1 time(s)" in logs[0][0]
    assert_same_losses(read_metrics(out), read_metrics(ddp_run))


@pytest.mark.parametrize(
    ("votes", "agreed"),
    [
        # a machine that rejoined runs a fresh agent (restart count 0, nothing claimed) and holds rank 0: the others' 'auto' wins
        ([(None, 0, False), ("auto", 1, True)], ("auto", 1, True)),
        ([("auto", 0, True), (None, 2, True), (None, 0, False)], ("auto", 2, True)),
        # a user's --resume is the same on every rank; a first attempt anywhere changes nothing
        ([("runs/x/checkpoints/step-000010", 0, False)] * 2, ("runs/x/checkpoints/step-000010", 0, False)),
        ([(None, 0, False)] * 3, (None, 0, False)),
    ],
)
def test_every_rank_takes_the_same_resume_decision(monkeypatch: pytest.MonkeyPatch, votes: list, agreed: tuple) -> None:
    """``_agree_on_resume``: every rank gathers every rank's (resume, restarts, again) and takes
    the same answer, so no rank enters the collectives of a resume the others skip."""
    import torch.distributed as dist

    from acc_train import trainer

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: len(votes))

    def all_gather_object(out: list, mine: object) -> None:
        out[:] = votes

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    for mine in votes:  # whichever rank this is, the same answer
        assert trainer._agree_on_resume(*mine) == agreed
