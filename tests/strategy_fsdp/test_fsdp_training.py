"""Real FSDP on 2 CPU processes over gloo: sharding, DDP-equal losses, exact resume, and an
accelerate FSDP config file, through the real command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SAMPLE_ARGS, assert_model_card, read_metrics, reference_args, resume_from_step_10, run_cli, same_samples

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("reference-runs")]


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> Path:
    out = tmp_path_factory.mktemp("fsdp2") / "run"
    proc = run_cli(*reference_args(tiny_model_dir, tiny_data, out, "--strategy", "fsdp", *SAMPLE_ARGS))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def fsdp1_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> Path:
    """FSDP1 from a file written by `accelerate config`, full state dict checkpoints."""
    cfg = tmp_path_factory.mktemp("accel") / "fsdp1.yaml"
    cfg.write_text(
        "compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: FSDP\ndowncast_bf16: 'no'\n"
        "fsdp_config:\n"
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
        "  fsdp_backward_prefetch: BACKWARD_PRE\n"
        "  fsdp_cpu_ram_efficient_loading: false\n"
        "  fsdp_forward_prefetch: false\n"
        "  fsdp_offload_params: false\n"
        "  fsdp_sharding_strategy: FULL_SHARD\n"
        "  fsdp_state_dict_type: FULL_STATE_DICT\n"
        "  fsdp_sync_module_states: true\n"
        "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
        "  fsdp_use_orig_params: true\n"
        "  fsdp_version: 1\n"
        "machine_rank: 0\nmain_training_function: main\nmixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\n"
        "rdzv_backend: static\nsame_network: true\ntpu_env: []\ntpu_use_cluster: false\ntpu_use_sudo: false\nuse_cpu: false\n"
    )
    out = tmp_path_factory.mktemp("fsdp1") / "run"
    proc = run_cli(*reference_args(tiny_model_dir, tiny_data, out, "--config", str(cfg), *SAMPLE_ARGS))
    assert proc.returncode == 0, proc.stderr[-4000:]
    (out.parent / "stderr.txt").write_text(proc.stderr)  # what the user saw, for the warning test
    return out


@pytest.mark.parametrize("which", ["fsdp2_run", "fsdp1_run"])
def test_real_fsdp_shards_parameters_across_two_cpu_ranks(which: str, request: pytest.FixtureRequest) -> None:
    run = request.getfixturevalue(which)
    summary = json.loads((run / "run.json").read_text())
    assert summary["distributed_type"] == "DistributedType.FSDP"
    assert summary["world_size"] == 2
    assert summary["fsdp_version"] == (2 if which == "fsdp2_run" else 1)
    total = summary["model_parameters"]
    for rank in summary["per_rank"]:
        assert rank["param_elements"] == pytest.approx(total / 2, rel=0.1), rank


def test_warnings_print_once_per_machine_not_once_per_rank(fsdp1_run: Path) -> None:
    """The file asks for fsdp_sync_module_states, which FSDP1 cannot use on CPU: acc-train says
    so once, not once per rank, and the libraries' warnings every rank repeats (Accelerate's
    sharding_strategy deprecation, torch's FutureWarnings) print from one rank only."""
    stderr = (fsdp1_run.parent / "stderr.txt").read_text()
    ours = [line for line in stderr.splitlines() if line.startswith("warning: ")]
    assert any("strategy.sync_module_states is not used on CPU" in line for line in ours), stderr[-3000:]
    assert len(ours) == len(set(ours)), ours
    for library in ("sharding_strategy is deprecated in favor of reshard_after_forward", "`torch.distributed.reduce_op` is deprecated"):
        assert stderr.count(library) <= 1, (library, stderr[-3000:])


@pytest.mark.parametrize("which", ["fsdp2_run", "fsdp1_run"])
def test_losses_match_ddp_with_the_same_seed_and_data(which: str, request: pytest.FixtureRequest, ddp_run: Path) -> None:
    fsdp, ddp = read_metrics(request.getfixturevalue(which)), read_metrics(ddp_run)
    assert ddp[20]["epoch"] > ddp[10]["epoch"] >= 1, "the comparison must cross epoch boundaries"
    for step in range(1, 21):
        assert fsdp[step]["loss"] == pytest.approx(ddp[step]["loss"], abs=1e-4), step


@pytest.mark.parametrize("which", ["fsdp2_run", "fsdp1_run"])
def test_greedy_samples_are_ddps(which: str, request: pytest.FixtureRequest, ddp_run: Path) -> None:
    """Every rank generates in lockstep from its shards (FSDP1's root unit gathered for it): in
    fp32 the greedy completions at steps 10 and 20 are the ones DDP's full replicas make."""
    assert len(same_samples(ddp_run)) == 4 and same_samples(request.getfixturevalue(which)) == same_samples(ddp_run)


def test_fsdp2_stop_and_resume_gives_the_same_losses(fsdp2_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    resumed = resume_from_step_10(fsdp2_run, tmp_path, tiny_model_dir, tiny_data, "--strategy", "fsdp")
    full, again = read_metrics(fsdp2_run), read_metrics(resumed)
    for step in range(11, 21):
        assert again[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-6), step
    manifest = json.loads((fsdp2_run / "checkpoints" / "step-000010" / "manifest.json").read_text())
    assert manifest["format"] == "dcp"
    assert any(name.startswith("state/") and name.endswith(".safetensors") for name in manifest["files"])


def test_fsdp1_full_state_checkpoint_resumes(fsdp1_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    manifest = json.loads((fsdp1_run / "checkpoints" / "step-000010" / "manifest.json").read_text())
    assert manifest["format"] == "fsdp-full"
    cfg = fsdp1_run / "config.yaml"  # the resolved config of the run, as a user would reuse it
    resumed = resume_from_step_10(fsdp1_run, tmp_path, tiny_model_dir, tiny_data, "--config", str(cfg))
    full, again = read_metrics(fsdp1_run), read_metrics(resumed)
    for step in range(11, 21):
        assert again[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-6), step


@pytest.mark.parametrize("which", ["fsdp2_run", "fsdp1_run"])
def test_final_model_is_consolidated_for_transformers(which: str, request: pytest.FixtureRequest, tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from acc_train.checkpoint_tools import read_full_state

    run = request.getfixturevalue(which)
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert_model_card(run, "fsdp")
    summary = json.loads((run / "run.json").read_text())
    assert sum(p.numel() for p in model.parameters()) == summary["model_parameters"]
    assert torch.isfinite(model(torch.tensor([[2, 3, 4, 5]])).logits).all()
    # the exported weights are the trained ones: equal to the last checkpoint's (dcp or fsdp-full)
    last = run / "checkpoints" / "step-000020"
    ckpt = read_full_state(last, json.loads((last / "manifest.json").read_text()))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ckpt[f"model.{name}"]), name
    untrained = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(untrained.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.gpu
def test_on_gpus_accelerates_own_fsdp_path_runs(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    import torch

    from tests.conftest import tiny_job_args

    out = tmp_path / "gpu"
    n = torch.cuda.device_count()
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, out, "--strategy", "fsdp", "--num-processes", str(n), "--max-steps", "3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["distributed_type"] == "DistributedType.FSDP" and summary["device"] == "cuda"


@pytest.mark.parametrize(
    ("switch", "counts"),
    [
        ("training.gradient_checkpointing=true", {"transformers_layers": 1, "checkpoint_wrappers": 0}),
        # FSDP's own switch is the same thing (Accelerate's FSDP2 wrapper would recompute dropout with other masks)
        ("strategy.activation_checkpointing=true", {"transformers_layers": 1, "checkpoint_wrappers": 0}),
    ],
)
def test_fsdp2_activation_checkpointing_gives_the_losses_of_the_run_without_it(
    switch: str, counts: dict, fsdp2_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    """fp32, recompute only, by either switch: the losses of the same FSDP2 run without it."""
    from tests.conftest import assert_same_losses, checkpointed_run

    got = checkpointed_run(tmp_path, tiny_model_dir, tiny_data, "--strategy", "fsdp", switches=(switch,))
    assert got["run"]["fsdp_version"] == 2
    assert got["run"]["activation_checkpointing"] == counts
    assert_same_losses(got["losses"], read_metrics(fsdp2_run))


def test_fsdp1_with_both_switches_checkpoints_each_layer_once(fsdp1_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """training.gradient_checkpointing with FSDP's own activation_checkpointing: transformers'
    alone recomputes (no checkpoint wrapper nested around it); FSDP1's losses."""
    from tests.conftest import assert_same_losses, checkpointed_run

    cfg = fsdp1_run / "config.yaml"
    got = checkpointed_run(
        tmp_path, tiny_model_dir, tiny_data, "--config", str(cfg),
        switches=("training.gradient_checkpointing=true", "strategy.activation_checkpointing=true"),
    )  # fmt: skip
    assert got["run"]["fsdp_version"] == 1
    assert got["run"]["activation_checkpointing"] == {"transformers_layers": 1, "checkpoint_wrappers": 0}
    assert_same_losses(got["losses"], read_metrics(fsdp1_run))
