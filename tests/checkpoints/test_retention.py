"""Which directories count as a run's checkpoints, and in what order: by step number, never by
name, so retention never deletes the checkpoint it has just saved."""

from __future__ import annotations

import json
from pathlib import Path

from acc_train.checkpoint.layout import complete_steps, latest_checkpoint
from acc_train.checkpoint.manager import CheckpointManager


def _checkpoint(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"files": {}}))
    return path


def test_steps_sort_by_number_past_a_million_and_a_users_copies_are_not_checkpoints(tmp_path: Path) -> None:
    for name in ("step-998000", "step-999000", "step-1000000", "step-000010.bak", "step-²"):
        _checkpoint(tmp_path, name)
    (tmp_path / "step-000005").mkdir()  # no manifest: a save that did not finish
    assert [s for s, _ in complete_steps(tmp_path)] == [998000, 999000, 1000000]


def test_retention_keeps_the_newest_checkpoints_past_a_million_steps(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for name in ("step-998000", "step-999000", "step-1000000", "step-000010.bak"):
        _checkpoint(root, name)
    manager = CheckpointManager.__new__(CheckpointManager)  # retention needs only its root and keep_last
    manager.root, manager.keep_last = root, 2
    manager._retain(1_000_000)
    assert sorted(p.name for p in root.iterdir()) == ["step-000010.bak", "step-1000000", "step-999000"]


def test_a_manifest_nested_too_deeply_is_refused_by_name_not_a_recursion_traceback(tmp_path: Path) -> None:
    import pytest

    from acc_train.errors import UserError

    newest = _checkpoint(tmp_path, "step-000004")
    (newest / "manifest.json").write_text("[" * 100_000)
    with pytest.raises(UserError, match="nested too deeply"):
        latest_checkpoint(tmp_path)  # no `latest` pointer: the newest complete checkpoint is looked at
