"""Nothing a user has is lost: a refused resume or overwrite leaves the run as it was, a
``latest`` pointer that is missing, unreadable or dangling falls back to the newest complete
checkpoint (and says so) instead of starting over, and ``checkpoint convert``/``export`` never
touch a directory they did not create. Every file is hashed before and after."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from acc_train.checkpoint import find_checkpoint, resolve_checkpoint
from acc_train.errors import UserError
from tests.bad_input.harness import snapshot
from tests.conftest import ONE_PROCESS_RUN as RUN
from tests.conftest import cli_in_process, run_cli, tiny_job_args


@pytest.fixture
def trained(one_process_run: Path) -> Path:
    """4 steps on one process, checkpoints at 2 and 4, both kept (shared: read, never changed)."""
    return one_process_run


@pytest.fixture
def run_copy(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _refused(proc: object, expected: str) -> None:
    assert proc.returncode == 2, proc.stderr[-4000:]  # type: ignore[attr-defined]
    assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]  # type: ignore[attr-defined]


@pytest.mark.launch
@pytest.mark.xdist_group("data-loss")
def test_a_resume_refused_inside_the_workers_changes_nothing(run_copy: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    before = snapshot(run_copy)
    # another --seed (the run's is 7): the data order would change
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, run_copy, *RUN, "--max-steps", "6", "--resume", "latest", "--seed", "8"))
    _refused(proc, "would not continue the checkpoint's data order")
    assert snapshot(run_copy) == before, "config.yaml, metrics.jsonl and the checkpoints are as the run left them"


@pytest.mark.launch
@pytest.mark.xdist_group("data-loss")
def test_an_overwrite_refused_inside_the_workers_keeps_the_old_run(
    run_copy: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    before = snapshot(run_copy)
    # the demo model with 8 token ids, on data tokenized by a larger vocabulary: the workers refuse it
    small = ("--set", "model.name_or_path=null", "--set", f"model.tokenizer={tiny_model_dir}", "--set", "model.config={vocab_size: 8, hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2}")
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, run_copy, *RUN, *small, "--overwrite"))
    _refused(proc, "the model's vocab_size is 8")
    assert snapshot(run_copy) == before, "the run --overwrite would replace is deleted only once the new one has passed its checks"


@pytest.mark.launch
@pytest.mark.xdist_group("data-loss")
def test_an_overwrite_replaces_the_old_run_once_its_checks_pass_and_a_restart_continues_the_new_one(
    run_copy: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    """Killed at step 3, the restarted workers resume the new run's step 2: the old run (seed 7,
    at step 4) is gone, or they would be refused its data order or find it finished."""
    args = tiny_job_args(tiny_model_dir, tiny_data, run_copy, *RUN, "--seed", "8", "--overwrite", "--max-restarts", "1")
    proc = run_cli(*args, env={"ACC_TRAIN_FAULT": "train-step@3:0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_copy / "run.json").read_text())
    assert summary["start_step"] == 2 and summary["steps"] == 4
    assert "seed: 8" in (run_copy / "config.yaml").read_text()
    manifest = json.loads((run_copy / "checkpoints" / "step-000004" / "manifest.json").read_text())
    assert manifest["data"]["seed"] == 8


@pytest.mark.launch
@pytest.mark.xdist_group("data-loss")
def test_resume_auto_with_a_dangling_latest_continues_from_the_newest_complete_checkpoint(
    run_copy: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    (run_copy / "checkpoints" / "latest").write_text("step-000099\n")  # a checkpoint that is gone
    before = snapshot(run_copy)
    metrics_before = (run_copy / "metrics.jsonl").read_text().splitlines()
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, run_copy, *RUN, "--max-steps", "6", "--resume", "auto"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "warning:" in proc.stderr and "step-000099" in proc.stderr and "step-000004" in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count("step-000099") == 1, "the warning is printed once, not once per rank"
    assert json.loads((run_copy / "run.json").read_text())["start_step"] == 4
    after = snapshot(run_copy)
    for name, digest in before.items():  # the complete checkpoints are kept, byte for byte
        if name.startswith(("checkpoints/step-000002", "checkpoints/step-000004")):
            assert after.get(name) == digest, name
    assert (run_copy / "checkpoints" / "latest").read_text().strip() == "step-000006"
    assert (run_copy / "metrics.jsonl").read_text().splitlines()[: len(metrics_before)] == metrics_before


@pytest.mark.launch
@pytest.mark.xdist_group("data-loss")
@pytest.mark.parametrize("command", ["convert", "export"])
def test_convert_and_export_never_touch_a_directory_they_did_not_create(trained: Path, tmp_path: Path, command: str) -> None:
    mine = tmp_path / ".out.tmp"  # the name today's staging directory had
    mine.mkdir()
    (mine / "precious.txt").write_text("the user's")
    before = snapshot(tmp_path)
    proc = cli_in_process("checkpoint", command, str(trained), "--to", "dcp" if command == "convert" else "hf", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("out")} == before, "only OUT is new"
    assert (tmp_path / "out" / ("manifest.json" if command == "convert" else "config.json")).is_file()


# --- the pointer itself (no launch) ----------------------------------------------------------


def _checkpoints(root: Path, *steps: int, manifest: str = '{"step": 0, "files": {}}') -> Path:
    ckpts = root / "checkpoints"
    for step in steps:
        (ckpts / f"step-{step:06d}").mkdir(parents=True)
        (ckpts / f"step-{step:06d}" / "manifest.json").write_text(manifest)
    return ckpts


@pytest.mark.parametrize(
    "pointer, problem",
    [
        (None, "missing"),
        (b"\xff\xfe\x00garbage\x80", "not UTF-8"),
        (b"step-000099\n", "step-000099"),  # dangling
        (b"../../elsewhere\n", "elsewhere"),  # not a checkpoint of this run
        (b"step-000003\n", "step-000003"),  # a directory without a manifest: incomplete
        (b"", "empty"),
    ],
)
@pytest.mark.parametrize("resume", ["latest", "auto"])
def test_a_bad_pointer_falls_back_to_the_newest_complete_checkpoint(tmp_path: Path, pointer: bytes | None, problem: str, resume: str) -> None:
    ckpts = _checkpoints(tmp_path, 2, 4)
    (ckpts / "step-000003").mkdir()
    (ckpts / "step-000010").mkdir()  # a save that did not finish: no manifest
    (ckpts / ".staging-step-000012").mkdir()
    if pointer is not None:
        (ckpts / "latest").write_bytes(pointer)
    notes: list[str] = []
    assert find_checkpoint(tmp_path, resume, warn=notes.append) == ckpts / "step-000004"
    assert len(notes) == 1 and problem in notes[0] and "step-000004" in notes[0], notes
    assert resolve_checkpoint(str(tmp_path), warn=notes.append) == ckpts / "step-000004"
    assert len(notes) == 2


@pytest.mark.parametrize("resume", ["latest", "auto"])
def test_a_newest_checkpoint_with_a_damaged_manifest_is_refused_not_passed_over(tmp_path: Path, resume: str) -> None:
    """Resuming from step 4 would delete step 10 as abandoned at the first save."""
    ckpts = _checkpoints(tmp_path, 2, 4, 10)
    (ckpts / "step-000010" / "manifest.json").write_bytes(b"\x00\xffnot json")
    (ckpts / "latest").write_text("step-000099\n")
    with pytest.raises(UserError, match="step-000099") as info:
        find_checkpoint(tmp_path, resume)
    assert "step-000010" in str(info.value) and info.value.where == "--resume"
    with pytest.raises(UserError, match="is not a valid manifest: not UTF-8") as info:
        resolve_checkpoint(str(tmp_path))
    assert info.value.where == "PATH"


def test_a_pointer_that_is_a_directory_or_no_complete_checkpoint_at_all(tmp_path: Path) -> None:
    ckpts = _checkpoints(tmp_path)
    ckpts.mkdir(parents=True)
    (ckpts / "latest").mkdir()
    (ckpts / "step-000002").mkdir()  # incomplete
    notes: list[str] = []
    assert find_checkpoint(tmp_path, "auto", warn=notes.append) is None
    assert len(notes) == 1 and "not a file" in notes[0] and "starting from step 0" in notes[0], notes
    with pytest.raises(UserError, match="no complete checkpoint") as info:
        find_checkpoint(tmp_path, "latest")
    assert "latest" in str(info.value)
    with pytest.raises(UserError, match="no complete checkpoint"):
        resolve_checkpoint(str(tmp_path))


def test_a_valid_pointer_is_followed_silently(tmp_path: Path) -> None:
    ckpts = _checkpoints(tmp_path, 2, 4)
    (ckpts / "latest").write_text("step-000002\n")
    notes: list[str] = []
    assert find_checkpoint(tmp_path, "latest", warn=notes.append) == ckpts / "step-000002"
    assert find_checkpoint(tmp_path, str(tmp_path), warn=notes.append) == ckpts / "step-000002"  # an output dir
    assert resolve_checkpoint(str(tmp_path), warn=notes.append) == ckpts / "step-000002"
    assert notes == []


def test_a_restart_resumes_unless_the_run_overwrite_replaces_is_still_there(tmp_path: Path) -> None:
    """``--overwrite --max-restarts N``: workers restarted after a failure before the checks had
    passed must not continue the old run; after it, they continue the new one."""
    import os

    from acc_train.config import load_job
    from acc_train.trainer import restart_resumes

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("the old run's\n")
    launched = tmp_path / "launched.yaml"
    launched.write_text("this run's\n")
    os.utime(out / "config.yaml", ns=(1, 1))

    def job(*flags: str) -> object:
        given = {"output_dir": (str(out), "--output-dir")}
        given.update({name: (True if name == "overwrite" else "latest", f"--{name}") for name in flags})
        return load_job(flags=given)

    assert restart_resumes(job(), str(launched))  # no run was replaced: continue this one
    assert not restart_resumes(job("resume"), str(launched))  # --resume already says where from
    assert not restart_resumes(job("overwrite"), str(launched))  # the old run is still there
    (out / "config.yaml").write_bytes(launched.read_bytes())  # the new run got past its checks
    assert restart_resumes(job("overwrite"), str(launched))
