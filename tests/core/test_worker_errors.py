"""A failing worker's error file: written whole or not at all, in the format the elastic agent reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_error_file_is_written_whole_and_read_back_by_the_agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from acc_train.worker import _atomic_error_handler

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise RuntimeError("rank 1 went away")
    except RuntimeError as exc:
        _atomic_error_handler().record_exception(exc)
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"], "a temporary file was left beside the error file"
    data = json.loads(error_file.read_text())
    assert data["message"]["message"] == "RuntimeError: rank 1 went away"
    assert "rank 1 went away" in data["message"]["extraInfo"]["py_callstack"]
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))  # as the agent reads it
    assert failure.message["message"] == "RuntimeError: rank 1 went away"  # what acc_train.launcher shows
