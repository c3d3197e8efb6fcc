"""FSDP2 and DeepSpeed ZeRO-3 against DDP on the GPUs of one machine: tokens/s and peak memory,
~1B parameters, bf16.

One command on a machine with CUDA GPUs and acc-train installed (with the FSDP and DeepSpeed
strategies):

    python bench/gpu_fsdp_vs_ddp.py            # all GPUs; --num-processes N to choose

Trains the demo Llama scaled to about 1.1B parameters (byte-level text of the standard
library, nothing downloaded) for --steps steps under each strategy and prints a short table.
On one GPU FSDP has nothing to shard across, so expect equal memory there; the saving grows
with the number of GPUs (model state ~16 psi / N instead of 16 psi).

``--gradient-checkpointing on`` runs every strategy with ``training.gradient_checkpointing``;
``both`` runs each without and with it, side by side, and prints the peak-memory and tokens/s
ratios of checkpointing per strategy (peak memory is ``torch.cuda.max_memory_allocated``).
``--attn-implementation`` sets ``model.attn_implementation`` (e.g. flash_attention_2).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL_1B = "{hidden_size: 2048, intermediate_size: 5504, num_hidden_layers: 20, num_attention_heads: 16, num_key_value_heads: 16}"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=torch.cuda.device_count())
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--gradient-checkpointing", choices=("off", "on", "both"), default="off")
    parser.add_argument("--attn-implementation", help="model.attn_implementation (default: transformers' choice, sdpa)")
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp", "zero3"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs CUDA GPUs; bench/bench_memory.py is its CPU counterpart")

    settings = {"off": [False], "on": [True], "both": [False, True]}[args.gradient_checkpointing]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, checkpointing in ((s, c) for s in args.strategies for c in settings):
            label = strategy + (" +gc" if checkpointing else "")
            out = Path(tmp) / label.replace(" +", "-")
            extra = ["--set", f"training.gradient_checkpointing={str(checkpointing).lower()}"]
            if args.attn_implementation:
                extra += ["--set", f"model.attn_implementation={args.attn_implementation}"]
            cmd = [
                sys.executable, "-m", "acc_train_cli", "--strategy", strategy,
                "--num-processes", str(args.num_processes), "--max-steps", str(args.steps),
                "--micro-batch-size", str(args.micro_batch_size), "--mixed-precision", "bf16",
                "--output-dir", str(out), "--set", f"model.config={MODEL_1B}",
                "--set", f"data.seq_len={args.seq_len}", "--set", "data.demo_max_bytes=20000000",
                "--set", "checkpoint.every=0", "--set", "training.progress_bar=false",
                "--set", "data.eval_fraction=0", *extra,
            ]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                sys.exit(f"{label} failed")
            s = json.loads((out / "run.json").read_text())
            rows.append((label, s["distributed_type"], s["model_parameters"], s["tokens_per_s"], s["step_time_median_s"], max(r["peak_memory_bytes"] for r in s["per_rank"]), s["final_loss"]))

    print(f"GPUs: {args.num_processes} x {torch.cuda.get_device_name(0)}, bf16, micro-batch {args.micro_batch_size} x {args.seq_len} tokens, {args.steps} steps")
    print("strategy | type | params | tokens/s | step s (median) | peak GiB/rank | final loss")
    print("--- | --- | --- | --- | --- | --- | ---")
    for r in rows:
        print(f"{r[0]} | {r[1].split('.')[-1]} | {r[2] / 1e9:.2f}B | {r[3]:,.0f} | {r[4]:.3f} | {r[5] / 2**30:.1f} | {r[6]:.3f}")
    by_label = {r[0]: r for r in rows}
    for r in rows:  # each strategy against DDP with the same checkpointing
        strategy, _, suffix = r[0].partition(" ")
        base = by_label.get(f"ddp {suffix}".strip())
        if strategy != "ddp" and base is not None:
            print(f"{r[0]}/{base[0]}: tokens/s {r[3] / base[3]:.3f}, peak memory {r[5] / base[5]:.3f}")
    for r in rows:
        plain = by_label.get(r[0].removesuffix(" +gc"))
        if r[0].endswith(" +gc") and plain is not None:
            print(f"{r[0]} against {plain[0]}: peak memory {r[5] / plain[5]:.3f}, tokens/s {r[3] / plain[3]:.3f}")


if __name__ == "__main__":
    main()
