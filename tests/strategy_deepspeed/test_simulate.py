"""`acc-train plan --simulate` under ZeRO-3: DeepSpeed's flat buffers (parameter, gradient and
fp32 master partitions, the reduction bucket) counted where they belong, by the strategy's
tracker (acc_train_deepspeed.simulate)."""

from __future__ import annotations

import json

from tests.conftest import run_cli

DEMO_PSI = 1_426_752  # the demo model's parameters (tests/cli/test_plan.py)
N = 2
REDUCE_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size, in elements


def test_zero3_simulated_holds_what_zero3_partitions() -> None:
    proc = run_cli("plan", "--simulate", "--strategies", "zero3", "--json", "--num-processes", str(N), "--mixed-precision", "no")
    assert proc.returncode == 0, proc.stderr[-2000:]
    entry = {e["name"]: e for e in json.loads(proc.stdout)["strategies"]}["zero3"]
    sim = entry["simulated"]
    assert sim is not None, entry.get("how")
    assert "ZeroMemTracker" in sim["how"]
    # fp32, the demo's 1.4M parameters in 30 tensors, each under stage3_param_persistence_threshold
    # (1e5 elements): every rank keeps its 4-byte partition (ds_tensor) and every parameter whole
    assert sim["parameters_bytes"] == 4 * DEMO_PSI // N + 4 * DEMO_PSI + 128  # + the rotary embedding's buffer
    # the fp32 gradient partition, and the reduction bucket ZeRO-3 allocates at start (contiguous_gradients)
    assert sim["gradients_bytes"] == 4 * DEMO_PSI // N + 4 * REDUCE_BUCKET
    # the fp32 master partition and AdamW's two moments of it (+ its step count, one fp32 scalar)
    assert sim["optimizer_bytes"] == 12 * DEMO_PSI // N + 4
    assert sim["activations_bytes"] > 0
    parts = ("parameters", "gradients", "optimizer", "activations", "other")
    assert sim["peak_bytes"] == sum(sim[f"{p}_bytes"] for p in parts)
    assert [r["ranks"] for r in entry["ranks"]] == [[0, 1]]
