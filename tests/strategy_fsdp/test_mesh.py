"""FSDP2 over a 2-D mesh (Accelerate's ParallelismConfig): HSDP, dp_replicate x dp_shard = 2 x 2 on
4 CPU processes over gloo (the tiny model without dropout, so world sizes compare), trains to DDP's losses, records its mesh in run.json, and its
checkpoints resume under DDP and plain FSDP on 2 processes, and DDP's under HSDP. Tensor parallelism (transformers' tp_plan over the mesh's
tp dimension): tp = 2 alone on 2 processes and dp_shard x tp = 2 x 2 on 4 train to DDP's losses; FSDP x TP's checkpoints resume under DDP,
TP's under FSDP, and DDP's under FSDP x TP. An accelerate config file's parallelism_config is the mesh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli_in_process, read_metrics, run_cli, shared_runs, stopped_copy, tiny_job_args

STEPS = 6
#: the global batch is 8 sequences in every setting, so any of them continues another's data order
SETTINGS = {
    "ddp-4": ("--strategy", "ddp", "--num-processes", "4", "--micro-batch-size", "2"),
    "hsdp-2x2": ("--strategy", "fsdp", "--num-processes", "4", "--micro-batch-size", "2", "--set", "strategy.dp_replicate=2"),
    "ddp-2": ("--strategy", "ddp", "--num-processes", "2", "--micro-batch-size", "4"),
    "fsdp-2": ("--strategy", "fsdp", "--num-processes", "2", "--micro-batch-size", "4"),
    # the ranks of a tp group read the same batches: 1 and 2 data-parallel ranks
    "tp-2": ("--strategy", "fsdp", "--num-processes", "2", "--micro-batch-size", "8", "--set", "strategy.tp=2"),
    "fsdp-tp-2x2": ("--strategy", "fsdp", "--num-processes", "4", "--micro-batch-size", "4", "--set", "strategy.dp_shard=2", "--set", "strategy.tp=2"),
}


def _args(model: Path, data: dict[str, Path], out: Path, setting: str, *extra: str) -> list[str]:
    steps = ("--max-steps", str(STEPS), "--set", "checkpoint.every=3", "--set", "checkpoint.keep_last=null")
    return [*tiny_job_args(model, data, out, *steps, *extra), *SETTINGS[setting]]


def test_mesh_sizes_must_fit_the_world_before_launch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli_in_process("--strategy", "fsdp", "--num-processes", "4", "--set", "strategy.dp_replicate=3", "--output-dir", str(out), "--max-steps", "1")
    assert proc.returncode == 2 and "strategy.dp_replicate" in proc.stderr and "does not divide the world size (4 processes)" in proc.stderr
    proc = cli_in_process("--strategy", "fsdp", "--num-processes", "4", "--set", "strategy.dp_replicate=2", "--set", "strategy.dp_shard=3", "--output-dir", str(out))
    assert proc.returncode == 2 and "2 x 3 = 6" in proc.stderr
    proc = cli_in_process("--strategy", "fsdp1", "--set", "strategy.dp_replicate=2", "--output-dir", str(out))
    assert proc.returncode == 2 and "FSDP2 option" in proc.stderr
    assert not out.exists()


def test_tensor_and_context_parallel_sizes_are_checked_before_launch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli_in_process("--strategy", "fsdp", "--num-processes", "4", "--set", "strategy.tp=3", "--output-dir", str(out))
    assert proc.returncode == 2 and "strategy.tp" in proc.stderr and "tp: 3 does not divide the world size (4 processes)" in proc.stderr
    proc = cli_in_process("--strategy", "fsdp", "--num-processes", "4", "--set", "strategy.tp=2", "--set", "strategy.dp_shard=4", "--output-dir", str(out))
    assert proc.returncode == 2 and "dp_shard: 4 does not divide the world size / tp (4 / 2 = 2)" in proc.stderr
    proc = cli_in_process("--strategy", "fsdp", "--num-processes", "4", "--set", "strategy.tp=2", "--set", "strategy.dp_replicate=2", "--output-dir", str(out))
    assert proc.returncode == 2 and "strategy.dp_replicate" in proc.stderr and "use dp_shard: 2 instead" in proc.stderr
    proc = cli_in_process("--strategy", "fsdp", "--num-processes", "2", "--set", "strategy.cp=2", "--output-dir", str(out))
    assert proc.returncode == 2 and "strategy.cp" in proc.stderr and "CUDA only" in proc.stderr
    proc = cli_in_process("--strategy", "fsdp1", "--set", "strategy.tp=2", "--output-dir", str(out))
    assert proc.returncode == 2 and "FSDP2 option" in proc.stderr
    assert not out.exists()


def test_tp_must_divide_the_models_heads_before_launch(tiny_model_dir: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli_in_process(*tiny_job_args(tiny_model_dir, tiny_data, out, "--strategy", "fsdp", "--num-processes", "4", "--set", "strategy.tp=4"))
    assert proc.returncode == 2 and "strategy.tp" in proc.stderr and "tp: 4 does not divide the model's num_attention_heads (2)" in proc.stderr
    assert not out.exists()


def test_tp_must_divide_the_attention_heads() -> None:
    from transformers import LlamaConfig

    from acc_train.api import UserError
    from acc_train_fsdp.tensor_parallel import check_tp_fits

    check_tp_fits(LlamaConfig(num_attention_heads=4, num_key_value_heads=2), 2)
    with pytest.raises(UserError) as caught:
        check_tp_fits(LlamaConfig(num_attention_heads=4, num_key_value_heads=1, hidden_size=64), 2)
    assert caught.value.where == "strategy.tp" and "num_key_value_heads (1)" in str(caught.value)


@pytest.fixture(scope="module")
def runs(no_dropout_model: Path, tiny_data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    return shared_runs(tmp_path_factory, lambda setting, out: _args(no_dropout_model, tiny_data, out, setting))


@pytest.mark.launch
@pytest.mark.xdist_group("mesh")
def test_hsdp_trains_to_ddps_losses_and_records_its_mesh(runs) -> None:
    ref, got = read_metrics(runs("ddp-4")), read_metrics(runs("hsdp-2x2"))
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-5), step
        # (AdamW would hide gradients scaled by a constant from the losses; their norm does not)
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step
    summary = json.loads((runs("hsdp-2x2") / "run.json").read_text())
    assert summary["world_size"] == 4 and summary["fsdp_version"] == 2
    assert summary["mesh"]["shape"] == {"dp_replicate": 2, "dp_shard": 2}
    assert summary["mesh"]["coordinates"] == {
        "0": {"dp_replicate": 0, "dp_shard": 0}, "1": {"dp_replicate": 0, "dp_shard": 1},
        "2": {"dp_replicate": 1, "dp_shard": 0}, "3": {"dp_replicate": 1, "dp_shard": 1},
    }  # fmt: skip
    whole = summary["model_parameters"]
    for rank in summary["per_rank"]:  # sharded over the 2 ranks of a replica, not over all 4
        assert rank["param_elements"] == pytest.approx(whole / 2, abs=8)


@pytest.mark.launch
@pytest.mark.xdist_group("mesh")
@pytest.mark.parametrize(("writer", "reader"), [("hsdp-2x2", "ddp-2"), ("hsdp-2x2", "fsdp-2"), ("ddp-4", "hsdp-2x2")])
def test_a_mesh_run_resumes_across_mesh_and_strategy(runs, writer: str, reader: str, no_dropout_model: Path, tiny_data: dict[str, Path], tmp_path: Path) -> None:
    resumed = stopped_copy(runs(writer), tmp_path / "resumed", saved=3, lost=6)
    proc = run_cli(*_args(no_dropout_model, tiny_data, resumed, reader, "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref, got = read_metrics(runs("ddp-4")), read_metrics(resumed)
    for step in range(4, STEPS + 1):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-5), step
        # (AdamW would hide gradients scaled by a constant from the losses; their norm does not)
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step


@pytest.mark.launch
@pytest.mark.xdist_group("mesh")
@pytest.mark.parametrize(
    ("setting", "shape", "elements"),
    [("tp-2", {"tp": 2}, 2), ("fsdp-tp-2x2", {"dp_shard": 2, "tp": 2}, 4)],
)
def test_tensor_parallel_trains_to_ddps_losses_and_records_its_mesh(runs, setting: str, shape: dict[str, int], elements: int) -> None:
    ref, got = read_metrics(runs("ddp-4")), read_metrics(runs(setting))
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-5), step
        # (AdamW would hide gradients scaled by a constant from the losses; their norm does not)
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step
    summary = json.loads((runs(setting) / "run.json").read_text())
    assert summary["mesh"]["shape"] == shape
    for rank, coordinates in summary["mesh"]["coordinates"].items():
        assert coordinates["tp"] == int(rank) % 2  # tp is the innermost dimension: ranks 0 and 1 are one tp group
    assert summary["distributed_type"].endswith("MULTI_CPU" if setting == "tp-2" else "FSDP")
    whole = summary["model_parameters"]
    for rank in summary["per_rank"]:  # cut over the mesh's processes, the norms' few weights whole on each tp rank
        assert whole / elements <= rank["param_elements"] <= whole / elements + 3 * 32


@pytest.mark.launch
@pytest.mark.xdist_group("mesh")
@pytest.mark.parametrize(("writer", "reader"), [("fsdp-tp-2x2", "ddp-2"), ("tp-2", "fsdp-2"), ("ddp-4", "fsdp-tp-2x2")])
def test_a_tensor_parallel_run_resumes_across_mesh_and_strategy(
    runs, writer: str, reader: str, no_dropout_model: Path, tiny_data: dict[str, Path], tmp_path: Path
) -> None:
    resumed = stopped_copy(runs(writer), tmp_path / "resumed", saved=3, lost=6)
    proc = run_cli(*_args(no_dropout_model, tiny_data, resumed, reader, "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref, got = read_metrics(runs("ddp-4")), read_metrics(resumed)
    for step in range(4, STEPS + 1):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-5), step
        # (AdamW would hide gradients scaled by a constant from the losses; their norm does not)
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step


def test_plan_reads_tp_in_the_mesh_and_divides_the_model_state_by_it() -> None:
    from acc_train.api import PlanInput, resolve_strategy
    from acc_train_cli.plan import parse_mesh

    assert parse_mesh("shard=2,tp=2") == {"dp_shard": 2, "tp": 2}
    psi = 1_000_000
    plan = resolve_strategy("fsdp", {"version": 2, **parse_mesh("shard=2,tp=2")}).planner().plan_memory(PlanInput(psi, 4, "no"))
    assert (plan.params, plan.grads, plan.optimizer) == (4 * psi // 4, 4 * psi // 4, 8 * psi // 4)
    assert "x tp=2" in plan.note
    hsdp = resolve_strategy("fsdp", {"version": 2, **parse_mesh("replicate=2,tp=2")})
    with pytest.raises(Exception, match="use dp_shard: 2 instead"):
        hsdp.planner().plan_memory(PlanInput(psi, 4, "no"))


ACCELERATE_MESH_FILE = """\
distributed_type: FSDP
num_processes: 8
num_machines: 2
main_process_ip: 10.0.0.1
fsdp_config:
  fsdp_version: 2
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
"""


def test_an_accelerate_config_files_parallelism_config_is_the_mesh(tmp_path: Path) -> None:
    import yaml

    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text(ACCELERATE_MESH_FILE)
    proc = cli_in_process("--config", str(cfg), "--print-config")
    assert proc.returncode == 0, proc.stderr
    strategy = yaml.safe_load(proc.stdout)["strategy"]
    assert (strategy["name"], strategy["version"], strategy["dp_replicate"], strategy["dp_shard"], strategy["tp"]) == ("fsdp", 2, 2, 2, 2)
    proc = cli_in_process("plan", "--config", str(cfg))  # the job's own row: the file's mesh, per rank
    assert proc.returncode == 0, proc.stderr
    assert "mesh dp_replicate=2 x dp_shard=2 x tp=2: N = dp_shard x tp" in proc.stdout


def test_a_parallelism_config_no_strategy_reads_is_refused_with_its_line(tmp_path: Path) -> None:
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nparallelism_config:\n  parallelism_config_tp_size: 2\n")
    proc = cli_in_process("--config", str(cfg), "--print-config")
    assert proc.returncode == 2
    assert f"{cfg}:3: parallelism_config" in proc.stderr and "the ddp strategy (distributed_type MULTI_GPU) does not read it" in proc.stderr
    assert "read by the fsdp strategy" in proc.stderr
    cfg.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 1\nparallelism_config:\n  parallelism_config_tp_size: 2\n")
    proc = cli_in_process("--config", str(cfg), "--print-config")
    assert proc.returncode == 2 and f"{cfg}:5: parallelism_config" in proc.stderr and "needs FSDP2" in proc.stderr


def test_fsdp_options_are_refused_where_tensor_parallelism_runs_alone() -> None:
    from acc_train.api import Machine, UserError, resolve_strategy

    for option, value in (("activation_checkpointing", True), ("reshard_after_forward", True), ("mixed_precision_policy", {"param_dtype": "bf16"})):
        strategy = resolve_strategy("fsdp", {"version": 2, "tp": 2, option: value})
        with pytest.raises(UserError) as caught:
            strategy.bind(Machine("cpu", 2)).check_environment()  # tp = the world: no FSDP to use it
        assert caught.value.where == f"strategy.{option}" and "tensor parallelism alone (no FSDP)" in str(caught.value)
        strategy.bind(Machine("cpu", 4)).check_environment()  # FSDP x TP (dp_shard 2) uses it


def test_the_plan_splits_activations_over_tp() -> None:
    from acc_train.memory.plan import ModelShape, layer_activation_bytes

    proc = cli_in_process("plan", "--num-processes", "4", "--mesh", "shard=2,tp=2", "--json", "--mixed-precision", "no")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = {r["label"]: r for r in out["rows"]}
    row, plain = rows["fsdp2 mesh replicate=1,shard=2,tp=2"], rows["fsdp2"]
    assert row["activations"] < plain["activations"]
    assert "the attention, MLP and expert terms / t" in out["activation_formula"]
    # one layer: the attention (with its stored scores) and the MLP halve over 2 tp ranks, the norms stay
    # (eager attention with dropout: the softmax, its cast, the dropout mask and output)
    shape = ModelShape("one layer", 0, layers=1, hidden=64, heads=4, vocab=1, attn_implementation="eager", attention_dropout=0.1)
    whole, split = layer_activation_bytes(shape, 32, "bf16"), layer_activation_bytes(shape, 32, "bf16", tp=2)
    norms = 2 * (4 * 64 + 2 * 2 * 64)
    assert whole == norms + 4 * 2 * 64 + 9 * 4 * 32 + 4 * 2 * 256
    assert split == norms + (whole - norms) / 2  # type: ignore[operator]


def test_an_explicit_reshard_after_forward_false_is_refused_too_where_tp_runs_alone() -> None:
    from acc_train.api import Machine, UserError, resolve_strategy

    with pytest.raises(UserError, match="tensor parallelism alone"):
        resolve_strategy("fsdp", {"version": 2, "tp": 2, "reshard_after_forward": False}).bind(Machine("cpu", 2)).check_environment()
    resolve_strategy("fsdp", {"version": 2, "tp": 2}).bind(Machine("cpu", 2)).check_environment()  # nothing set: nothing refused
