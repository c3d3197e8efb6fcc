"""Peak memory and step time of gradient checkpointing (``training.gradient_checkpointing``)
under DDP, FSDP2 and ZeRO-3, side by side with it off, on CPU.

Each round trains the demo Llama, deepened to ``--layers`` layers, through ``acc-train`` on 2
CPU processes (fp32, micro-batch ``--micro-batch`` x ``--seq-len`` tokens, ``--steps`` steps)
three ways per strategy: checkpointing off, on, and a *baseline* with the same job at
``--base-seq-len`` tokens, whose activations are negligible. Rounds alternate the order of off
and on. From each run's ``run.json``:

- peak memory: each rank's peak resident set size (``VmHWM``, read after the last step), the
  larger rank. RSS counts everything the process holds: the interpreter and libraries, the data,
  the model state, and what the allocator keeps. To make it follow the tensors that are alive,
  the runs set glibc's ``MALLOC_MMAP_THRESHOLD_`` (default 64 KiB, ``--mmap-threshold 0`` leaves
  glibc's default): every allocation above it is its own mapping, returned to the system when
  the tensor is freed, so freed activations are not counted again as cached heap. The
  *activation peak* is the peak RSS less the baseline's (same model, strategy and libraries), and
  the ratio on/off of that is the reduction checkpointing gives. It still includes what scales
  with the sequence besides stored activations (logits, the loss, one layer's recompute).
- step time: the median of the loop's step span (``step_time_median_s``; the same span for both).
- ``acc-train plan``'s activation estimate for the same job, off and on, for comparison.

Usage: python bench/bench_checkpointing.py [--strategies ddp fsdp zero3] [--rounds 2] [--json FILE]
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

STRATEGIES = {"ddp": "ddp", "fsdp2": "fsdp", "zero3": "zero3"}


def job_args(args: argparse.Namespace, seq_len: int) -> list[str]:
    model = (
        f"model.config={{num_hidden_layers: {args.layers}, max_position_embeddings: {max(seq_len, args.seq_len)}}}"
    )
    return [
        "--num-processes", "2", "--micro-batch-size", str(args.micro_batch), "--mixed-precision", "no",
        "--set", model, "--set", f"data.seq_len={seq_len}", "--set", "data.eval_fraction=0",
        "--set", "checkpoint.every=0", "--set", "training.progress_bar=false",
    ]  # fmt: skip


def run(strategy: str, checkpointing: bool, seq_len: int, args: argparse.Namespace, out: Path) -> dict:
    env = dict(os.environ)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    cmd = [
        sys.executable, "-m", "acc_train_cli", "--strategy", strategy, *job_args(args, seq_len),
        "--max-steps", str(args.steps), "--output-dir", str(out), "--overwrite",
        "--set", f"training.gradient_checkpointing={str(checkpointing).lower()}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "run.json").read_text())


def planned_activations(strategy: str, checkpointing: bool, args: argparse.Namespace) -> int | None:
    cmd = [
        sys.executable, "-m", "acc_train_cli", "--strategy", strategy, "plan", "--json", *job_args(args, args.seq_len),
        "--set", f"training.gradient_checkpointing={str(checkpointing).lower()}",
    ]  # fmt: skip
    data = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return next(r["activations"] for r in data["rows"] if r["job"])


def print_table(results: dict[str, dict[str, list[dict]]], plans: dict[str, dict[str, int | None]], args: argparse.Namespace) -> None:
    """The results as a Markdown table: medians over the rounds."""
    mib = 2**20
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; "
          f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'glibc default'}")  # fmt: skip
    print(f"job: demo Llama with {args.layers} layers, fp32, 2 processes, micro-batch {args.micro_batch} x {args.seq_len} tokens, "
          f"{args.steps} steps, {args.rounds} rounds; baseline at {args.base_seq_len} tokens")  # fmt: skip
    head = ("strategy", "peak RSS off MiB", "peak RSS on MiB", "baseline MiB", "activation peak off MiB", "activation peak on MiB",
            "on/off (activation peak)", "on/off (peak RSS)", "plan off MiB", "plan on MiB", "step on/off", "final loss off - on")  # fmt: skip
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for name, r in results.items():
        off, on, base = (statistics.median(x["peak"] for x in r[k]) for k in ("off", "on", "base"))
        step = statistics.median(b["step_s"] / a["step_s"] for a, b in zip(r["off"], r["on"]))
        loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(r["off"], r["on"]))
        p = plans[name]
        print(f"{name} | {off / mib:,.0f} | {on / mib:,.0f} | {base / mib:,.0f} | {(off - base) / mib:,.0f} | {(on - base) / mib:,.0f} | "
              f"{(on - base) / (off - base):.3f} | {on / off:.3f} | {(p['off'] or 0) / mib:,.0f} | {(p['on'] or 0) / mib:,.0f} | "
              f"{step:.3f} | {loss:.1e}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--base-seq-len", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--mmap-threshold", type=int, default=65536, help="glibc MALLOC_MMAP_THRESHOLD_ for the runs; 0: glibc's default")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()

    results: dict[str, dict[str, list[dict]]] = {s: {"off": [], "on": [], "base": []} for s in args.strategies}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name in args.strategies:
                order = [("off", False), ("on", True)] if rnd % 2 == 0 else [("on", True), ("off", False)]
                for label, on in [*order, ("base", False)] if rnd == 0 else order:
                    seq = args.base_seq_len if label == "base" else args.seq_len
                    s = run(STRATEGIES[name], on, seq, args, Path(tmp) / f"{name}-{label}")
                    peaks = [r["peak_memory_bytes"] for r in s["per_rank"]]
                    results[name][label].append({"peak": max(peaks), "peaks": peaks, "step_s": s["step_time_median_s"], "loss": s["final_loss"],
                                                 "checkpointed": s.get("activation_checkpointing")})  # fmt: skip
                    print(f"round {rnd + 1} {name:6} {label:4} step {s['step_time_median_s'] * 1000:8.1f} ms  "
                          f"peak RSS per rank {'  '.join(f'{p / 2**20:7.1f}' for p in peaks)} MiB  final loss {s['final_loss']:.6f}",
                          flush=True)  # fmt: skip
        plans = {name: {label: planned_activations(STRATEGIES[name], on, args) for label, on in (("off", False), ("on", True))} for name in args.strategies}

    print()
    print_table(results, plans, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "plans": plans, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
