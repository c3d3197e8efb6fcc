"""Output paths acc-train cannot or must not write: refused before anything starts, with the
path and the flag named, exit 2, no traceback, and nothing created anywhere.

Training's ``--output-dir`` and ``checkpoint convert``/``export``'s ``OUT`` are checked before
any work (no launch, no checkpoint read), so these tests are fast. Tests may run as root, for
whom a read-only directory is writable: those cases use ``/proc`` (no one creates entries
there) and skip the read-only-directory case only under root.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.test_cli import assert_user_error
from tests.conftest import cli_in_process

AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    if AS_ROOT:
        pytest.skip("root writes into read-only directories (the /proc cases cover an uncreatable path under root)")
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    yield ro
    ro.chmod(stat.S_IRWXU)


def _unwritable(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, str]:
    """An output path of ``kind`` and what the message says about it."""
    if kind == "under-a-file":
        (tmp_path / "a-file").write_text("mine")
        return tmp_path / "a-file" / "run", "is a file"
    if kind == "the-file-itself":
        (tmp_path / "a-file").write_text("mine")
        return tmp_path / "a-file", "is a file"
    if kind == "under-proc":
        return Path("/proc/acc-train-test/run"), "takes no new entries"
    return request.getfixturevalue("read_only_dir") / "run", "takes no new entries"


KINDS = ["under-a-file", "the-file-itself", "under-proc", "read-only"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_output_dir_that_cannot_be_created_is_refused(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    out, says = _unwritable(kind, tmp_path, request)
    before = listing(tmp_path)
    proc = cli_in_process("--output-dir", str(out), "--max-steps", "1")
    assert_user_error(proc, "--output-dir", str(out), says)
    assert listing(tmp_path) == before
    assert not out.exists() or out.is_file()


def test_an_empty_output_dir_is_refused(tmp_path: Path) -> None:
    proc = cli_in_process("--output-dir", "", "--max-steps", "1", cwd=tmp_path)
    assert_user_error(proc, "--output-dir", "is empty")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("resume", ["latest", "auto"])
def test_resume_and_overwrite_together_are_refused(resume: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    proc = cli_in_process("--output-dir", str(out), "--resume", resume, "--overwrite", "--max-steps", "1")
    assert_user_error(proc, "--overwrite", f"--resume {resume}", "drop")
    assert listing(tmp_path) == ["run", "run/metrics.jsonl"]


@pytest.mark.parametrize("command", ["convert", "export"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_out_that_cannot_be_created_is_refused_before_any_work(
    command: str, kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    out, says = _unwritable(kind, tmp_path, request)
    before = listing(tmp_path)
    # PATH need not exist: OUT is checked first, before the checkpoint is read
    proc = cli_in_process("checkpoint", command, str(tmp_path / "no-checkpoint"), "--to", "dcp" if command == "convert" else "hf", str(out))
    if kind == "the-file-itself":
        says = "already exists"
    assert_user_error(proc, "OUT", str(out), says)
    assert listing(tmp_path) == before


def test_a_failed_convert_leaves_no_staging_directory_or_parent_behind(tmp_path: Path) -> None:
    from acc_train.files.output_paths import new_directory

    out = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        with new_directory(str(out), "OUT") as staging:
            (staging / "half-written").write_text("x")
            raise RuntimeError("disk full")
    assert listing(tmp_path) == []
    with new_directory(str(out), "OUT") as staging:
        (staging / "done").write_text("x")
    assert listing(tmp_path) == ["new", "new/deeper", "new/deeper/out", "new/deeper/out/done"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_resume_auto_on_a_run_without_checkpoints_is_refused_not_started_over(tmp_path: Path) -> None:
    """A finished run whose checkpoints were deleted (to free disk): `--resume auto` would
    retrain from step 0, empty metrics.jsonl and replace final/ and run.json."""
    from tests.bad_input.harness import snapshot

    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"weights")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (out / "run.json").write_text("{}")
    before = snapshot(tmp_path)
    result = cli_in_process("--output-dir", str(out), "--resume", "auto", "--max-steps", "2")
    assert_user_error(result, "--resume")
    assert "no complete checkpoint" in result.stderr and "--overwrite" in result.stderr, result.stderr
    assert snapshot(tmp_path) == before
