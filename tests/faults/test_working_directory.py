"""Field faults around where a run starts: the working directory's own modules never replace the
libraries a worker imports, and a symbolic link to nowhere as ``--output-dir`` is refused before
launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_in_process, tiny_job_args


@pytest.mark.launch
def test_modules_in_the_working_directory_do_not_shadow_the_workers_libraries(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """``python -m`` puts the working directory first on ``sys.path``; a user's ``queue.py``,
    ``datasets.py`` or ``concurrent.py`` there broke every worker."""
    work = tmp_path / "project"
    work.mkdir()
    for name in ("queue", "datasets", "concurrent"):
        (work / f"{name}.py").write_text(f"raise ImportError('the working directory shadowed {name}')\n")
    out = tmp_path / "run"
    acc_train = str(Path(sys.executable).parent / "acc-train")  # as users start it (the console script)
    proc = subprocess.run(
        [acc_train, *tiny_job_args(tiny_model_dir, tiny_data, out, "--num-processes", "2", "--max-steps", "2")],
        capture_output=True, text=True, cwd=work, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shadowed" not in proc.stderr
    assert (out / "run.json").is_file()


def test_a_dangling_symlink_as_output_dir_is_refused_before_launch(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    link = tmp_path / "runs"
    os.symlink(tmp_path / "gone" / "runs", link)
    proc = cli_in_process(*tiny_job_args(tiny_model_dir, tiny_data, link, "--max-steps", "2"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "is a symbolic link to" in proc.stderr and "which does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert link.is_symlink() and not (tmp_path / "gone").exists()  # nothing created through the link


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (("model.config.hidden_size=7", "model.config.num_attention_heads=3"), "The hidden size (7) is not a multiple of the number of attention heads (3)"),
        (("model.config.vocab_size=abc",), "Field 'vocab_size' expected int, got str"),
    ],
)
@pytest.mark.parametrize("command", [("plan",), ("--max-steps", "1")], ids=["plan", "train"])
def test_a_model_config_transformers_rejects_is_refused_by_plan_and_training(sets: tuple[str, ...], says: str, command: tuple[str, ...], tmp_path: Path) -> None:
    args = [a for s in sets for a in ("--set", s)]
    proc = cli_in_process(*args, *command, "--output-dir", str(tmp_path / "run")) if command[0] != "plan" else cli_in_process("plan", *args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: model.config: invalid demo model config" in proc.stderr and says in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
