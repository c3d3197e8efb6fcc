"""``acc-train checkpoint inspect | convert | export``, and what a damaged, planted, foreign or
non-checkpoint directory gets: exit 2, one message, nothing loaded, nothing written. The commands
run in this process (:func:`tests.conftest.cli_in_process`) on the shared reference DDP run."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from tests.conftest import cli_in_process, reference_args

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("reference-runs")]


@pytest.fixture
def checkpoint_copy(ddp_run: Path, tmp_path: Path) -> Path:
    path = tmp_path / "step-000010"
    shutil.copytree(ddp_run / "checkpoints" / "step-000010", path)
    return path


def _a_state_file(checkpoint: Path) -> Path:
    return sorted((checkpoint / "state").glob("*.safetensors"))[0]


def test_inspect_shows_the_manifest_and_checks_the_files(ddp_run: Path) -> None:
    proc = cli_in_process("checkpoint", "inspect", str(ddp_run))  # an output directory: its latest checkpoint
    assert proc.returncode == 0, proc.stderr
    assert "step-000020" in proc.stdout and "all match the manifest" in proc.stdout and "format      dcp" in proc.stdout
    info = json.loads(cli_in_process("checkpoint", "inspect", str(ddp_run / "checkpoints" / "step-000010"), "--json").stdout)
    assert info["step"] == 10 and info["world_size"] == 2 and info["strategy"] == "ddp" and info["verified"] is True
    assert info["data"]["global_batch"] == 8 and info["model"]["model_type"] == "llama" and info["model_class"] == "LlamaForCausalLM"


@pytest.mark.parametrize("damage", ["truncated", "edited", "planted-pickle"])
def test_a_damaged_checkpoint_is_refused_before_anything_is_read(
    damage: str, checkpoint_copy: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    marker = tmp_path / "unpickled"
    if damage == "truncated":
        f = _a_state_file(checkpoint_copy)
        f.write_bytes(f.read_bytes()[:-100])
        expected = "bytes, the manifest says"
    elif damage == "edited":
        f = checkpoint_copy / "trainer_state.json"
        text = f.read_text()
        f.write_text(text.replace('"step": 10', '"step": 19'))
        expected = "content differs from the manifest"
    else:

        class Plant:
            def __reduce__(self):
                return (Path.touch, (marker,))

        (checkpoint_copy / "state" / "extra.pkl").write_bytes(pickle.dumps(Plant()))
        expected = "state/extra.pkl: not in the manifest"
    proc = cli_in_process("checkpoint", "inspect", str(checkpoint_copy))
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    out = tmp_path / "resumed"
    proc = cli_in_process(*reference_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", "--resume", str(checkpoint_copy)))
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists(), "a refused resume writes nothing"
    assert not marker.exists(), "a planted pickle is never executed"


def test_a_checkpoint_of_another_model_is_refused(ddp_run: Path, tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (other / "config.json").write_text(json.dumps(config))
    out = tmp_path / "resumed"
    proc = cli_in_process(*reference_args(other, tiny_data, out, "--strategy", "ddp", "--resume", str(ddp_run / "checkpoints" / "step-000010")))
    assert proc.returncode == 2, proc.stderr
    assert "the checkpoint holds a different model" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    for cmd in (["checkpoint", "inspect", str(tmp_path)], ["checkpoint", "export", str(tmp_path), "--to", "hf", str(tmp_path / "out")]):
        proc = cli_in_process(*cmd)
        assert proc.returncode == 2 and "is not a complete checkpoint" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_export_writes_a_model_transformers_loads_with_the_trained_weights(ddp_run: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    proc = cli_in_process("checkpoint", "export", str(ddp_run / "checkpoints" / "step-000020"), "--to", "hf", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    from huggingface_hub import ModelCard

    card = ModelCard.load(out / "README.md")  # the card of the checkpoint: its step, strategy and world size, the run's config
    assert card.data.library_name == "transformers" and "ddp" in card.data.tags
    assert "step 20" in card.text and "ddp, world size 2" in card.text and "```yaml\n" in card.text
    ids = torch.tensor([[2, 3, 4, 5, 6, 7]])
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    final = AutoModelForCausalLM.from_pretrained(ddp_run / "final").eval()  # written after step 20
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, final(ids).logits)
    again = cli_in_process("checkpoint", "export", str(ddp_run), "--to", "hf", str(out))
    assert again.returncode == 2 and "already exists" in again.stderr  # never overwritten
    merge = cli_in_process("checkpoint", "export", str(ddp_run), "--to", "hf", "--merge", str(tmp_path / "merged"))
    assert merge.returncode == 2 and "--merge" in merge.stderr and "holds the full model" in merge.stderr  # nothing to merge
    assert not (tmp_path / "merged").exists()


def test_convert_writes_a_verified_checkpoint_in_the_target_format(ddp_run: Path, tmp_path: Path) -> None:
    import torch

    from acc_train.checkpoint import read_portable_full, verify_checkpoint

    source = ddp_run / "checkpoints" / "step-000010"
    out = tmp_path / "as-deepspeed"
    proc = cli_in_process("checkpoint", "convert", str(source), "--to", "deepspeed", "--world-size", "4", str(out))
    assert proc.returncode == 0, proc.stderr
    manifest = verify_checkpoint(out)
    assert manifest["format"] == "deepspeed" and manifest["world_size"] == 4 and manifest["converted_from"]["format"] == "dcp"
    assert manifest["step"] == 10 and "trainer_state.json" in manifest["files"]
    mine, theirs = read_portable_full(out), read_portable_full(source)
    assert mine.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0)
    for bad, message in ((["--to", "nonsense"], "cannot convert to 'nonsense'"), (["--to", "dcp", "--world-size", "0"], "at least 1")):
        proc = cli_in_process("checkpoint", "convert", str(source), *bad, str(tmp_path / "x"))
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert cli_in_process("checkpoint", "convert", str(source), "--to", "dcp", str(out)).returncode == 2  # OUT exists
