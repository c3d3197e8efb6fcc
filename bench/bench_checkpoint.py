"""Time the training loop is blocked per checkpoint save: synchronous against asynchronous
(``checkpoint.async_save``, torch.distributed.checkpoint's ``async_save``), side by side.

Each run trains a widened demo model on 2 CPU processes and saves every ``--every`` steps;
``run.json`` reports the seconds each save blocked the loop (``checkpoint_saves.blocked_s``,
rank 0: from the start of the save until the loop may go on; an asynchronous save blocks
only while its state is copied aside, and is committed when its writes finish). Rounds
alternate which mode goes first; medians over all saves are reported.

Usage: python bench/bench_checkpoint.py [--strategies ddp fsdp] [--rounds 2] [--steps 8] [--every 2]
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

#: about 25M parameters: a save of weights and Adam moments is ~300 MB, enough to time
MODEL = "model.config={hidden_size: 512, intermediate_size: 1408, num_hidden_layers: 6, num_attention_heads: 8, num_key_value_heads: 8}"


def run(strategy: str, mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / f"{strategy}-{mode}"
    cmd = [
        sys.executable, "-m", "acc_train_cli",
        "--strategy", strategy, "--num-processes", "2", "--max-steps", str(args.steps),
        "--output-dir", str(out), "--overwrite", "--micro-batch-size", "2",
        "--set", MODEL, "--set", "data.seq_len=64", "--set", "data.demo_max_bytes=400000",
        "--set", "training.progress_bar=false", "--set", "training.mixed_precision=no",
        "--set", "data.eval_fraction=0", "--set", f"checkpoint.every={args.every}", "--set", "checkpoint.keep_last=1",
        "--set", f"checkpoint.async_save={'true' if mode == 'async' else 'false'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{strategy} {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "run.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    args = parser.parse_args()

    blocked: dict[tuple[str, str], list[float]] = {}
    steps: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for strategy in args.strategies:
                for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
                    s = run(strategy, mode, args, Path(tmp))
                    blocked.setdefault((strategy, mode), []).extend(s["checkpoint_saves"]["blocked_s"])
                    steps.setdefault((strategy, mode), []).append(s["step_time_median_s"])
                    print(f"round {r + 1} {strategy:5s} {mode:5s} blocked per save {[round(b * 1000) for b in s['checkpoint_saves']['blocked_s']]} ms", flush=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"job: demo model widened to ~{s['model_parameters'] / 1e6:.1f}M parameters, 2 processes, {args.steps} steps, a save every {args.every}")
    print("strategy | mode | saves | median blocked ms | median step ms")
    print("--- | --- | --- | --- | ---")
    for (strategy, mode), values in blocked.items():
        print(f"{strategy} | {mode} | {len(values)} | {statistics.median(values) * 1000:.0f} | {statistics.median(steps[(strategy, mode)]) * 1000:.0f}")
    for strategy in args.strategies:
        ratio = statistics.median(blocked[(strategy, "async")]) / statistics.median(blocked[(strategy, "sync")])
        print(f"{strategy}: blocked per save, async / sync = {ratio:.3f}")


if __name__ == "__main__":
    main()
