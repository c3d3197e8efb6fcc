"""Per-rank model-state bytes of FSDP2 over a mesh (HSDP, TP, FSDP x TP), measured, against ``acc-train plan``.

Each shape trains the demo Llama through ``acc-train`` on ``--processes`` CPU processes (fp32, 2
steps, no checkpoints) and reads ``run.json``'s ``per_rank[*].model_state_bytes`` (parameters,
gradients and optimizer state each rank holds, counted from the live tensors). The plan is
``acc-train plan --json --mesh ...`` for the same job: its row for that mesh (or the strategy's
own row for DDP and plain FSDP). The ratio measured/planned is reported per shape (the largest
rank), with the largest difference of its per-step losses from DDP's (and the largest relative
difference of its gradient norms: AdamW hides a constant gradient scale from the losses) (the same global batch in
every shape: 2 x ``--processes`` sequences, fp32); the shapes are run one after another in the same session. Tensor parallelism alone runs
on 2 processes (the demo model's 6 heads take tp = 2 or 3); HSDP x TP needs 8 (``--processes 8``).

Usage: python bench/bench_mesh.py [--processes 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from acc_train.outputs.metrics import read_metrics

#: label -> (acc-train arguments, the plan row's label (None: the --mesh row), --mesh for the plan, processes (None: --processes))
SHAPES = {
    "ddp": (["--strategy", "ddp"], "ddp", None, None),
    "fsdp2 (shard=N)": (["--strategy", "fsdp"], "fsdp2", None, None),
    "hsdp (replicate=2, shard=N/2)": (["--strategy", "fsdp", "--set", "strategy.dp_replicate=2"], None, "replicate=2", None),
    "tp (tp=2, 2 processes)": (["--strategy", "fsdp", "--set", "strategy.tp=2"], None, "tp=2", 2),
    "fsdp x tp (shard=N/2, tp=2)": (["--strategy", "fsdp", "--set", "strategy.tp=2"], None, "tp=2", None),
    "hsdp x tp (replicate=2, shard=N/4, tp=2)": (["--strategy", "fsdp", "--set", "strategy.dp_replicate=2", "--set", "strategy.tp=2"], None, "replicate=2,tp=2", 8),
}


def acc_train(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "acc_train_cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"acc-train {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows: list[dict] = []
    ddp_losses: list[float] = []
    ddp_norms: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, (strategy_args, plan_label, mesh, processes) in SHAPES.items():
            n = processes or args.processes
            if processes and processes > args.processes:
                print(f"skipped {label}: needs {processes} processes (--processes {processes})")
                continue
            replicas = 2 if "strategy.tp=2" in strategy_args else 1  # the ranks of a tp group read one batch
            micro = 2 * args.processes * replicas // n  # the same global batch (2 x --processes) in every shape
            common = ["--num-processes", str(n), "--mixed-precision", "no", "--max-steps", "3", "--set", "checkpoint.every=0",
                      "--set", "training.log_every=1", "--set", "training.progress_bar=false", "--micro-batch-size", str(micro)]  # fmt: skip
            out = Path(tmp) / f"{len(rows)}"
            acc_train(*common, *strategy_args, "--output-dir", str(out))
            ranks = json.loads((out / "run.json").read_text())["per_rank"]
            steps = read_metrics(out).steps
            losses = [steps[step]["loss"] for step in sorted(steps)]
            norms = [steps[step]["grad_norm"] for step in sorted(steps)]
            ddp_losses = ddp_losses if rows else losses
            ddp_norms = ddp_norms if rows else norms
            measured = max(sum(r["model_state_bytes"].values()) for r in ranks)
            plan_args = ["plan", "--json", "--num-processes", str(n), "--mixed-precision", "no"] + (["--mesh", mesh] if mesh else [])
            plan = json.loads(acc_train(*plan_args).stdout)
            if mesh:
                row = next(r for r in plan["rows"] if r["label"].startswith("fsdp2 mesh"))
            else:
                row = next(r for r in plan["rows"] if r["label"] == plan_label)
            rows.append({"shape": label, "processes": n, "row": row["label"], "measured": measured, "planned": row["model_state"], "ratio": measured / row["model_state"], "formula": row["formula"],
                         "loss_diff": max(abs(a - b) for a, b in zip(losses, ddp_losses, strict=True)),
                         "grad_norm_rel_diff": max(abs(a - b) / b for a, b in zip(norms, ddp_norms, strict=True))})
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}; demo Llama, CPU processes over gloo, fp32")
    print(f"{'shape':42} {'procs':>5} {'plan row':38} {'measured B':>12} {'planned B':>12} {'ratio':>6} {'|loss-ddp|':>10} {'grad norm':>10}  formula")
    for r in rows:
        print(f"{r['shape']:42} {r['processes']:5} {r['row']:38} {r['measured']:12,} {r['planned']:12,} {r['ratio']:6.3f} {r['loss_diff']:10.1e} {r['grad_norm_rel_diff']:10.1e}  {r['formula']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
