"""Files of a run are replaced, never rewritten in place: resuming a hard-linked copy of a run
(``cp -al``, a cheap snapshot) leaves the original's files as they were."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ONE_PROCESS_RUN, read_metrics, run_cli, tiny_job_args

pytestmark = pytest.mark.launch


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.xdist_group("data-loss")
def test_resuming_a_hard_linked_copy_leaves_the_original_unchanged(
    one_process_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    original = tmp_path / "original"  # a copy of the shared finished run (4 steps), as the user's own
    shutil.copytree(one_process_run, original)
    before = _hashes(original)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True)
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, copy, *ONE_PROCESS_RUN, "--max-steps", "8", "--resume", "auto"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(read_metrics(copy)) == list(range(1, 9))
    assert _hashes(original) == before
