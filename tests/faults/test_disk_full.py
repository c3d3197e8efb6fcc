"""Disk full at any write: one message naming the path and the free space, the partial write
removed, the previous checkpoint intact and resumable. Real full disks: a small tmpfs, which
needs root (mount); skipped with the reason elsewhere."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from acc_train.files.disk_full import DiskFullError, disk_full, disk_full_error
from acc_train.outputs.run_lock import LOCK_NAME, run_lock

from tests.conftest import assert_same_losses, read_metrics, reference_args, run_cli

PAGE = 4096


def _mount_tmpfs(where: Path, size: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a full disk is made as a small tmpfs, which needs root to mount")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (a full disk is made as one): {proc.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted after the test."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, 4 << 20)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, leave: int = 0) -> Path:
    """A ballast file taking all but ``leave`` bytes (whole pages) of the disk's free space."""
    ballast = disk / "ballast"
    free = shutil.disk_usage(disk).free
    with ballast.open("wb") as f:
        f.write(b"\0" * max(0, free - leave))
    return ballast


def pages(path: Path) -> int:
    """Bytes a tmpfs spends on the files under ``path`` (whole pages)."""
    return sum(-(-f.stat().st_size // PAGE) * PAGE for f in path.rglob("*") if f.is_file())


def test_the_three_shapes_of_a_full_disk_are_recognised(small_disk: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    big = {"w": torch.zeros(2 << 20)}  # 8 MiB: more than the disk holds
    recognised, failed_open = {}, None
    for name, write in (
        ("torch.save", lambda: torch.save(big, small_disk / "x.pt")),  # loses the errno: "unexpected pos ..."
        ("safetensors", lambda: save_file(big, str(small_disk / "x.safetensors"))),  # quotes "No space left on device"
        ("dcp", lambda: dcp.save({"m": big}, checkpoint_id=str(small_disk / "dcp"))),  # CheckpointException holding torch.save's
        ("open", lambda: (small_disk / "x.bin").write_bytes(b"\0" * (8 << 20))),  # OSError(ENOSPC)
    ):
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            recognised[name] = disk_full(exc, small_disk)
            if name == "open":
                failed_open = exc.with_traceback(None)
        gc.collect()  # the failed writers' files, held open by their tracebacks, are closed and their pages freed
        for f in small_disk.iterdir():  # each write meets an empty disk
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    assert recognised == {"torch.save": True, "safetensors": True, "dcp": True, "open": True}
    assert shutil.disk_usage(small_disk).free == 4 << 20
    assert not disk_full(RuntimeError("unexpected pos 576 vs 534"), small_disk)  # the same error with room left is something else
    assert not disk_full(ValueError("bad value"), small_disk)
    assert failed_open is not None
    error = disk_full_error(failed_open, small_disk / "x.bin", what="while writing")
    assert isinstance(error, DiskFullError)
    assert str(error).startswith(f"disk full while writing {small_disk / 'x.bin'} (") and "free of 4.0 MiB on that filesystem" in str(error)


def test_the_run_lock_on_a_full_disk_removes_what_a_killed_save_left(small_disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = small_disk / "run"
    left = out / "checkpoints" / ".staging-step-000020"
    left.mkdir(parents=True)
    (out / "checkpoints" / "step-000010").mkdir()
    (out / "checkpoints" / "step-000010" / "model.safetensors").write_bytes(b"1" * 10_000)
    (out / "final").mkdir()
    (out / "final" / "model.safetensors").write_bytes(b"2" * 10_000)
    (left / "model.safetensors").write_bytes(b"\0" * (64 << 10))
    fill(small_disk)  # the killed save and the ballast take it all: the lock's own line cannot be written
    with run_lock(str(out)):
        assert (out / LOCK_NAME).read_text().startswith('{"pid"')
    assert not left.exists()
    said = capsys.readouterr().err
    assert f"the disk holding {str(out)!r} is full: removed 64.0 KiB of unfinished writes an earlier run left there" in said
    assert (out / "checkpoints" / "step-000010" / "model.safetensors").read_bytes() == b"1" * 10_000  # the run's own files: untouched
    assert (out / "final" / "model.safetensors").read_bytes() == b"2" * 10_000


def test_the_run_lock_on_a_disk_that_stays_full_says_what_takes_the_space(small_disk: Path) -> None:
    out = small_disk / "run"
    for step in (10, 20):
        (out / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
        (out / "checkpoints" / f"step-{step:06d}" / "model.safetensors").write_bytes(b"1" * 100_000)
        (out / "checkpoints" / f"step-{step:06d}" / "manifest.json").write_text("{}")  # committed (what counts here)
    (out / LOCK_NAME).touch()
    before = sorted((p.relative_to(out), p.stat().st_size) for p in out.rglob("*"))
    fill(small_disk)
    with pytest.raises(DiskFullError) as err:
        with run_lock(str(out)):
            pass
    message = str(err.value)
    assert message.startswith(f"disk full while taking the run lock {out / LOCK_NAME} (") and "free of 4.0 MiB" in message
    assert "1 checkpoint(s) before the latest (step-000020) take 97.7 KiB" in message and f"rm -r {out / 'checkpoints' / 'step-000010'}" in message
    (small_disk / "ballast").unlink()
    assert sorted((p.relative_to(out), p.stat().st_size) for p in out.rglob("*")) == before  # nothing changed


@pytest.mark.launch
@pytest.mark.xdist_group("reference-runs")
def test_a_save_on_a_full_disk_says_so_and_resumes_where_it_stopped(ddp_run: Path, tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, 8 << 20)
    try:
        checkpoint = pages(ddp_run / "checkpoints" / "step-000010")
        # room for the run's small files and step 10's checkpoint, and half of step 20's
        ballast = fill(disk, leave=checkpoint + checkpoint // 2 + 16 * PAGE)
        out = disk / "run"
        args = reference_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp")
        proc = run_cli(*args)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        error = next(line for line in proc.stderr.splitlines() if line.startswith("error: "))
        assert f"disk full while writing the checkpoint of step 20 into {out / 'checkpoints'}" in error, proc.stderr[-3000:]
        assert "free of 8.0 MiB on that filesystem" in error
        assert "the partial checkpoint was removed" in error and "the last complete checkpoint, step-000010, is intact" in error
        assert "--resume auto to continue from step-000010" in proc.stderr
        assert not list(out.rglob(".staging-*")) and not list(out.glob(".final-*"))
        assert not (out / "final").exists() and not (out / "run.json").exists()
        from acc_train.checkpoint.manifest import verify_checkpoint

        verify_checkpoint(out / "checkpoints" / "step-000010")  # whole: sizes and hashes against its manifest
        ballast.unlink()  # the user frees space
        resumed = run_cli(*args, "--resume", "auto")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert_same_losses(read_metrics(out), read_metrics(ddp_run))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
