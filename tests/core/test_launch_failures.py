"""How a failed launch is reported: a worker that recorded a UserError makes the command exit 2
with its message, even when the process then died in native teardown (a signal at exit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acc_train.errors import EXIT_USER_ERROR
from acc_train.launch.launcher import _failure_report


def _failure(tmp_path: Path, exitcode: int, message: str):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "0"}}}))
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=exitcode, error_file=str(error_file))
    return ChildFailedError("worker", {1: failure})


@pytest.mark.parametrize("exitcode", [EXIT_USER_ERROR, -7])
def test_a_recorded_user_error_is_exit_2_with_its_message(tmp_path: Path, exitcode: int) -> None:
    report = _failure_report(_failure(tmp_path, exitcode, "UserError: data.train_files: no such file"))
    assert report.exit_code == EXIT_USER_ERROR
    assert str(report) == "data.train_files: no such file"


def test_a_crash_is_reported_with_its_rank_and_trace(tmp_path: Path) -> None:
    report = _failure_report(_failure(tmp_path, -11, "RuntimeError: boom"))
    assert report.exit_code == 1
    assert "rank 1 failed first (exit code -11): RuntimeError: boom" in str(report) and "Traceback" in str(report)


# --- a launch setting the installed torch cannot honour --------------------------------------------


def test_shutdown_timeout_is_passed_where_torch_has_it_and_refused_where_it_is_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 (the GPU image's) has no LaunchConfig.shutdown_timeout and always waits 30 s:
    the default launches there; another value is exit 2 naming the key, not a TypeError."""
    from acc_train.launch import launcher
    from acc_train.config import LaunchConfig as LaunchSection
    from acc_train.errors import UserError

    section = LaunchSection(shutdown_timeout=45)
    if launcher._has_shutdown_timeout():  # this torch: the key reaches torch elastic
        assert launcher._launch_config(section, 2).shutdown_timeout == 45
    monkeypatch.setattr(launcher, "_has_shutdown_timeout", lambda: False)
    config = launcher._launch_config(LaunchSection(), 2)  # the default: torch's own fixed 30 s
    assert not hasattr(config, "shutdown_timeout") or config.shutdown_timeout == launcher.FIXED_SHUTDOWN_TIMEOUT
    with pytest.raises(UserError) as refused:
        launcher._launch_config(section, 2)
    assert "shutdown_timeout: 45" in str(refused.value) and "always waits 30 s" in str(refused.value)
    assert "launch.shutdown_timeout" in str(refused.value)  # the hint: what to remove


def test_the_command_refuses_it_before_anything_is_written(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "run"
    code = (
        "import acc_train.launch.launcher as launcher\n"
        "launcher._has_shutdown_timeout = lambda: False\n"
        "from acc_train_cli.main import cli\n"
        f"cli.main(['--output-dir', {str(out)!r}, '--max-steps', '1', '--set', 'launch.shutdown_timeout=45'], prog_name='acc-train')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_USER_ERROR, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "launch: shutdown_timeout: 45 cannot be set" in proc.stderr
    assert not out.exists()
