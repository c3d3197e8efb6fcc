"""A resume knows its data by content: the same tokens resume wherever the files now are (copied
elsewhere, a new modification time), other tokens are refused (exit 2) even at the same size and
path, and a checkpoint written before digests resumes with one warning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_cli, stopped_copy, tiny_job_args

pytestmark = pytest.mark.launch


def _args(model: Path, train: Path, eval_file: Path, out: Path, *extra: str) -> list[str]:
    data = {"train": train, "eval": eval_file}
    return tiny_job_args(model, data, out, "--num-processes", "1", "--max-steps", "6", "--set", "checkpoint.every=3", *extra)


def test_resume_checks_the_data_by_content(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    train = tmp_path / "a" / "train.jsonl"
    train.parent.mkdir()
    shutil.copy(tiny_data["train"], train)
    run = tmp_path / "run"
    proc = run_cli(*_args(tiny_model_dir, train, tiny_data["eval"], run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((run / "checkpoints" / "step-000003" / "manifest.json").read_text())
    assert len(manifest["data"]["train_digest"]) == 32 and "train_files" not in manifest["data"]

    # the same data, copied elsewhere (another path, another mtime): resumes, with the same losses
    moved = tmp_path / "b" / "train.jsonl"
    moved.parent.mkdir()
    shutil.copy(train, moved)
    resumed = stopped_copy(run, tmp_path / "resumed", saved=3, lost=6)
    proc = run_cli(*_args(tiny_model_dir, moved, tiny_data["eval"], resumed, "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {s: r["loss"] for s, r in read_metrics(resumed).items()} == pytest.approx({s: r["loss"] for s, r in read_metrics(run).items()}, abs=1e-6)

    # other tokens at the same size and path: refused, nothing written
    text = train.read_text()
    swapped = text.replace("quick", "QUICK", 1)
    assert len(swapped) == len(text) and swapped != text
    train.write_text(swapped)
    refused = stopped_copy(run, tmp_path / "refused", saved=3, lost=6)
    before = sorted(p.name for p in refused.rglob("*"))
    proc = run_cli(*_args(tiny_model_dir, train, tiny_data["eval"], refused, "--resume", "latest"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train_digest: the training data holds other tokens than the checkpoint's run trained on" in proc.stderr
    assert "Traceback" not in proc.stderr and sorted(p.name for p in refused.rglob("*")) == before
    train.write_text(text)

    # a checkpoint from before digests: resumes, saying what it cannot check
    old = stopped_copy(run, tmp_path / "old", saved=3, lost=6)
    path = old / "checkpoints" / "step-000003" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["data"]["train_digest"]
    manifest["data"]["train_files"] = [str(train)]
    path.write_text(json.dumps(manifest))
    proc = run_cli(*_args(tiny_model_dir, train, tiny_data["eval"], old, "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("was written before acc-train recorded a digest of the training data") == 1
