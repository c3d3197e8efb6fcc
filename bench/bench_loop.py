"""acc-train's loop against a hand-written Accelerate loop: same job, alternating runs.

Each round runs the demo model for ``--steps`` steps under DDP on ``--num-processes`` ranks,
once through ``acc-train`` and once through ``bench/handwritten_loop.py`` (plain torchrun +
Accelerate), in alternating order. Both time each optimizer step the same way (wall clock
between step ends, the first 3 steps left out; each run reports its median step) and report
peak memory per rank (RSS on CPU, ``max_memory_allocated`` on GPU). Prints a table and the
ratio of step times: the median over rounds, and the best round of each.

Usage: python bench/bench_loop.py [--rounds 3] [--steps 60] [--num-processes 2] [--json out.json]
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

HERE = Path(__file__).resolve().parent


def run_acc_train(steps: int, nproc: int, workdir: Path) -> dict:
    out = workdir / "acc"
    cmd = [
        sys.executable, "-m", "acc_train_cli",
        "--strategy", "ddp", "--num-processes", str(nproc), "--max-steps", str(steps),
        "--output-dir", str(out), "--overwrite",
        "--set", "training.progress_bar=false", "--set", "training.mixed_precision=no",
        "--set", "data.eval_fraction=0", "--set", "checkpoint.every=0",
        "--set", f"scheduler.warmup_steps={steps // 10}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    summary = json.loads((out / "run.json").read_text())
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    return {"step_time_s": summary["step_time_median_s"], "peak": max(r["peak_memory_bytes"] for r in summary["per_rank"]), "losses": losses}


def run_handwritten(steps: int, nproc: int, workdir: Path) -> dict:
    out = workdir / "hw.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(HERE / "handwritten_loop.py"), "--steps", str(steps), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "ACCELERATE_USE_CPU": "1"} if not _cuda() else None)
    data = json.loads(out.read_text())
    return {"step_time_s": data["step_time_s"], "peak": max(r["peak_memory_bytes"] for r in data["per_rank"]), "losses": data["losses"]}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.num_processes)))

    results: dict[str, list[dict]] = {"acc-train": [], "handwritten": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ["acc-train", "handwritten"] if i % 2 == 0 else ["handwritten", "acc-train"]
            for name in order:
                fn = run_acc_train if name == "acc-train" else run_handwritten
                r = fn(args.steps, args.num_processes, Path(tmp))
                results[name].append(r)
                print(f"round {i + 1} {name:12s} step {r['step_time_s'] * 1000:8.2f} ms  peak {r['peak'] / 2**20:8.1f} MiB", flush=True)

    acc = statistics.median(r["step_time_s"] for r in results["acc-train"])
    hw = statistics.median(r["step_time_s"] for r in results["handwritten"])
    acc_best = min(r["step_time_s"] for r in results["acc-train"])
    hw_best = min(r["step_time_s"] for r in results["handwritten"])
    acc_mem = statistics.median(r["peak"] for r in results["acc-train"])
    hw_mem = statistics.median(r["peak"] for r in results["handwritten"])
    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, cuda={_cuda()}")
    print(f"job: demo model, DDP, {args.num_processes} processes, {args.steps} steps, {args.rounds} alternating rounds (medians)")
    print(f"{'loop':12s} {'step time':>12s} {'peak mem/rank':>15s}")
    print(f"{'acc-train':12s} {acc * 1000:10.2f}ms {acc_mem / 2**20:12.1f}MiB")
    print(f"{'handwritten':12s} {hw * 1000:10.2f}ms {hw_mem / 2**20:12.1f}MiB")
    print(f"step-time ratio acc-train/handwritten: {acc / hw:.4f} (median of rounds), {acc_best / hw_best:.4f} (best round)")
    print(f"peak-memory ratio: {acc_mem / hw_mem:.4f} ({(acc_mem - hw_mem) / 2**20:+.1f} MiB per rank)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
