"""How a failed launch is reported: a worker that recorded a UserError makes the command exit 2
with its message, even when the process then died in native teardown (a signal at exit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acc_train.errors import EXIT_USER_ERROR
from acc_train.launcher import _failure_report


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
