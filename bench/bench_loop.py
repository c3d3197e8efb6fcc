"""acc-train's loop against hand-written loops of the same strategy: DDP, FSDP2 and ZeRO-3.

For each strategy and round, one job runs for ``--steps`` steps on ``--num-processes`` ranks
once through ``acc-train --strategy S`` and once through ``bench/handwritten_loop.py --strategy
S`` (plain torchrun; torch DDP, a raw ``fully_shard`` loop, or a raw ``deepspeed.initialize``
loop; no Accelerate), alternating which goes first. Both sides time whole iterations (from the
end of one step to the end of the next, the first 3 steps left out; acc-train's span is
documented in ``acc_train.loop.loop``) and report the median step of the run, and each rank's
peak memory (RSS on CPU, ``max_memory_allocated`` on GPU). The two sides train the same model on
the same batches, so their logged losses must agree: the largest difference is printed.

The job (``--model``): ``demo`` is acc-train's demo job as each side defaults to it; ``rehearsal``
is the job of the device check's rehearsal (``REHEARSAL_JOB`` in ``bench/device/check.py``: its
tiny Llama, micro-batch, sequence length and corpus size), handed to both sides. Both are fp32.

A run counts once its result is written (the hand-written loop's JSON, acc-train's run.json; both
replaced atomically). A process that then exits nonzero, or has not exited ``--exit-timeout``
seconds later, is noted (and killed, with everything it started) and its result kept: torch's and
DeepSpeed's teardown at exit sometimes aborted or hung a rank after the work was done. The bench
aborts only where a run wrote no result, by its exit or by ``--timeout`` seconds.

``--source DIR`` runs the acc-train side from another source tree (a git worktree of an older
commit, say): ``DIR/packages/*/src`` go first on its ``PYTHONPATH``. The hand-written side and
this script always come from this tree.

Prints each run, then per strategy the median over rounds: step time of each side and their
ratio (also the median of the per-round ratios, which cancels drift in the machine's load),
and peak RSS per rank (the larger rank's) of each side and their difference.
``--json`` writes ``{"model", "num_processes", "sources", "results"}``.

Usage: python bench/bench_loop.py [--strategies ddp,fsdp,zero3] [--rounds 3] [--steps 60]
       [--num-processes 2] [--model demo|rehearsal] [--source DIR] [--timeout 1800]
       [--exit-timeout 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STRATEGIES = ("ddp", "fsdp", "zero3")
#: how often a running side is looked at (its exit, its result file)
POLL_S = 0.5


# --- the job ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """The job both sides train. Fields left None are each side's default (the demo job's)."""

    name: str
    #: keys of the demo model's config to override (acc-train's ``model.config``)
    config: dict[str, Any] = field(default_factory=dict)
    micro_batch_size: int | None = None
    seq_len: int | None = None
    max_bytes: int | None = None

    def acc_train_args(self) -> list[str]:
        args = ["--set", f"model.config={json.dumps(self.config)}"] if self.config else []
        if self.micro_batch_size is not None:
            args += ["--micro-batch-size", str(self.micro_batch_size)]
        if self.seq_len is not None:
            args += ["--set", f"data.seq_len={self.seq_len}"]
        if self.max_bytes is not None:
            args += ["--set", f"data.demo_max_bytes={self.max_bytes}"]
        return args

    def handwritten_args(self) -> list[str]:
        args = ["--model-config", json.dumps(self.config)] if self.config else []
        if self.micro_batch_size is not None:
            args += ["--micro-batch-size", str(self.micro_batch_size)]
        if self.seq_len is not None:
            args += ["--seq-len", str(self.seq_len)]
        if self.max_bytes is not None:
            args += ["--max-bytes", str(self.max_bytes)]
        return args


def rehearsal_model() -> Model:
    """The device check's rehearsal job, read from ``bench/device/check.py`` itself (its steps
    and precision aside: ``--steps`` sets the steps, and both are fp32 here as there)."""
    spec = importlib.util.spec_from_file_location("bench_device_check", HERE / "device" / "check.py")
    assert spec is not None and spec.loader is not None
    check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = check  # dataclasses look their module up while the class is made
    spec.loader.exec_module(check)
    job = check.REHEARSAL_JOB
    return Model("rehearsal", dict(job.model), job.micro_batch_size, job.seq_len, job.max_bytes)


MODELS: dict[str, Callable[[], Model]] = {"demo": lambda: Model("demo"), "rehearsal": rehearsal_model}


# --- running one side --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """How long one run may take in all, and how long it may take to exit once its result is written."""

    timeout: float
    exit_timeout: float


def run_until_result(cmd: list[str], env: dict[str, str] | None, result_ready: Callable[[], bool], log: Path, limits: Limits, what: str) -> str:
    """Run ``cmd`` in a session of its own (output to ``log``) until it exits, or until its result
    is written and it has had ``limits.exit_timeout`` seconds to exit. Returns a note on how it
    ended ("" for a clean exit); aborts the bench (with the log's end) where no result was written."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    # torchrun's and acc-train's launchers start each worker in a session of its own, out of
    # reach of killpg: they are gathered while they live, so a kill can name them too
    descendants: dict[int, Any] = {}
    started = time.monotonic()
    written_at: float | None = None
    try:
        while True:
            _gather_descendants(proc.pid, descendants)
            rc = proc.poll()
            ready = result_ready()
            if rc is not None:
                if ready:
                    return "" if rc == 0 else f"exited {rc} after writing its result"
                raise SystemExit(f"{what} failed (exit {rc}) without writing its result:\n{_tail(log)}")
            now = time.monotonic()
            if ready and written_at is None:
                written_at = now
            if written_at is not None and now - written_at > limits.exit_timeout:
                return f"hung at exit: killed {limits.exit_timeout:.0f} s after writing its result"
            if now - started > limits.timeout:
                if ready:
                    return f"hung at exit: killed at the --timeout of {limits.timeout:.0f} s, after writing its result"
                raise SystemExit(f"{what} timed out after {limits.timeout:.0f} s without writing its result:\n{_tail(log)}")
            time.sleep(POLL_S)
    finally:  # every way out: nothing it started outlives it
        _kill(proc, descendants)


def _gather_descendants(pid: int, into: dict[int, Any]) -> None:
    import psutil  # Accelerate's dependency, so here wherever acc-train is

    try:
        for child in psutil.Process(pid).children(recursive=True):
            into.setdefault(child.pid, child)
    except psutil.NoSuchProcess:
        pass


def _kill(proc: subprocess.Popen[bytes], descendants: dict[int, Any]) -> None:
    """SIGKILL to the process's group and to each descendant seen that still runs (psutil checks
    that a pid was not reused before it signals it)."""
    import psutil

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for child in descendants.values():
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def _tail(log: Path, chars: int = 6000) -> str:
    return log.read_text(errors="replace")[-chars:]


def _json_ready(path: Path) -> bool:
    """The file is there and is whole JSON (both sides replace it atomically; this guards older sources)."""
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def run_acc_train(strategy: str, steps: int, nproc: int, model: Model, env: dict[str, str] | None, run_dir: Path, limits: Limits) -> dict:
    from acc_train.outputs.metrics import read_metrics

    out = run_dir / "acc-train"
    cmd = [
        sys.executable, "-m", "acc_train_cli",
        "--strategy", strategy, "--num-processes", str(nproc), "--max-steps", str(steps),
        "--output-dir", str(out), "--overwrite",
        "--set", "training.progress_bar=false", "--set", "training.mixed_precision=no",
        "--set", "data.eval_fraction=0", "--set", "checkpoint.every=0",
        "--set", f"scheduler.warmup_steps={-(-steps // 10)}", *model.acc_train_args(),
    ]  # fmt: skip
    note = run_until_result(cmd, env, lambda: _json_ready(out / "run.json"), run_dir / "acc-train.log", limits, f"acc-train {strategy}")
    summary = json.loads((out / "run.json").read_text())
    losses = [row.loss for row in read_metrics(out).training]  # metrics.jsonl is written before run.json
    return {"step_time_s": summary["step_time_median_s"], "peaks": [r["peak_memory_bytes"] for r in summary["per_rank"]], "losses": losses, "exit": note or "ok"}


def run_handwritten(strategy: str, steps: int, nproc: int, model: Model, env: dict[str, str] | None, run_dir: Path, limits: Limits) -> dict:
    out = run_dir / "handwritten.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(HERE / "handwritten_loop.py"), "--strategy", strategy, "--steps", str(steps), "--out", str(out),
        *model.handwritten_args(),
    ]  # fmt: skip
    note = run_until_result(cmd, env, lambda: _json_ready(out), run_dir / "handwritten.log", limits, f"the hand-written {strategy} loop")
    data = json.loads(out.read_text())
    return {"step_time_s": data["step_time_s"], "peaks": [r["peak_memory_bytes"] for r in data["per_rank"]], "losses": data["losses"], "exit": note or "ok"}


# --- where each side's code comes from ----------------------------------------------------------------


def source_env(source: Path) -> dict[str, str]:
    """The acc-train side's environment for ``--source DIR``: its packages' ``src`` first on ``PYTHONPATH``."""
    srcs = sorted(str(p) for p in source.glob("packages/*/src"))
    if not srcs:
        raise SystemExit(f"--source {source}: no packages/*/src there (give the root of an acc-train checkout)")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*srcs, *filter(None, [os.environ.get("PYTHONPATH")])])}


def describe_source(path: Path) -> dict[str, Any]:
    """A source tree as the results record it: its path, and its git commit and whether it has
    uncommitted changes, where it is in a git checkout."""
    described: dict[str, Any] = {"path": str(path), "commit": None, "modified": None}
    try:
        commit = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(path), "status", "--porcelain"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return described
    return {**described, "commit": commit, "modified": bool(status.strip())}


def installed_acc_train() -> Path:
    """Where the acc-train this Python imports lives (found, not imported)."""
    spec = importlib.util.find_spec("acc_train")
    if spec is None or spec.origin is None:
        raise SystemExit("acc_train is not importable by this Python")
    return Path(spec.origin).parent


# --- the bench --------------------------------------------------------------------------------------


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _mib(n: float) -> float:
    return n / 2**20


def _loss_diff(acc: list[dict], hw: list[dict]) -> float:
    """The largest difference of the two sides' losses at the same step, over every round."""
    return max((abs(x - y) for a, h in zip(acc, hw) for x, y in zip(a["losses"], h["losses"])), default=float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="demo", help="demo: acc-train's demo job; rehearsal: the device check's rehearsal job")
    parser.add_argument("--source", type=Path, help="run the acc-train side from this source tree (its packages/*/src first on PYTHONPATH)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take in all")
    parser.add_argument("--exit-timeout", type=float, default=60.0, help="seconds a run may take to exit once its result is written")
    parser.add_argument("--json", help="also write the model, sources and raw results here")
    args = parser.parse_args()
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"--strategies: unknown {', '.join(unknown)} (choose from {', '.join(STRATEGIES)})")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.num_processes)))

    model = MODELS[args.model]()
    limits = Limits(args.timeout, args.exit_timeout)
    acc_env = source_env(args.source.resolve()) if args.source else None
    hw_env = None if _cuda() else {**os.environ, "ACCELERATE_USE_CPU": "1"}
    sources = {
        "acc-train": describe_source(args.source.resolve() if args.source else installed_acc_train()),
        "handwritten": describe_source(HERE),
    }

    results: dict[str, dict[str, list[dict]]] = {s: {"acc-train": [], "handwritten": []} for s in strategies}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for strategy in strategies:  # interleaved: every strategy in every round
                order = ["acc-train", "handwritten"] if i % 2 == 0 else ["handwritten", "acc-train"]
                for side in order:
                    run_dir = Path(tmp) / f"round{i + 1}-{strategy}"  # fresh per run: no stale result is read
                    run_dir.mkdir(exist_ok=True)
                    if side == "acc-train":
                        r = run_acc_train(strategy, args.steps, args.num_processes, model, acc_env, run_dir, limits)
                    else:
                        r = run_handwritten(strategy, args.steps, args.num_processes, model, hw_env, run_dir, limits)
                    results[strategy][side].append(r)
                    peaks = " ".join(f"{_mib(p):6.1f}" for p in r["peaks"])
                    print(f"round {i + 1} {strategy:6s} {side:12s} step {r['step_time_s'] * 1000:8.2f} ms  peak RSS per rank {peaks} MiB", flush=True)
                    if r["exit"] != "ok":
                        print(f"round {i + 1} {strategy:6s} {side:12s} note: {r['exit']}; its result is kept", flush=True)
                shutil.rmtree(run_dir, ignore_errors=True)  # final/ of a large model is large

    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, cuda={_cuda()}")
    shape = f" (config {json.dumps(model.config)}, micro-batch {model.micro_batch_size}, seq {model.seq_len}, {model.max_bytes} bytes)" if model.config else ""
    print(
        f"job: {model.name} model{shape}, fp32, {args.num_processes} processes, {args.steps} steps, {args.rounds} rounds "
        f"(strategies interleaved, sides alternating), {(time.time() - started) / 60:.1f} min"
    )
    for side, described in sources.items():
        state = "" if described["commit"] is None else f" at {described['commit'][:12]}{' (modified)' if described['modified'] else ''}"
        print(f"{side} from {described['path']}{state}")
    print("strategy | acc-train step ms | handwritten step ms | ratio of medians | median of round ratios | round ratios min-max | acc-train peak MiB | handwritten peak MiB | peak diff MiB | max |loss diff|")
    print(" | ".join(["---"] * 10))
    for strategy in strategies:
        acc, hw = results[strategy]["acc-train"], results[strategy]["handwritten"]
        acc_t = statistics.median(r["step_time_s"] for r in acc)
        hw_t = statistics.median(r["step_time_s"] for r in hw)
        ratios = [a["step_time_s"] / h["step_time_s"] for a, h in zip(acc, hw)]
        acc_m = statistics.median(max(r["peaks"]) for r in acc)
        hw_m = statistics.median(max(r["peaks"]) for r in hw)
        print(
            f"{strategy} | {acc_t * 1000:.1f} | {hw_t * 1000:.1f} | {acc_t / hw_t:.3f} | {statistics.median(ratios):.3f} | "
            f"{min(ratios):.3f}-{max(ratios):.3f} | {_mib(acc_m):.1f} | {_mib(hw_m):.1f} | {_mib(acc_m - hw_m):+.1f} | {_loss_diff(acc, hw):.1e}"
        )
    for strategy in strategies:  # a loss difference over fewer steps than were run says less than it seems
        for a, h in zip(results[strategy]["acc-train"], results[strategy]["handwritten"]):
            if len(a["losses"]) != len(h["losses"]):
                print(f"note: {strategy}: acc-train logged {len(a['losses'])} losses, the hand-written loop {len(h['losses'])}; compared over the first {min(len(a['losses']), len(h['losses']))}")
    if args.json:
        record = {"model": asdict(model), "num_processes": args.num_processes, "sources": sources, "results": results}
        Path(args.json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
