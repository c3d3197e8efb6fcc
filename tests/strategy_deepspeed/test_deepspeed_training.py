"""Real DeepSpeed ZeRO on 2 CPU processes over gloo, through the real command: stages 1-3 match
DDP, ZeRO-3 shards parameters, resumes exactly, and exports the trained model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SAMPLE_ARGS, assert_model_card, read_metrics, reference_args, resume_from_step_10, run_cli, same_samples

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("reference-runs")]


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> Path:
    out = tmp_path_factory.mktemp("zero3") / "run"
    proc = run_cli(*reference_args(tiny_model_dir, tiny_data, out, "--strategy", "zero3", *SAMPLE_ARGS))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_zero3_is_real_deepspeed_and_shards_parameters(zero3_run: Path) -> None:
    summary = json.loads((zero3_run / "run.json").read_text())
    assert summary["distributed_type"] == "DistributedType.DEEPSPEED"
    assert summary["zero_stage"] == 3 and summary["world_size"] == 2
    for rank in summary["per_rank"]:
        assert rank["param_elements"] == pytest.approx(summary["model_parameters"] / 2, rel=0.1), rank


def test_zero3_losses_match_ddp(zero3_run: Path, ddp_run: Path) -> None:
    zero, ddp = read_metrics(zero3_run), read_metrics(ddp_run)
    assert ddp[20]["epoch"] > ddp[10]["epoch"] >= 1, "the comparison must cross epoch boundaries"
    for step in range(1, 21):
        assert zero[step]["loss"] == pytest.approx(ddp[step]["loss"], abs=1e-4), step


def test_zero3_greedy_samples_are_ddps(zero3_run: Path, ddp_run: Path) -> None:
    """Every rank generates in lockstep on its partitions of the weights (gathered layer by layer):
    in fp32 the greedy completions at steps 10 and 20 are the ones DDP's full replicas make."""
    assert len(same_samples(ddp_run)) == 4 and same_samples(zero3_run) == same_samples(ddp_run)


def test_zero3_rank_holds_a_1_over_n_share_of_model_state(zero3_run: Path) -> None:
    """Counted from DeepSpeed's buffers: 4 psi/N of parameters and of gradients, 12 psi/N of
    fp32 master partition and Adam moments."""
    summary = json.loads((zero3_run / "run.json").read_text())
    psi, n = summary["model_parameters"], summary["world_size"]
    for rank in summary["per_rank"]:
        held = rank["model_state_bytes"]
        assert held["params"] == pytest.approx(4 * psi / n, rel=0.05), rank
        assert held["grads"] == pytest.approx(4 * psi / n, rel=0.05), rank
        assert held["optimizer"] == pytest.approx(12 * psi / n, rel=0.05), rank


def _auto_ds_json(path: Path, stage: int) -> Path:
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "train_batch_size": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage, "contiguous_gradients": True},
    }))  # fmt: skip
    return path


@pytest.mark.parametrize("how", ["zero1", "ds-json-stage2"])
def test_stages_1_and_2_train_like_ddp(how: str, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path], ddp_run: Path) -> None:
    """Stage 1 from its preset; stage 2 from a DeepSpeed JSON whose "auto" values the job fills."""
    out = tmp_path / how
    if how == "zero1":
        strategy, stage = ["--strategy", "zero1"], 1
    else:
        strategy, stage = ["--strategy", "deepspeed", "--set", f"strategy.config_file={_auto_ds_json(tmp_path / 'ds.json', 2)}"], 2
    proc = run_cli(*reference_args(tiny_model_dir, tiny_data, out, *strategy, "--set", "checkpoint.every=0"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["distributed_type"] == "DistributedType.DEEPSPEED" and summary["zero_stage"] == stage
    got, ddp = read_metrics(out), read_metrics(ddp_run)
    for step in range(1, 21):  # past the epoch boundaries (about 7 steps an epoch)
        assert got[step]["loss"] == pytest.approx(ddp[step]["loss"], abs=1e-4), step


def test_zero3_stop_and_resume_gives_the_same_losses(zero3_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    resumed = resume_from_step_10(zero3_run, tmp_path, tiny_model_dir, tiny_data, "--strategy", "zero3", *SAMPLE_ARGS)
    full, again = read_metrics(zero3_run), read_metrics(resumed)
    for step in range(11, 21):
        assert again[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-6), step
    assert same_samples(resumed) == same_samples(zero3_run), "step 10's samples kept, step 20's made again the same"
    manifest = json.loads((zero3_run / "checkpoints" / "step-000010" / "manifest.json").read_text())
    assert manifest["format"] == "deepspeed"


def test_exported_zero3_model_gives_the_logits_of_the_ddp_trained_one(zero3_run: Path, ddp_run: Path) -> None:
    """The gathered ZeRO-3 export is the trained model: the weights of its last checkpoint, and
    DDP's to fp32 noise."""
    import torch
    from transformers import AutoModelForCausalLM

    from acc_train.checkpoint_tools import read_full_state

    ids = torch.tensor([[2, 3, 4, 5, 6, 7]])
    zero = AutoModelForCausalLM.from_pretrained(zero3_run / "final").eval()
    assert_model_card(zero3_run, "zero3")
    ddp = AutoModelForCausalLM.from_pretrained(ddp_run / "final").eval()
    with torch.no_grad():
        torch.testing.assert_close(zero(ids).logits, ddp(ids).logits, atol=1e-4, rtol=1e-4)
    last = zero3_run / "checkpoints" / "step-000020"
    ckpt = read_full_state(last, json.loads((last / "manifest.json").read_text()))
    for name, tensor in zero.state_dict().items():
        assert torch.equal(tensor, ckpt[f"model.{name}"]), name


@pytest.mark.gpu
def test_on_gpus_accelerates_own_deepspeed_path_runs(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    import torch

    from tests.conftest import tiny_job_args

    out = tmp_path / "gpu"
    n = str(torch.cuda.device_count())
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, out, "--strategy", "zero3", "--num-processes", n, "--max-steps", "3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["distributed_type"] == "DistributedType.DEEPSPEED" and summary["device"] == "cuda"


def test_zero3_gradient_checkpointing_gives_the_losses_of_the_run_without_it(
    zero3_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    """Non-reentrant recompute with ZeRO-3's partitioned parameters (gathered again for the
    recompute): fp32, the same losses as the same ZeRO-3 run without it."""
    from tests.conftest import assert_same_losses, checkpointed_run

    got = checkpointed_run(tmp_path, tiny_model_dir, tiny_data, "--strategy", "zero3")
    assert got["run"]["zero_stage"] == 3
    assert got["run"]["activation_checkpointing"] == {"transformers_layers": 1, "checkpoint_wrappers": 0}
    assert_same_losses(got["losses"], read_metrics(zero3_run))


@pytest.mark.parametrize("preset", ["zero1", "zero2"])
def test_zero1_and_zero2_gradient_checkpointing_train_like_ddp(
    preset: str, ddp_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    from tests.conftest import assert_same_losses, checkpointed_run

    got = checkpointed_run(tmp_path, tiny_model_dir, tiny_data, "--strategy", preset)
    assert got["run"]["zero_stage"] == int(preset[-1])
    assert got["run"]["activation_checkpointing"]["transformers_layers"] == 1
    assert_same_losses(got["losses"], read_metrics(ddp_run), abs=1e-4)  # as the unchecked stages match DDP
