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

``--context-parallel`` adds the rows of context parallelism (``strategy.cp``, torch's ring
attention through Accelerate; CUDA only, refused on CPU): FSDP2 without cp against cp = 2 and
cp = all GPUs, the same global batch (the micro-batch times cp), on text that is one long
document (so no row holds an example start, whose mask cp would drop: the arithmetic is the
same), in fp32 for the losses (max |difference| per step against no cp) and in bf16 at
``--cp-seq-len`` for tokens/s and peak memory. CP needs 2 or more GPUs (one GPU is a world of
one: nothing to cut a row over); with fewer the rows are skipped with the reason printed.

``--mesh replicate=2 tp=2 shard=4,tp=2`` adds FSDP2 over those meshes (HSDP, tensor parallelism,
FSDP x TP; names as in ``acc-train plan --mesh``) to the table, each against DDP; a mesh that does
not fit the GPUs is skipped with acc-train's reason. The micro-batch is per data-parallel rank
(a tp group reads one batch), and tokens/s counts each batch once.
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
    parser.add_argument(
        "--mesh", nargs="*", default=[], metavar="DIMS",
        help="also FSDP2 over these meshes, named as in `acc-train plan --mesh`: e.g. replicate=2 tp=2 shard=4,tp=2 (skipped when they do not fit the GPUs)",
    )  # fmt: skip
    parser.add_argument("--context-parallel", action="store_true", help="also run the context-parallel rows (strategy.cp; 2+ GPUs)")
    parser.add_argument("--cp-only", action="store_true", help="run only the context-parallel rows")
    parser.add_argument("--cp-seq-len", type=int, default=8192, help="sequence length of the cp throughput rows")
    parser.add_argument("--cp-steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs CUDA GPUs; bench/bench_memory.py is its CPU counterpart")
    if args.context_parallel or args.cp_only:
        context_parallel_rows(args)
        if args.cp_only:
            return

    settings = {"off": [False], "on": [True], "both": [False, True]}[args.gradient_checkpointing]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(s, s, []) for s in args.strategies] + [(f"fsdp[{m}]", "fsdp", mesh_sets(m)) for m in args.mesh]
        for (name, strategy, mesh), checkpointing in ((r, c) for r in runs for c in settings):
            label = name + (" +gc" if checkpointing else "")
            out = Path(tmp) / f"run{len(rows)}"
            extra = [*mesh, "--set", f"training.gradient_checkpointing={str(checkpointing).lower()}"]
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
            if proc.returncode == 2 and mesh:  # refused before launch (a mesh that does not fit these GPUs): say why, go on
                print(f"{label}: skipped: {proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else 'exit 2'}")
                continue
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


#: ``acc-train plan --mesh`` names -> the fsdp strategy's options
MESH_OPTIONS = {"replicate": "dp_replicate", "shard": "dp_shard", "tp": "tp", "cp": "cp"}


def mesh_sets(dims: str) -> list[str]:
    """``shard=4,tp=2`` -> ``--set strategy.dp_shard=4 --set strategy.tp=2``."""
    out: list[str] = []
    for part in dims.split(","):
        name, _, size = part.partition("=")
        if name.strip() not in MESH_OPTIONS or not size.strip().isdigit():
            sys.exit(f"--mesh {dims!r}: give NAME=SIZE pairs, NAME one of {', '.join(MESH_OPTIONS)}")
        out += ["--set", f"strategy.{MESH_OPTIONS[name.strip()]}={int(size)}"]
    return out


def _train(out: Path, *args: str) -> dict:
    """One acc-train run into ``out``; its run.json, with the per-step losses of metrics.jsonl."""
    cmd = [
        sys.executable, "-m", "acc_train_cli", "--output-dir", str(out),
        "--set", "checkpoint.every=0", "--set", "training.progress_bar=false", "--set", "data.eval_fraction=0",
        "--set", "training.log_every=1", *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise RuntimeError(f"{out.name} failed (exit {proc.returncode})")
    summary = json.loads((out / "run.json").read_text())
    lines = (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip())
    summary["losses"] = {m["step"]: m["loss"] for m in lines if m.get("loss") is not None}
    return summary


def _one_document(path: Path, max_bytes: int) -> Path:
    """The standard library's source as ONE text document (jsonl): rows cut from it hold no
    example start, so attention is plain causal over every row with or without cp."""
    import sysconfig

    parts, size = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    path.write_text(json.dumps({"text": "".join(parts)}) + "\n")
    return path


def context_parallel_rows(args: argparse.Namespace) -> None:
    """FSDP2 without cp against cp = 2 and cp = all GPUs (module docstring)."""
    n = args.num_processes
    if n < 2:
        print(f"context parallelism: skipped, it needs 2 or more GPUs (cp cuts each row over cp processes, one per GPU); this run has {n}")
        return
    sizes = sorted({c for c in (2, n) if n % c == 0})
    small = "{hidden_size: 512, intermediate_size: 1376, num_hidden_layers: 4, num_attention_heads: 8, num_key_value_heads: 8}"
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        data = _one_document(Path(tmp) / "one_document.jsonl", 40_000_000)
        base = ["--strategy", "fsdp", "--num-processes", str(n), "--set", f"data.train_files=[{data}]", "--set", "data.shuffle=false"]
        for kind, seq, steps, precision, model in (
            ("fp32 losses", 1024, 20, "no", small),
            ("bf16 throughput", args.cp_seq_len, args.cp_steps, "bf16", MODEL_1B),
        ):
            for cp in (1, *sizes):
                label = f"{kind}: fsdp" + (f" cp={cp}" if cp > 1 else "")
                extra = ["--set", f"strategy.cp={cp}"] if cp > 1 else []
                try:
                    s = _train(
                        Path(tmp) / f"{kind.split()[0]}-cp{cp}", *base, *extra,
                        "--micro-batch-size", str(cp), "--max-steps", str(steps), "--mixed-precision", precision,
                        "--set", f"model.config={model}", "--set", f"data.seq_len={seq}",
                    )  # fmt: skip
                except RuntimeError as exc:
                    print(f"{label}: {exc}")
                    continue
                curves[(kind, cp)] = s["losses"]
                rows.append((label, s["world_size"], seq, s["tokens_per_s"], max(r["peak_memory_bytes"] for r in s["per_rank"]), s["final_loss"], s.get("mesh")))
    print(f"context parallelism, {n} x {torch_device_name()}, global batch of cp x {n} // cp = {n} rows")
    print("run | processes | seq_len | tokens/s | peak GiB/rank | final loss | mesh")
    print("--- | --- | --- | --- | --- | --- | ---")
    for r in rows:
        mesh = (r[6] or {}).get("shape")
        print(f"{r[0]} | {r[1]} | {r[2]} | {r[3]:,.0f} | {r[4] / 2**30:.2f} | {r[5]:.4f} | {mesh}")
    for (kind, cp), losses in curves.items():
        reference = curves.get((kind, 1))
        if cp > 1 and reference:
            diff = max(abs(losses[k] - reference[k]) for k in reference if k in losses)
            print(f"{kind}: cp={cp} against no cp, max |loss difference| over {len(reference)} steps: {diff:.2e}")


def torch_device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    main()
