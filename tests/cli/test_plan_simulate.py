"""`acc-train plan --simulate`: one step of the job rehearsed at the target world size on this
CPU (fake process group, fake tensors, the strategy applied as a run applies it, torch's memory
trackers), set beside the plan; and what would fail on the cluster refused here (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli_in_process, run_cli

DEMO_PSI = 1_426_752  # the demo model's parameters (test_plan.py)

#: one xdist worker for the module: its simulation (about 70 s) is made once, not once per worker
pytestmark = pytest.mark.xdist_group("plan-simulate")


@pytest.fixture(scope="module")
def simulated() -> tuple[int, dict, str]:
    """The demo job in fp32 at 4 ranks, fsdp2, ddp, zero3-offload and FSDP 2 x tp 2, with a device memory fsdp2's step exceeds."""
    proc = run_cli(
        "plan", "--simulate", "--strategies", "fsdp2,ddp,zero3-offload", "--mesh", "shard=2,tp=2", "--json", "--num-processes", "4",
        "--mixed-precision", "no", "--device-memory", "8MiB",
    )
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def test_fsdp2_simulated_holds_what_fsdp2_shards(simulated: tuple[int, dict, str]) -> None:
    _, data, stderr = simulated
    entry = {e["name"]: e for e in data["strategies"]}["fsdp2"]
    sim = entry["simulated"]
    assert sim is not None, stderr[-2000:]
    # FSDP2 shards every parameter's first dimension over 4 ranks, padded: rank 0 holds the larger share
    assert 4 * DEMO_PSI / 4 <= sim["parameters_bytes"] <= 4 * DEMO_PSI / 4 * 1.02
    assert sim["optimizer_bytes"] == pytest.approx(2 * sim["parameters_bytes"], rel=0.01)  # AdamW's two fp32 moments of the shard
    assert 0 < sim["gradients_bytes"] <= sim["parameters_bytes"]
    assert sim["activations_bytes"] > 0
    parts = ("parameters", "gradients", "optimizer", "activations", "other")
    assert sim["peak_bytes"] == sum(sim[f"{p}_bytes"] for p in parts)
    assert "fake process group" in sim["how"] and "FSDPMemTracker" in sim["how"]
    assert sim["at"]["phase"] in ("forward", "backward", "optimizer step")
    assert entry["plan"]["device_total_bytes"] > 0
    # every parameter gathered in forward (and again in backward), every gradient reduce-scattered
    assert entry["collectives"]["all_gather"]["count"] >= 2 and entry["collectives"]["reduce_scatter"]["count"] >= 1
    assert entry["collectives"]["all_gather"]["bytes"] >= 4 * DEMO_PSI  # the whole fp32 model at least once
    assert [r["ranks"] for r in entry["ranks"]] in ([[0, 3]], [[0], [3]])


def test_ddp_simulated_holds_a_whole_replica_and_its_gradient_bucket(simulated: tuple[int, dict, str]) -> None:
    _, data, stderr = simulated
    entry = {e["name"]: e for e in data["strategies"]}["ddp"]
    sim = entry["simulated"]
    assert sim is not None, entry["how"] + stderr[-2000:]
    assert sim["parameters_bytes"] == pytest.approx(4 * DEMO_PSI, abs=1024)  # every rank the whole model (+ its rotary buffer)
    assert sim["optimizer_bytes"] == pytest.approx(2 * 4 * DEMO_PSI, abs=1024)
    # the reducer's bucket (gradient_as_bucket_view off): a second copy of every gradient, beside the model
    assert sim["other_bytes"] >= 4 * DEMO_PSI
    assert entry["collectives"]["all_reduce"]["bytes"] == 4 * DEMO_PSI  # every gradient all-reduced once
    assert "MemTracker" in sim["how"] and [r["ranks"] for r in entry["ranks"]] == [[0, 3]]


def test_fsdp_x_tp_simulated_on_every_rank_kind(simulated: tuple[int, dict, str]) -> None:
    _, data, stderr = simulated
    entry = {e["name"]: e for e in data["strategies"]}["fsdp2 mesh replicate=1,shard=2,tp=2"]
    sim = entry["simulated"]
    assert sim is not None, entry["how"] + stderr[-2000:]
    # the last rank of a tp group is simulated too, and holds what rank 0 holds
    assert [r["ranks"] for r in entry["ranks"]] == [[0, 3]]
    assert 4 * DEMO_PSI / 4 <= sim["parameters_bytes"] <= 4 * DEMO_PSI / 4 * 1.02  # sharded over dp_shard x tp
    assert sim["optimizer_bytes"] == pytest.approx(2 * sim["parameters_bytes"], rel=0.01)  # the optimizer steps every parameter
    assert entry["collectives"]["all_reduce"]["count"] >= 1  # the row-parallel layers' partial sums


def test_a_strategy_that_cannot_be_simulated_says_so(simulated: tuple[int, dict, str]) -> None:
    _, data, _ = simulated
    # an offload preset runs on the cluster's GPUs, and this CPU machine refuses it: said, not an error of the plan
    offload = {e["name"]: e for e in data["strategies"]}["zero3-offload"]
    assert offload["simulated"] is None and "refuses" in offload["how"] and "offload" in offload["how"]
    assert offload["plan"]["device_total_bytes"] > 0


def test_a_step_that_does_not_fit_the_device_is_exit_2(simulated: tuple[int, dict, str]) -> None:
    code, _, stderr = simulated
    assert code == 2
    assert "--device-memory" in stderr and "does not fit" in stderr and "fsdp2 peaks at" in stderr and "Traceback" not in stderr


def test_simulation_options_need_simulate() -> None:
    proc = cli_in_process("plan", "--strategies", "fsdp2")
    assert proc.returncode == 2 and "--simulate" in proc.stderr


def test_plan_for_several_machines_needs_no_rendezvous_address() -> None:
    proc = cli_in_process("plan", "--json", "--num-processes", "8", "--num-machines", "8", "--mixed-precision", "bf16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["world_size"] == 64


def test_a_mesh_whose_tp_does_not_divide_the_heads_is_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 32, "num_key_value_heads": 32,
    }))  # fmt: skip
    proc = cli_in_process("plan", "--model", str(config), "--num-processes", "6", "--mesh", "shard=2,tp=3")
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert "tp" in proc.stderr and "32" in proc.stderr and "Traceback" not in proc.stderr


def test_a_mesh_whose_product_is_not_the_world_is_exit_2() -> None:
    proc = cli_in_process("plan", "--num-processes", "8", "--mesh", "replicate=3,shard=2")
    assert proc.returncode == 2 and "8 processes" in proc.stderr and "Traceback" not in proc.stderr


def test_a_wrap_policy_that_leaves_the_layers_unwrapped_is_exit_2() -> None:
    # the size policy's default (1e8 parameters) wraps none of the demo's layers: FSDP would gather the whole model at once
    proc = cli_in_process("--strategy", "fsdp", "plan", "--num-processes", "4", "--set", "strategy.auto_wrap_policy=size")
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert "strategy.auto_wrap_policy" in proc.stderr and "LlamaDecoderLayer" in proc.stderr and "min_num_params" in proc.stderr
    assert "Traceback" not in proc.stderr
