"""Per-rank model-state memory of DDP and FSDP against the ZeRO paper's formula.

For each strategy and world size, trains the demo model for a few steps through ``acc-train`` on
CPU and reads what each rank held (``run.json``: ``model_state_bytes``, counted from the tensors
themselves, and the peak RSS). With fp32 weights and Adam, the ZeRO paper's model state is
4 bytes of parameters + 4 of gradients + 8 of Adam moments per parameter: 16 psi for a replica
(DDP), 16 psi / N under full sharding (FSDP full_shard / ZeRO-3).

Usage: python bench/bench_memory.py [--world-sizes 2 4] [--strategies ddp fsdp fsdp1] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(strategy: str, nproc: int, steps: int, workdir: Path) -> dict:
    out = workdir / f"{strategy}-{nproc}"
    cmd = [
        sys.executable, "-m", "acc_train_cli",
        "--strategy", strategy, "--num-processes", str(nproc), "--max-steps", str(steps),
        "--output-dir", str(out), "--overwrite", "--micro-batch-size", "4",
        "--set", "training.progress_bar=false", "--set", "training.mixed_precision=no",
        "--set", "data.eval_fraction=0", "--set", "checkpoint.every=0",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((out / "run.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp", "fsdp1"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()

    rows, raw = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.world_sizes:
            for strategy in args.strategies:
                summary = run(strategy, n, args.steps, Path(tmp))
                raw.append(summary)
                psi = summary["model_parameters"]
                sharded = summary["distributed_type"] == "DistributedType.FSDP"
                predicted = 16 * psi / n if sharded else 16 * psi
                per_rank = summary["per_rank"]
                if per_rank[0]["model_state_bytes"] is None:
                    print(f"skipped: {strategy} does not report model-state bytes yet", file=sys.stderr)
                    continue
                held = [sum(r["model_state_bytes"].values()) for r in per_rank]
                parts = {k: statistics.fmean(r["model_state_bytes"][k] for r in per_rank) for k in ("params", "grads", "optimizer")}
                rows.append(
                    (
                        strategy, n, summary["distributed_type"].split(".")[-1], psi,
                        parts["params"], parts["grads"], parts["optimizer"], statistics.fmean(held), predicted,
                        statistics.fmean(held) / predicted, max(r["peak_memory_bytes"] for r in per_rank),
                    )
                )  # fmt: skip
                print(f"done: {strategy} x{n}", file=sys.stderr, flush=True)

    kib = 1024
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; demo model, fp32, AdamW, {args.steps} steps")
    header = ("strategy", "N", "type", "psi", "params KiB", "grads KiB", "adam KiB", "held KiB", "16psi[/N] KiB", "held/pred", "peak RSS MiB")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for r in rows:
        print(
            f"{r[0]} | {r[1]} | {r[2]} | {r[3]:,} | {r[4] / kib:,.0f} | {r[5] / kib:,.0f} | {r[6] / kib:,.0f} | "
            f"{r[7] / kib:,.0f} | {r[8] / kib:,.0f} | {r[9]:.3f} | {r[10] / 2**20:,.0f}"
        )
    ddp = {r[1]: r[7] for r in rows if r[0] == "ddp"}
    for r in rows:
        if r[0] != "ddp" and r[1] in ddp:
            print(f"{r[0]} x{r[1]}: model state per rank = {r[7] / ddp[r[1]]:.3f} of DDP's (1/N = {1 / r[1]:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
