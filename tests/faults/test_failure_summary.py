"""The failure summary shows the real error: not torch's placeholder for a rank that recorded
none, and not a lost peer's symptom where another rank died first."""

from __future__ import annotations

import json
from pathlib import Path

from acc_train.launch.launcher import _failure_report
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure


def _recorded(tmp_path: Path, rank: int, message: str, timestamp: int) -> ProcessFailure:
    path = tmp_path / f"error-{rank}.json"
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": f"Traceback ...\n{message}\n", "timestamp": str(timestamp)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1, error_file=str(path))


def _silent(rank: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="/nonexistent/error.json")


def test_a_rank_killed_without_a_record_is_the_cause_not_its_peers_symptom(tmp_path: Path) -> None:
    failures = {0: _recorded(tmp_path, 0, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:3773", 1), 1: _silent(1, -9)}
    report = _failure_report(ChildFailedError("worker", failures)).report
    assert report.splitlines()[0] == (
        "rank 1 failed first (exit code -9): killed by SIGKILL without recording an error "
        "(SIGKILL: often the kernel's out-of-memory killer; `dmesg` or the job's memory limit says)"
    )
    assert "ranks [0] stopped after it" in report and "To enable traceback" not in report


def test_a_rank_that_exited_without_a_record_says_so(tmp_path: Path) -> None:
    report = _failure_report(ChildFailedError("worker", {0: _silent(0, 3), 1: _silent(1, -15)})).report
    assert report.splitlines()[0] == "rank 0 failed first (exit code 3): exited with code 3 without recording an error; its own output above shows why"


def test_the_earliest_real_error_wins_over_a_later_one_and_the_agents_stops(tmp_path: Path) -> None:
    failures = {
        0: _recorded(tmp_path, 0, "OSError: [Errno 28] No space left on device", 5),
        1: _recorded(tmp_path, 1, "ValueError: later", 9),
        2: _silent(2, -15),  # stopped by the agent after the first failure
    }
    report = _failure_report(ChildFailedError("worker", failures)).report
    assert report.splitlines()[0] == "rank 0 failed first (exit code 1): OSError: [Errno 28] No space left on device"


def test_a_busy_main_process_port_is_exit_2_naming_it(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    import socket

    from tests.conftest import cli_in_process, tiny_job_args

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        machines = ["--num-machines", "2", "--machine-rank", "0", "--main-process-ip", "127.0.0.1", "--main-process-port", str(port)]
        proc = cli_in_process(*tiny_job_args(tiny_model_dir, tiny_data, tmp_path / "run", "--num-processes", "1", "--max-steps", "1", *machines))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: launch.main_process_port: port {port} on this machine is already in use" in proc.stderr
    assert "hint: set --main-process-port" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_ranks_that_all_lost_a_peer_are_one_lost_peer_message(tmp_path: Path) -> None:
    gloo = "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:3773"
    failures = {0: _recorded(tmp_path, 0, gloo, 1), 1: _recorded(tmp_path, 1, gloo.replace("3773", "3774"), 2)}
    assert not _failure_report(ChildFailedError("worker", failures)).lost_peer  # one machine: nothing else to have lost
    failed = _failure_report(ChildFailedError("worker", failures), machines=2)
    assert failed.lost_peer and failed.exit_code == 1
    assert failed.report == (
        "lost a peer: rank 0 lost its connection to another rank (Connection closed by peer [10.0.0.2]:3773); rank 1 stopped with it. "
        "A process on another machine died, or that machine was lost; its own log says which"
    )
    # a rank of this machine that died is the cause, not a lost peer
    failures[2] = _silent(2, -9)
    assert not _failure_report(ChildFailedError("worker", failures), machines=2).lost_peer
    timeout = {0: _recorded(tmp_path, 0, "RuntimeError: [ProcessGroupNCCL.cpp] Watchdog caught collective operation timeout: Timed out", 1)}
    assert not _failure_report(ChildFailedError("worker", timeout), machines=2).lost_peer  # a hang is not a lost machine
