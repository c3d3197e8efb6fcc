"""Files of a run are replaced, never rewritten in place: resuming a hard-linked copy of a run
(``cp -al``, a cheap snapshot) leaves the original's files as they were."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_cli, tiny_job_args

pytestmark = pytest.mark.launch


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_resuming_a_hard_linked_copy_leaves_the_original_unchanged(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    original = tmp_path / "original"
    args = ("--num-processes", "1", "--set", "checkpoint.every=5")
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, original, *args, "--max-steps", "10"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = _hashes(original)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True)
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, copy, *args, "--max-steps", "14", "--resume", "auto"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(read_metrics(copy)) == list(range(1, 15))
    assert _hashes(original) == before
