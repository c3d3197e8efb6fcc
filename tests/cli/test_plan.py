"""`acc-train plan`: per-rank memory under every installed strategy, counted without building
the model, with the fp32 formulas BENCHMARKS.md measured and clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import cli_in_process as run_cli  # plan answers without workers: in this process

DEMO_PSI = 1_426_752  # the demo model, as run.json counts it (BENCHMARKS.md)


def plan_json(*args: str) -> dict:
    proc = run_cli("plan", "--json", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    data["by_label"] = {r["label"]: r for r in data["rows"]}
    return data


@pytest.fixture(scope="module")
def demo_fp32() -> dict:
    return plan_json("--num-processes", "4", "--mixed-precision", "no")


def test_every_installed_strategy_and_preset_has_a_row(demo_fp32: dict) -> None:
    assert demo_fp32["parameters"] == DEMO_PSI and demo_fp32["world_size"] == 4
    assert {"ddp", "fsdp1", "fsdp2", "fsdp-offload", "fsdp1-shard_grad_op", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload"} <= set(
        demo_fp32["by_label"]
    )
    assert [r["label"] for r in demo_fp32["rows"] if r["job"]] == ["ddp"]  # the job's own strategy is marked


@pytest.mark.parametrize(
    ("label", "bytes_per_param"),
    [
        ("ddp", 16),
        ("fsdp2", 16 / 4),
        ("fsdp1", 16 / 4),
        ("fsdp1-shard_grad_op", 4 + 16 / 4),  # the gathered parameters live from forward to backward
        ("zero1", 8 + 12 / 4),
        ("zero3", 20 / 4),
        ("zero2", 8 + 12 / 4),  # the demo model fits one default reduce bucket: every gradient at once, as measured
    ],
)
def test_fp32_model_state_follows_the_measured_formulas(demo_fp32: dict, label: str, bytes_per_param: float) -> None:
    row = demo_fp32["by_label"][label]
    assert row["model_state"] == pytest.approx(bytes_per_param * DEMO_PSI, rel=1e-5)
    assert row["model_state"] == row["params"] + row["grads"] + row["optimizer"]
    assert row["formula"]


def test_zero2_with_a_small_bucket_partitions_gradients() -> None:
    data = plan_json("--num-processes", "4", "--mixed-precision", "no", "--set", "strategy.name=zero2", "--set", "strategy.reduce_bucket_size=50000")
    row = data["by_label"]["zero2 (this job)"]
    assert row["job"] and row["grads"] == 4 * (DEMO_PSI // 4 + 50_000)


def test_offload_moves_state_out_of_the_device_total(demo_fp32: dict) -> None:
    zero2, off2 = demo_fp32["by_label"]["zero2"], demo_fp32["by_label"]["zero2-offload"]
    assert off2["offload"] == {"optimizer": "cpu", "grads": "cpu"}
    assert off2["offloaded"] == off2["optimizer"] + off2["grads"]
    assert off2["device_total"] == zero2["device_total"] - off2["offloaded"]
    off3 = demo_fp32["by_label"]["zero3-offload"]
    assert set(off3["offload"]) == {"params", "grads", "optimizer"}
    # what stays on the device: the activations and DeepSpeed's buffers (its reduction bucket and the live gathered
    # parameters, which plan --simulate found on the device)
    assert off3["buffers"] > 0 and off3["device_total"] == off3["activations"] + off3["buffers"]
    assert demo_fp32["by_label"]["fsdp-offload"]["offloaded"] == demo_fp32["by_label"]["fsdp2"]["model_state"]


def test_activations_are_an_estimate_for_the_configured_batch(demo_fp32: dict) -> None:
    ddp = demo_fp32["by_label"]["ddp"]
    assert ddp["activations"] > 0 and ddp["device_total"] == ddp["model_state"] + ddp["activations"]
    doubled = plan_json("--num-processes", "4", "--mixed-precision", "no", "--micro-batch-size", "16")["by_label"]["ddp"]
    assert doubled["activations"] == pytest.approx(2 * ddp["activations"], rel=0.01)
    assert doubled["model_state"] == ddp["model_state"]
    assert "what autograd keeps" in demo_fp32["activation_formula"] and "12V" in demo_fp32["activation_formula"]


def test_bf16_uses_mixed_precision_accounting() -> None:
    rows = plan_json("--num-processes", "4", "--mixed-precision", "bf16")["by_label"]
    assert rows["ddp"]["model_state"] == 16 * DEMO_PSI  # autocast keeps fp32 parameters, gradients, moments
    assert rows["fsdp2"]["model_state"] == pytest.approx(16 * DEMO_PSI / 4, rel=1e-5)
    assert rows["zero3"]["model_state"] == pytest.approx(16 * DEMO_PSI / 4, rel=1e-5)  # the paper's (2 + 2 + 12) psi / N
    assert rows["zero1"]["model_state"] == pytest.approx(4 * DEMO_PSI + 12 * DEMO_PSI / 4, rel=1e-5)


def test_the_table_states_formulas_and_what_is_estimated() -> None:
    proc = run_cli("plan", "--num-processes", "2", "--mixed-precision", "no")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "psi = 1,426,752 parameters; N = 2" in out
    for text in ("16psi/N", "4psi + 4psi + 8psi = 16psi", "20psi/N", "(cpu)", "estimate", "activations"):
        assert text in out, text


def test_a_7b_model_is_planned_without_allocating_it(tmp_path: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    data = plan_json("--model", str(tmp_path), "--num-processes", "8", "--mixed-precision", "bf16", "--set", "data.seq_len=2048")
    assert data["parameters"] == 6_738_415_616  # Llama-2-7B
    assert data["by_label"]["zero3"]["model_state"] == pytest.approx(16 * 6_738_415_616 / 8, rel=1e-6)
    also = plan_json("--model", str(tmp_path / "config.json"), "--num-processes", "8")  # the config file itself
    assert also["parameters"] == 6_738_415_616
    # sdpa (transformers' default) stores no attention scores; per token and layer in bf16: two RMSNorms
    # (4h fp32 upcast + 2 x 2h each), query, key, value and output (2 x 4 x 4096) + a logsumexp (4 x 32),
    # the SwiGLU MLP (4 x 2 x 11008); then the final norm and the loss's 12V (tests/core/test_memory_plan.py)
    one = ("--model", str(tmp_path), "--num-processes", "8", "--mixed-precision", "bf16", "--set", "data.seq_len=2048", "--micro-batch-size", "1")
    sdpa = plan_json(*one)
    assert sdpa["attn_implementation"] == "sdpa" and sdpa["attention_score_factor"] == 0
    h, rest = 4096, 8 * 4096 + 12 * 32000
    layer = 16 * h + 2 * (4 * h) + 4 * 32 + 8 * 11008
    assert sdpa["by_label"]["ddp"]["activations"] == 2048 * (32 * layer + rest)
    assert sdpa["by_label"]["ddp"]["activations"] / 2**30 == pytest.approx(12.2, abs=0.1)
    eager = plan_json(*one, "--set", "model.attn_implementation=eager")
    assert eager["attention_score_factor"] == 6  # the fp32 softmax and its bf16 cast
    eager_layer = 16 * h + 4 * 2 * h + 6 * 32 * 2048 + 8 * 11008
    assert eager["by_label"]["ddp"]["activations"] == 2048 * (32 * eager_layer + rest)


def test_expected_tokens_per_s_at_a_given_mfu(tmp_path: Path) -> None:
    from acc_train.outputs.mfu import model_flops_per_token

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = ("--model", str(tmp_path), "--num-processes", "8", "--mixed-precision", "bf16", "--set", "data.seq_len=2048", "--mfu", "0.4", "--device", "H100")
    t = plan_json(*args)["throughput"]
    per_token = model_flops_per_token(config, 2048)
    assert t["flops_per_token"] == per_token and per_token == 6 * (6_738_415_616 - 32000 * 4096) + 12 * 32 * 4096 * 2048
    assert t["devices"] == 8 and t["peak_flops_per_device"] == 989.5e12 and "H100 SXM datasheet" in t["peak_source"]
    assert t["tokens_per_s"] == pytest.approx(0.4 * 8 * 989.5e12 / per_token)  # about 9,200 tokens/s per H100
    text = run_cli("plan", *args).stdout
    assert "throughput at MFU 40%: 73,869 tokens/s over all ranks" in text, text[-600:]
    assert plan_json("--num-processes", "2")["throughput"] is None  # only when asked


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--mfu", "2"), "'--mfu': 2.0 is not in the range 0<x<=1"),
        (("--mfu", "0"), "'--mfu': 0.0 is not in the range 0<x<=1"),
        (("--mfu", "0.4", "--device", "GTX 1080"), "no peak is known for a device named 'GTX 1080'"),
        (("--device", "H100"), "--device only says what --mfu is measured against"),
    ],
)
def test_bad_mfu_input_is_exit_2(args: tuple[str, ...], message: str) -> None:
    proc = run_cli("plan", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_a_model_path_without_a_config_is_exit_2(tmp_path: Path) -> None:
    proc = run_cli("plan", "--model", str(tmp_path))
    assert proc.returncode == 2
    assert "has no config.json" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("n", ["0", "-1"])
def test_fewer_than_one_process_is_exit_2(n: str) -> None:
    proc = run_cli("plan", "--num-processes", n)
    assert proc.returncode == 2
    assert "launch.num_processes" in proc.stderr and "Traceback" not in proc.stderr


def test_the_default_config_file_shapes_the_plan_as_it_shapes_a_run(tmp_path: Path) -> None:
    """`acc-train plan` resolves the job as `acc-train` does: defaults < the default config
    file < flags < --set."""
    default = tmp_path / "default_config.yaml"
    default.write_text("strategy:\n  name: zero3\ntraining:\n  micro_batch_size: 16\n")
    env = {"ACC_TRAIN_CONFIG_FILE": str(default)}
    proc = run_cli("plan", "--json", "--num-processes", "4", "--mixed-precision", "no", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert [r["label"] for r in data["rows"] if r["job"]] == ["zero3"]
    assert data["micro_batch_size"] == 16
    assert f"using the default config file {default}" in proc.stderr
    trained = run_cli("--print-config", env=env)  # the same file, read the same way by a run
    assert trained.returncode == 0 and "name: zero3" in trained.stdout, trained.stderr
    flags = json.loads(run_cli("plan", "--json", "--micro-batch-size", "2", "--set", "strategy.name=ddp", env=env).stdout)
    assert flags["micro_batch_size"] == 2 and [r["label"] for r in flags["rows"] if r["job"]] == ["ddp"]  # flags and --set win


def test_the_optimizer_state_is_the_jobs_optimizers() -> None:
    """sgd with momentum holds one fp32 buffer per parameter (4 bytes, not AdamW's 8), without
    momentum none; adafactor about none (its row and column vectors)."""
    sgd = plan_json("--num-processes", "4", "--mixed-precision", "no", "--set", "optimizer.name=sgd")
    assert sgd["optimizer"] == {"name": "sgd", "state_bytes_per_parameter": 4.0}
    assert sgd["by_label"]["ddp"]["optimizer"] == 4 * DEMO_PSI and sgd["by_label"]["ddp"]["formula"] == "4psi + 4psi + 4psi = 12psi"
    assert sgd["by_label"]["fsdp2"]["optimizer"] == pytest.approx(4 * DEMO_PSI / 4, rel=1e-5)
    plain = plan_json("--num-processes", "4", "--mixed-precision", "no", "--set", "optimizer.name=sgd", "--set", "optimizer.momentum=0")
    assert plain["by_label"]["ddp"]["optimizer"] == 0
    ada = plan_json("--num-processes", "4", "--mixed-precision", "no", "--set", "optimizer.name=adafactor")
    assert ada["by_label"]["ddp"]["optimizer"] == 0 and ada["optimizer"]["state_bytes_per_parameter"] == 0
