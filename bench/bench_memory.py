"""Per-rank model-state memory of DDP, FSDP and DeepSpeed ZeRO against the ZeRO paper's formulas.

For each strategy and world size, trains the demo model for a few steps through ``acc-train`` on
CPU and reads what each rank held (``run.json``: ``model_state_bytes``, counted from the tensors
themselves, and the peak RSS), and the median step time against DDP's at the same size.

The ZeRO paper counts mixed-precision Adam as 2 bytes of fp16 parameters + 2 of fp16 gradients
+ K = 12 of optimizer state (fp32 master weights, momentum, variance) per parameter. Restated for
fp32 training, parameters and gradients take 4 bytes each; DeepSpeed still keeps an fp32 master
partition beside the fp32 parameters (measured: ``single_partition_of_fp32_groups`` under stages
1-2, a cloned ``fp32_partitioned_groups_flat`` under stage 3), so K stays 12 for ZeRO, while DDP
and FSDP step the parameters in place (K = 8, Adam's two moments):

    DDP        4 + 4 + 8         = 16 psi        FSDP full shard  (4 + 4 + 8) / N = 16 psi / N
    ZeRO-1     4 + 4 + 12 / N    psi             ZeRO-2           4 + 16 / N  psi
    ZeRO-3     (4 + 4 + 12) / N  = 20 psi / N

Gradients under ZeRO-2 are partitioned as they are reduced, bucket by bucket; with DeepSpeed's
default bucket (5e8 elements) the whole demo model is one bucket, so every gradient exists at
once. The ZeRO-2 row therefore sets ``reduce_bucket_size`` to 50,000 elements (3.5% of psi),
as a model much larger than its bucket would behave; the row ``zero2-default`` shows the default.

Usage: python bench/bench_memory.py [--world-sizes 2 4] [--strategies ddp fsdp zero3 ...] [--steps 6]

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


#: bench row name -> (strategy name, extra --set options, formula: bytes per parameter at N ranks)
ROWS = {
    "ddp": ("ddp", (), lambda n: 16.0),
    "fsdp": ("fsdp", (), lambda n: 16.0 / n),
    "fsdp1": ("fsdp1", (), lambda n: 16.0 / n),
    "zero1": ("zero1", (), lambda n: 8.0 + 12.0 / n),
    "zero2": ("zero2", ("strategy.reduce_bucket_size=50000",), lambda n: 4.0 + 16.0 / n),
    "zero2-default": ("zero2", (), lambda n: 4.0 + 16.0 / n),
    "zero3": ("zero3", (), lambda n: 20.0 / n),
}
FORMULAS = {
    "ddp": "16psi", "fsdp": "16psi/N", "fsdp1": "16psi/N", "zero1": "8psi+12psi/N",
    "zero2": "4psi+16psi/N", "zero2-default": "4psi+16psi/N", "zero3": "20psi/N",
}  # fmt: skip


def run(row: str, nproc: int, steps: int, workdir: Path) -> dict:
    strategy, sets, _ = ROWS[row]
    out = workdir / f"{row}-{nproc}"
    extra = [arg for s in sets for arg in ("--set", s)]
    cmd = [
        sys.executable, "-m", "acc_train_cli",
        "--strategy", strategy, *extra, "--num-processes", str(nproc), "--max-steps", str(steps),
        "--output-dir", str(out), "--overwrite", "--micro-batch-size", "4",
        "--set", "training.progress_bar=false", "--set", "training.mixed_precision=no",
        "--set", "data.eval_fraction=0", "--set", "checkpoint.every=0",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((out / "run.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()

    rows, raw = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.world_sizes:
            for strategy in args.strategies:
                summary = run(strategy, n, args.steps, Path(tmp))
                raw.append(summary)
                psi = summary["model_parameters"]
                predicted = ROWS[strategy][2](n) * psi
                per_rank = summary["per_rank"]
                if per_rank[0]["model_state_bytes"] is None:
                    print(f"skipped: {strategy} does not report model-state bytes yet", file=sys.stderr)
                    continue
                held = [sum(r["model_state_bytes"][k] for k in ("params", "grads", "optimizer")) for r in per_rank]
                parts = {k: statistics.fmean(r["model_state_bytes"][k] for r in per_rank) for k in ("params", "grads", "optimizer")}
                rows.append(
                    (
                        strategy, n, summary["distributed_type"].split(".")[-1], psi,
                        parts["params"], parts["grads"], parts["optimizer"], statistics.fmean(held), predicted,
                        statistics.fmean(held) / predicted, max(r["peak_memory_bytes"] for r in per_rank),
                        summary["step_time_median_s"],
                    )
                )  # fmt: skip
                print(f"done: {strategy} x{n}", file=sys.stderr, flush=True)

    kib = 1024
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; demo model, fp32, AdamW, {args.steps} steps")
    header = ("strategy", "N", "type", "psi", "params KiB", "grads KiB", "optim KiB", "held KiB", "formula", "formula KiB", "held/formula", "peak RSS MiB", "step ms", "step/DDP")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    ddp_step = {r[1]: r[11] for r in rows if r[0] == "ddp"}
    for r in rows:
        ratio = f"{r[11] / ddp_step[r[1]]:.2f}" if r[1] in ddp_step else "-"
        print(
            f"{r[0]} | {r[1]} | {r[2]} | {r[3]:,} | {r[4] / kib:,.0f} | {r[5] / kib:,.0f} | {r[6] / kib:,.0f} | "
            f"{r[7] / kib:,.0f} | {FORMULAS[r[0]]} | {r[8] / kib:,.0f} | {r[9]:.3f} | {r[10] / 2**20:,.0f} | {r[11] * 1000:.0f} | {ratio}"
        )
    ddp = {r[1]: r[7] for r in rows if r[0] == "ddp"}
    for r in rows:
        if r[0] != "ddp" and r[1] in ddp:
            print(f"{r[0]} x{r[1]}: model state per rank = {r[7] / ddp[r[1]]:.3f} of DDP's (1/N = {1 / r[1]:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
