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
    assert failure.message["message"] == "RuntimeError: rank 1 went away"  # what acc_train.launch.launcher shows


def test_a_finished_rank_flushes_its_files_without_torchs_deprecation_warning(tmp_path: Path) -> None:
    """Issue 41: every run ended with ``FutureWarning: torch.distributed.reduce_op is deprecated``,
    raised by the exit's walk over open files asking torch's deprecated object its class."""
    import warnings

    import torch.distributed  # noqa: F401 - its reduce_op object among gc's objects

    from acc_train.worker import flush_open_files

    f = (tmp_path / "open.txt").open("w")
    f.write("kept")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flush_open_files()
    assert (tmp_path / "open.txt").read_text() == "kept", "an open file is flushed at exit"
    f.close()
