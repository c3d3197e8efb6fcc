"""Step time of ``training.compile`` (torch.compile through Accelerate) against eager, side by
side, under DDP and FSDP2.

Each round trains the same job through ``acc-train`` twice per strategy, eager and compiled
(``training.compile.backend``, inductor by default), alternating which goes first. The demo
Llama (``--layers`` layers, hidden ``--hidden``), fp32 unless ``--mixed-precision`` says
otherwise, ``--processes`` processes, micro-batch ``--micro-batch`` x ``--seq-len`` tokens,
``--steps`` steps, no evaluation and no checkpoint saves, so every step is a training step.

What is timed, the same span on both sides: each step's duration from ``metrics.jsonl``
(consecutive ``elapsed_s``, the loop's own clock around a whole optimizer step: data, forward,
backward, optimizer, logging), the median over the steps after the first ``--warmup`` ones. The
warm-up steps hold the compiled side's compile (dynamo, AOTAutograd, inductor's C++ build) and
its recompiles; their extra time is reported apart as *compile s* (the warm-up steps' sum less
``--warmup`` median steps). The ratio is compiled / eager of the median step, the median over
rounds; the losses of the two sides are compared too (inductor fuses kernels, so they differ by
rounding, not more).

Runs on a GPU machine as it is: acc-train then starts one process per GPU (``--processes``).

Usage: python bench/bench_compile.py [--strategies ddp fsdp2] [--rounds 2] [--backend inductor] [--json FILE]
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

STRATEGIES = ("ddp", "fsdp2")


def job_args(args: argparse.Namespace) -> list[str]:
    heads = args.heads or (6 if args.hidden % 6 == 0 else max(1, args.hidden // 64))  # the demo's 6 where they divide
    model = (
        f"model.config={{num_hidden_layers: {args.layers}, hidden_size: {args.hidden}, intermediate_size: {args.hidden * 8 // 3}, "
        f"num_attention_heads: {heads}, num_key_value_heads: {heads}, max_position_embeddings: {args.seq_len}}}"
    )
    return [
        "--micro-batch-size", str(args.micro_batch), "--mixed-precision", args.mixed_precision,
        "--set", model, "--set", f"data.seq_len={args.seq_len}", "--set", "data.eval_fraction=0",
        "--set", "checkpoint.every=0", "--set", "training.progress_bar=false", "--max-steps", str(args.steps),
        *(["--num-processes", str(args.processes)] if args.processes else []),
    ]  # fmt: skip


def run(strategy: str, compiled: bool, args: argparse.Namespace, out: Path) -> dict:
    compile_sets = ["--set", f"training.compile={{enabled: true, backend: {args.backend}, mode: {args.mode}}}"] if compiled else []
    cmd = [sys.executable, "-m", "acc_train_cli", "--strategy", strategy, *job_args(args), "--output-dir", str(out), "--overwrite", *compile_sets]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "run.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in rows if "loss" in r and r.get("step")]
    steps = [b - a for a, b in zip(elapsed, elapsed[1:])]  # step 2 onwards; step 1 includes the loop's start
    first = elapsed[0]
    warm, timed = steps[: args.warmup - 1], steps[args.warmup - 1 :]
    median = statistics.median(timed)
    return {
        "step_s": median,
        "compile_s": first + sum(warm) - args.warmup * median,
        "loss": summary["final_loss"],
        "compile": summary["compile"],
        "tokens_per_s": summary["tokens_per_s"],
    }


def print_table(results: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> None:
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"job: demo Llama {args.layers} layers, hidden {args.hidden}, {args.mixed_precision} mixed precision, "
          f"{args.processes or 'default'} processes, micro-batch {args.micro_batch} x {args.seq_len} tokens, {args.steps} steps "
          f"({args.warmup} warm-up), {args.rounds} rounds; compiled: backend {args.backend}, mode {args.mode}")  # fmt: skip
    head = ("strategy", "eager step ms", "compiled step ms", "compiled / eager", "compile s", "graphs", "graph breaks", "final loss eager - compiled")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for name, r in results.items():
        eager, comp = (statistics.median(x["step_s"] for x in r[k]) for k in ("eager", "compiled"))
        ratio = statistics.median(b["step_s"] / a["step_s"] for a, b in zip(r["eager"], r["compiled"]))
        compile_s = statistics.median(x["compile_s"] for x in r["compiled"])
        loss = max(abs(a["loss"] - b["loss"]) for a, b in zip(r["eager"], r["compiled"]))
        c = r["compiled"][-1]["compile"]
        print(f"{name} | {eager * 1000:,.1f} | {comp * 1000:,.1f} | {ratio:.3f} | {compile_s:,.1f} | {c.get('graphs')} | {c.get('graph_breaks')} | {loss:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median (the compile and its recompiles)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--heads", type=int, default=None, help="attention heads; default 6 (the demo's), or hidden/64 where 6 does not divide")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--processes", type=int, default=2, help="0: acc-train's default (one per GPU)")
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16", "auto"])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--mode", default="default")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    if args.warmup < 2 or args.steps < args.warmup + 3:
        parser.error("--warmup must be at least 2 and --steps at least --warmup + 3")

    results: dict[str, dict[str, list[dict]]] = {s: {"eager": [], "compiled": []} for s in args.strategies}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name in args.strategies:
                order = [("eager", False), ("compiled", True)] if rnd % 2 == 0 else [("compiled", True), ("eager", False)]
                for label, compiled in order:
                    r = run(name, compiled, args, Path(tmp) / f"{name}-{label}")
                    results[name][label].append(r)
                    print(f"round {rnd + 1} {name:6} {label:8} step {r['step_s'] * 1000:8.1f} ms  compile {r['compile_s']:6.1f} s  "
                          f"final loss {r['loss']:.6f}  compile {r['compile']}", flush=True)  # fmt: skip
    print()
    print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
