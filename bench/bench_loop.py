"""acc-train's loop against hand-written loops of the same strategy: DDP, FSDP2 and ZeRO-3.

For each strategy and round, the demo job runs for ``--steps`` steps on ``--num-processes``
ranks once through ``acc-train --strategy S`` and once through ``bench/handwritten_loop.py
--strategy S`` (plain torchrun; torch DDP, a raw ``fully_shard`` loop, or a raw
``deepspeed.initialize`` loop; no Accelerate), alternating which goes first. Both sides time
whole iterations (from the end of one step to the end of the next, the first 3 steps left
out; acc-train's span is documented in ``acc_train.loop.loop``) and report the median step of
the run, and each rank's peak memory (RSS on CPU, ``max_memory_allocated`` on GPU). The two
sides train the same model on the same batches, so their logged losses must agree: the largest
difference is printed.

Prints each run, then per strategy the median over rounds: step time of each side and their
ratio (also the median of the per-round ratios, which cancels drift in the machine's load),
and peak RSS per rank (the larger rank's) of each side and their difference.

Usage: python bench/bench_loop.py [--strategies ddp,fsdp,zero3] [--rounds 3] [--steps 60]
       [--num-processes 2] [--json out.json]
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STRATEGIES = ("ddp", "fsdp", "zero3")


def run_acc_train(strategy: str, steps: int, nproc: int, workdir: Path) -> dict:
    from acc_train.metrics import read_metrics

    out = workdir / f"acc-{strategy}"
    cmd = [
        sys.executable, "-m", "acc_train_cli",
        "--strategy", strategy, "--num-processes", str(nproc), "--max-steps", str(steps),
        "--output-dir", str(out), "--overwrite",
        "--set", "training.progress_bar=false", "--set", "training.mixed_precision=no",
        "--set", "data.eval_fraction=0", "--set", "checkpoint.every=0",
        "--set", f"scheduler.warmup_steps={-(-steps // 10)}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"acc-train {strategy} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    summary = json.loads((out / "run.json").read_text())
    losses = [row.loss for row in read_metrics(out).training]
    return {"step_time_s": summary["step_time_median_s"], "peaks": [r["peak_memory_bytes"] for r in summary["per_rank"]], "losses": losses}


def run_handwritten(strategy: str, steps: int, nproc: int, workdir: Path) -> dict:
    out = workdir / f"hw-{strategy}.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(HERE / "handwritten_loop.py"), "--strategy", strategy, "--steps", str(steps), "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "ACCELERATE_USE_CPU": "1"} if not _cuda() else None)
    if proc.returncode != 0:
        raise SystemExit(f"the hand-written {strategy} loop failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    data = json.loads(out.read_text())
    return {"step_time_s": data["step_time_s"], "peaks": [r["peak_memory_bytes"] for r in data["per_rank"]], "losses": data["losses"]}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _mib(n: float) -> float:
    return n / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.num_processes)))

    results: dict[str, dict[str, list[dict]]] = {s: {"acc-train": [], "handwritten": []} for s in strategies}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for strategy in strategies:  # interleaved: every strategy in every round
                order = ["acc-train", "handwritten"] if i % 2 == 0 else ["handwritten", "acc-train"]
                for side in order:
                    fn = run_acc_train if side == "acc-train" else run_handwritten
                    r = fn(strategy, args.steps, args.num_processes, Path(tmp))
                    results[strategy][side].append(r)
                    peaks = " ".join(f"{_mib(p):6.1f}" for p in r["peaks"])
                    print(f"round {i + 1} {strategy:6s} {side:12s} step {r['step_time_s'] * 1000:8.2f} ms  peak RSS per rank {peaks} MiB", flush=True)

    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, cuda={_cuda()}")
    print(
        f"job: demo model, fp32, {args.num_processes} processes, {args.steps} steps, {args.rounds} rounds "
        f"(strategies interleaved, sides alternating), {(time.time() - started) / 60:.1f} min"
    )
    print("strategy | acc-train step ms | handwritten step ms | ratio of medians | median of round ratios | round ratios min-max | acc-train peak MiB | handwritten peak MiB | peak diff MiB | max |loss diff|")
    print(" | ".join(["---"] * 10))
    for strategy in strategies:
        acc, hw = results[strategy]["acc-train"], results[strategy]["handwritten"]
        acc_t = statistics.median(r["step_time_s"] for r in acc)
        hw_t = statistics.median(r["step_time_s"] for r in hw)
        ratios = [a["step_time_s"] / h["step_time_s"] for a, h in zip(acc, hw)]
        acc_m = statistics.median(max(r["peaks"]) for r in acc)
        hw_m = statistics.median(max(r["peaks"]) for r in hw)
        loss_diff = max(abs(x - y) for a, h in zip(acc, hw) for x, y in zip(a["losses"], h["losses"]))
        print(
            f"{strategy} | {acc_t * 1000:.1f} | {hw_t * 1000:.1f} | {acc_t / hw_t:.3f} | {statistics.median(ratios):.3f} | "
            f"{min(ratios):.3f}-{max(ratios):.3f} | {_mib(acc_m):.1f} | {_mib(hw_m):.1f} | {_mib(acc_m - hw_m):+.1f} | {loss_diff:.1e}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
