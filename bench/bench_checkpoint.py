"""Time the training loop is blocked per checkpoint save: synchronous against asynchronous
(``checkpoint.async_save``, torch.distributed.checkpoint's ``async_save``), side by side; and,
with ``--verify``, the time a save spends verifying against the time it spends writing.

Each run trains a widened demo model on 2 CPU processes and saves every ``--every`` steps;
``run.json`` reports the seconds each save blocked the loop (``checkpoint_saves.blocked_s``,
rank 0: from the start of the save until the loop may go on; an asynchronous save blocks
only while its state is copied aside, and is committed when its writes finish). Rounds
alternate which mode goes first; medians over all saves are reported.

``--verify``: a plain state of ``--gb`` GB (a stack of linear layers: fp32 weights and AdamW's
two moments) saved ``--saves`` times on 2 gloo ranks by ``CheckpointManager`` in the ``dcp``
format (all kept: ``--saves`` x ``--gb`` GB of disk per run), once with the acc-train under ``--before`` (another checkout's ``packages/core/src``,
e.g. main's) and once with this checkout's, rounds alternating which goes first. Per save,
rank 0 reports the **write** span (the format's ``save`` until every rank has returned from it:
a barrier is added after it, the same on both sides) and the **verify** span (from there until
the save returns: RNG and trainer-state files, hashing, the ranks' barriers, manifest
assembly, rename and ``latest``), and verify / write. Hashing done while the state is written
(this checkout's ``StreamHashes``) is inside the write span: the last column, the whole save,
shows what it costs there.

Usage: python bench/bench_checkpoint.py [--strategies ddp fsdp] [--rounds 2] [--steps 8] [--every 2]
       python bench/bench_checkpoint.py --verify --before /work/main [--gb 1.0] [--saves 3] [--rounds 2]
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


def verify_worker(args: argparse.Namespace) -> None:
    """One rank of ``--verify`` (under torch.distributed.run): build the state, save it."""
    import time

    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    from acc_train.checkpoint import CheckpointManager, DCPFormat, TrainerState

    marks: dict[str, float] = {}

    class TimedDCP(DCPFormat):
        def save(self, accelerator, model, optimizer, directory):  # type: ignore[no-untyped-def]
            marks["write_start"] = time.perf_counter()
            super().save(accelerator, model, optimizer, directory)
            dist.barrier()  # every rank's state is on disk
            marks["write_end"] = time.perf_counter()

    class NoSchedule:
        def state_dict(self) -> dict:
            return {}

    acc = Accelerator(cpu=True)
    params = int(args.gb * 1e9 / 12)  # fp32 weight + exp_avg + exp_avg_sq
    layers = 8
    dim = int((params / layers) ** 0.5) + 1
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # the moments exist, with random content
    for p in model.parameters():
        p.grad = None
    # keep_last=None: deleting an old checkpoint (inside the commit) is not verification
    manager = CheckpointManager(acc, Path(args.out), TimedDCP(), keep_last=None, manifest_extra={}, data_signature={}, seed=0)
    rows = []
    for i in range(args.saves):
        acc.wait_for_everyone()
        manager.save(model, optimizer, NoSchedule(), TrainerState(step=i + 1))
        end = time.perf_counter()
        rows.append({"write_s": marks["write_end"] - marks["write_start"], "verify_s": end - marks["write_end"]})
    if acc.is_main_process:
        files = json.loads((Path(args.out) / "checkpoints" / f"step-{args.saves:06d}" / "manifest.json").read_text())["files"]
        Path(args.result).write_text(json.dumps({"rows": rows, "bytes": sum(f["size"] for f in files.values()), "files": len(files)}))
    acc.wait_for_everyone()


def sha256_rate() -> float:
    """GB/s of hashlib's sha256 here, now (one core, in memory)."""
    import hashlib
    import time

    data = os.urandom(1 << 20) * 256
    started = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return len(data) / (time.perf_counter() - started) / 1e9


def verify_bench(args: argparse.Namespace) -> None:
    here = Path(__file__).resolve().parent.parent
    sides = {"before": Path(args.before).resolve(), "after": here}
    results: dict[str, list[dict]] = {"before": [], "after": []}
    revs = {side: subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() for side, root in sides.items()}
    print(f"sha256 at the start: {sha256_rate():.2f} GB/s on one core", flush=True)
    for r in range(args.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
                result = Path(tmp) / "result.json"
                env = {**os.environ, "PYTHONPATH": str(sides[side] / "packages" / "core" / "src")}
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
                       "--verify-worker", "--gb", str(args.gb), "--saves", str(args.saves), "--out", str(Path(tmp) / "run"), "--result", str(result)]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
                data = json.loads(result.read_text())
            results[side].extend(data["rows"])
            shown = ", ".join(f"{row['write_s']:.2f}/{row['verify_s']:.2f}" for row in data["rows"])
            print(f"round {r + 1} {side:6s} ({revs[side]}) write/verify s per save: {shown}", flush=True)
    print(f"sha256 at the end: {sha256_rate():.2f} GB/s on one core")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"state: {data['bytes'] / 1e9:.2f} GB in {data['files']} files, 2 gloo ranks, format dcp, {args.saves} saves x {args.rounds} rounds per side")
    print("side | saves | median write s | median verify s | median verify / write | verify / write of medians | median save s (write + verify)")
    print("--- | --- | --- | --- | --- | --- | ---")
    for side, rows in results.items():
        write = statistics.median(row["write_s"] for row in rows)
        verify = statistics.median(row["verify_s"] for row in rows)
        ratio = statistics.median(row["verify_s"] / row["write_s"] for row in rows)
        total = statistics.median(row["write_s"] + row["verify_s"] for row in rows)
        print(f"{side} ({revs[side]}) | {len(rows)} | {write:.2f} | {verify:.2f} | {ratio:.3f} | {verify / write:.3f} | {total:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--verify", action="store_true", help="verification time against write time (see above)")
    parser.add_argument("--before", help="--verify: the checkout whose acc-train is the baseline (e.g. main's)")
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--tmp", default=None, help="--verify: where the checkpoints are written (default: the system's temp dir)")
    parser.add_argument("--verify-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.verify_worker:
        verify_worker(args)
        return
    if args.verify:
        if not args.before:
            parser.error("--verify needs --before CHECKOUT (the baseline, e.g. main's)")
        verify_bench(args)
        return

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
