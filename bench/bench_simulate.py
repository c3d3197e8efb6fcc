"""``acc-train plan --simulate`` held to real runs: the simulated step against the same step measured.

For each job (the demo model; a ~134M-parameter Llama built from a config.json written here),
world size and strategy, the step is simulated as ``plan --simulate`` does
(:func:`acc_train.simulate.simulate_strategy`: fake process group, fake tensors, rank 0 and the
last rank each in a fresh process) and run for real: the same job under ``torchrun`` over gloo,
every rank calling :func:`acc_train.simulate.step.measure_step`, which runs the same two steps
and measures the second with the same tracker (the strategy's own, e.g. ``FSDPMemTracker``, or
torch's ``MemTracker``). Rank 0's and the last rank's figures are compared with the simulated
ones of the same rank, per part of the tracked peak: parameters, gradients, optimizer state,
activations, other (gathered parameters, collective buffers, inputs), and the peak itself.
A combination that fails on either side (not simulated, or the real run stopped) is a row
that says why; the bench goes on.

Strategies: ddp, fsdp2, fsdp1, zero2, zero3 at every world size; hsdp (FSDP2,
``dp_replicate=2, dp_shard=2``) and fsdp x tp (FSDP2, ``dp_shard=2, tp=2``) at 4 ranks. fp32
(``training.mixed_precision: no``), plus one bf16 fsdp2 row per model at 2 ranks.

Usage: python bench/bench_simulate.py [--quick] [--models demo,llama] [--strategies ddp,...] [--json FILE]
       [--timeout S] [--table FILE]
       (--quick: the demo model, 2 ranks, fsdp2 and zero3 only)
The real runs are launched with this file as the worker (``--worker CONFIG OUT_DIR``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PARTS = ("peak", "parameters", "gradients", "optimizer", "activations", "other")

#: the Llama job: a GPT-2-small-sized Llama (12 layers of 768, vocab 32000, untied head)
LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
LLAMA_SHAPE = {"data.seq_len": 256, "training.micro_batch_size": 1}

#: label -> (registered strategy name, options, world sizes it runs at; None: every one)
STRATEGIES: dict[str, tuple[str, dict[str, Any], tuple[int, ...] | None]] = {
    "ddp": ("ddp", {}, None),
    "fsdp2": ("fsdp2", {}, None),
    "fsdp1": ("fsdp1", {}, None),
    "hsdp": ("fsdp", {"version": 2, "dp_replicate": 2, "dp_shard": 2}, (4,)),
    "fsdp x tp": ("fsdp", {"version": 2, "dp_shard": 2, "tp": 2}, (4,)),
    "zero2": ("zero2", {}, None),
    "zero3": ("zero3", {}, None),
}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # "demo" or "llama"
    ranks: int
    label: str  # a key of STRATEGIES
    precision: str = "no"

    @property
    def name(self) -> str:
        return f"{self.model} {self.ranks} ranks {self.label} {'fp32' if self.precision == 'no' else self.precision}"


def cases(quick: bool, models: tuple[str, ...] = ("demo", "llama"), labels: tuple[str, ...] | None = None) -> list[Case]:
    """Every combination (of ``models`` and ``labels``), the demo model's first (the cheapest ones finish first)."""
    if quick:
        return [Case("demo", 2, "fsdp2"), Case("demo", 2, "zero3")]
    out = []
    for model in models:
        for ranks in (2, 4):
            out += [Case(model, ranks, label) for label, (_, _, worlds) in STRATEGIES.items() if worlds is None or ranks in worlds]
        out.append(Case(model, 2, "fsdp2", "bf16"))
    return [c for c in out if labels is None or c.label in labels]


def write_llama(folder: Path) -> Path:
    """A model folder holding only a config.json (the job builds the model from it, random init)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_CONFIG, indent=1))
    return folder


def build_job(case: Case, llama_dir: Path | None = None) -> Any:
    """The case's resolved job, under its strategy, as ``plan --simulate`` would simulate it."""
    from acc_train.config import load_job, resolve_strategy
    from acc_train.simulate import job_under

    flags: dict[str, tuple[Any, str]] = {
        "launch.num_processes": (case.ranks, "bench"),
        "training.mixed_precision": (case.precision, "bench"),
    }
    if case.model == "llama":
        assert llama_dir is not None
        flags["model.name_or_path"] = (str(llama_dir), "bench")
        flags.update({k: (v, "bench") for k, v in LLAMA_SHAPE.items()})
    job = load_job(None, flags, [])
    name, options, _ = STRATEGIES[case.label]
    # the registered strategy, its options saying the mesh or the preset
    return job_under(job, resolve_strategy(name, options))


def _first_line(text: str) -> str:
    return (str(text).strip().splitlines() or [""])[0]


def simulate(job: Any, ranks: int, timeout: float) -> dict[str, Any]:
    """``{"ok": True, "ranks": {rank: result}}`` for rank 0 and the last, or ``{"ok": False, "why": ...}``."""
    from acc_train.errors import UserError
    from acc_train.simulate import SimulationFailed, simulate_strategy

    start = time.perf_counter()
    try:
        result = simulate_strategy(job, ranks, ranks, timeout)
    except SimulationFailed as exc:
        return {"ok": False, "why": f"not simulated: {exc}", "seconds": round(time.perf_counter() - start, 1)}
    except UserError as exc:
        return {"ok": False, "why": f"refused: {exc.message}", "seconds": round(time.perf_counter() - start, 1)}
    seconds = round(time.perf_counter() - start, 1)
    if "user_error" in result:
        return {"ok": False, "why": f"refused: {result['user_error']['message']}", "seconds": seconds}
    by_rank = {rank: r for r in result["ranks"] for rank in r["ranks"]}
    return {"ok": True, "ranks": by_rank, "seconds": seconds}


def measure(job: Any, ranks: int, workdir: Path, timeout: float) -> dict[str, Any]:
    """The real run: ``torchrun`` over gloo, ``measure_step`` on every rank; rank 0's and the
    last rank's results (``{"ok": True, "ranks": {rank: result}}``) or why there are none. A run
    that wrote both results and then failed at exit still counts (its exit code is kept)."""
    import torch

    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "config.yaml"
    config.write_text(job.to_yaml())
    out = workdir / "out"
    out.mkdir(exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        str(Path(__file__).resolve()), "--worker", str(config), str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"  # what acc-train's launch protocol says on a CPU machine
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the workers it started (their own session)
        log, _ = proc.communicate()
        code = f"killed after {timeout:.0f} s"
    seconds = round(time.perf_counter() - start, 1)
    (workdir / "torchrun.log").write_text(log or "")
    found: dict[int, dict[str, Any]] = {}
    failed: list[str] = []
    for rank in sorted({0, ranks - 1}):
        path = out / f"rank{rank}.json"
        if path.exists():
            data = json.loads(path.read_text())
            if "failed" in data:
                failed.append(f"rank {rank}: {data['failed']}")
            else:
                found[rank] = data
    if len(failed) == 2 and failed[0].split(": ", 1)[1] == failed[1].split(": ", 1)[1]:
        failed = [f"ranks 0 and {ranks - 1}: " + failed[0].split(": ", 1)[1]]
    if len(found) == len({0, ranks - 1}):
        return {"ok": True, "ranks": found, "exit": code, "seconds": seconds}
    if not failed:
        lines = [line for line in (log or "").splitlines() if line.strip() and "Warning" not in line]
        errors = [line for line in lines if "Error" in line or "error" in line]
        failed.append(f"exit {code}: {_first_line((errors or lines or ['no output'])[-1])}")
    return {"ok": False, "why": "real run failed: " + "; ".join(failed), "exit": code, "seconds": seconds}


def worker(config: str, out: str) -> None:
    """One rank of the real run: ``measure_step`` on the job, its result written to
    ``OUT/rank{RANK}.json``; then a barrier and ``os._exit`` (the libraries' teardown at exit is
    no part of what is measured)."""
    rank = int(os.environ["RANK"])
    path = Path(out) / f"rank{rank}.json"
    try:
        from acc_train.config import load_resolved
        from acc_train.simulate.step import measure_step

        result = measure_step(load_resolved(config))
    except Exception as exc:  # noqa: BLE001 - written down for the bench's row; the launcher stops the others
        import traceback

        frame = traceback.extract_tb(exc.__traceback__)[-1]
        path.write_text(json.dumps({"failed": f"{type(exc).__name__}: {_first_line(str(exc))} (in {frame.name}, {os.path.basename(frame.filename)}:{frame.lineno})"}))
        sys.stdout.flush()
        os._exit(1)
    path.write_text(json.dumps({"rank": rank, **result}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def diff_pct(simulated: int, measured: int) -> float | None:
    """(simulated - measured) / measured in %; 0 where both are 0, None where only measured is."""
    if measured == 0:
        return 0.0 if simulated == 0 else None
    return (simulated - measured) / measured * 100


def compare(sim: dict[str, Any], real: dict[str, Any]) -> dict[int, dict[str, dict[str, Any]]]:
    """Per compared rank, per part: simulated and measured bytes and their difference in %."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for rank, measured in real["ranks"].items():
        simulated = sim["ranks"].get(rank)
        if simulated is None:
            continue
        out[rank] = {
            part: {"simulated": simulated[f"{part}_bytes"], "measured": measured[f"{part}_bytes"],
                   "diff_pct": diff_pct(simulated[f"{part}_bytes"], measured[f"{part}_bytes"])}
            for part in PARTS
        }  # fmt: skip
    return out


def run_case(case: Case, workdir: Path, llama_dir: Path | None, timeout: float) -> dict[str, Any]:
    """Both sides of one case; never raises for a failure of either side."""
    entry: dict[str, Any] = {"case": dataclasses.asdict(case), "name": case.name}
    try:
        job = build_job(case, llama_dir)
    except Exception as exc:  # noqa: BLE001 - a job the config refuses is a row
        entry.update(sim={"ok": False, "why": f"job refused: {getattr(exc, 'message', exc)}"}, real={"ok": False, "why": "job refused"})
        return entry
    entry["sim"] = simulate(job, case.ranks, timeout)
    entry["real"] = measure(job, case.ranks, workdir / case.name.replace(" ", "-"), timeout)
    if entry["sim"]["ok"] and entry["real"]["ok"]:
        entry["compared"] = compare(entry["sim"], entry["real"])
    return entry


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}" if n < 100 * 2**20 else f"{n / 2**20:.1f}"


def _cell(part: dict[str, Any]) -> str:
    d = part["diff_pct"]
    pct = "n/a" if d is None else f"{d:+.1f}%" if abs(d) < 1000 else f"{'>+' if d > 0 else '<-'}999%"
    return f"{_mib(part['simulated'])} / {_mib(part['measured'])} ({pct})"


def table_rows(entry: dict[str, Any]) -> list[str]:
    c = entry["case"]
    head = f"{c['model']} | {c['ranks']} | {c['label']} | {'fp32' if c['precision'] == 'no' else c['precision']}"
    sim, real = entry["sim"], entry["real"]
    if "compared" not in entry:
        notes = [sim["why"] if not sim["ok"] else f"simulated ({next(iter(sim['ranks'].values()))['tracker']})"]
        if not real["ok"]:
            notes.append(real["why"])
        if real["ok"]:  # the measured figures stand on their own
            return [
                f"{head} | {rank} | " + " | ".join(f"- / {_mib(measured[f'{p}_bytes'])}" for p in PARTS) + f" | {'; '.join(notes)}"
                for rank, measured in sorted(real["ranks"].items())
            ]
        return [f"{head} | - | " + " | ".join(["-"] * len(PARTS)) + f" | {'; '.join(notes)}"]
    rows = []
    for rank, parts in sorted(entry["compared"].items()):
        s = sim["ranks"][rank]
        status = f"simulated ({s['tracker']}, peak in {s['at']['phase']}); sim {sim['seconds']:.0f} s, real {real['seconds']:.0f} s"
        if real["exit"] != 0:
            status += f"; real run exit {real['exit']} after writing its results"
        rows.append(f"{head} | {rank} | " + " | ".join(_cell(parts[p]) for p in PARTS) + f" | {status}")
    return rows


HEADER = "model | ranks | strategy | precision | rank | " + " | ".join(f"{p} sim / real MiB (diff)" for p in PARTS) + " | simulation"


def worst(entries: list[dict[str, Any]], threshold: float = 5.0) -> list[str]:
    """Every compared part whose difference is above ``threshold`` % (or with nothing measured)."""
    out = []
    for e in entries:
        for rank, parts in sorted(e.get("compared", {}).items()):
            for p in PARTS:
                d = parts[p]["diff_pct"]
                if d is None or abs(d) > threshold:
                    out.append(f"{e['name']} rank {rank} {p}: {_cell(parts[p])}")
    return out


def machine_line() -> str:
    import accelerate
    import torch
    import transformers

    try:
        import deepspeed

        ds = f", deepspeed {deepspeed.__version__}"
    except Exception:  # noqa: BLE001 - not installed is said by its absence
        ds = ""
    return (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
        f"torch {torch.__version__}, accelerate {accelerate.__version__}, transformers {transformers.__version__}{ds}, "
        f"cuda={torch.cuda.is_available()}"
    )


def print_summary(entries: list[dict[str, Any]], machine: str, command: str, minutes: float | None, quick: bool) -> None:
    print(machine)
    print(f"command: {command}" + (f"  ({minutes:.1f} min)" if minutes is not None else ""))
    llama_m = "" if quick else f"; llama: {LLAMA_CONFIG['num_hidden_layers']} x {LLAMA_CONFIG['hidden_size']}, vocab {LLAMA_CONFIG['vocab_size']}, seq {LLAMA_SHAPE['data.seq_len']} x micro-batch {LLAMA_SHAPE['training.micro_batch_size']}"
    print(
        "job: one measured step (the second of two) per rank, AdamW, clipping at 1.0; the demo model at its defaults "
        f"(micro-batch 8 x 128 tokens){llama_m}; real runs: torchrun over gloo, one thread per rank"
    )
    print("each cell: simulated / measured MiB of that rank at the tracked peak (diff = (simulated - measured) / measured)")
    print()
    print(HEADER)
    print(" | ".join(["---"] * (6 + len(PARTS))))
    for entry in entries:
        for row in table_rows(entry):
            print(row)
    off = worst(entries)
    print()
    print("parts more than 5% apart:" if off else "every compared part within 5%")
    for line in off:
        print("  " + line)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the demo model, 2 ranks, fsdp2 and zero3 only")
    parser.add_argument("--models", default="demo,llama", help="of demo,llama")
    parser.add_argument("--strategies", help="of " + ",".join(STRATEGIES) + " (default: all)")
    parser.add_argument("--json", help="also write the results here (rewritten after every case)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds each side of a case may take")
    parser.add_argument("--table", metavar="FILE", help="print the table of a --json FILE written before (a run cut short included)")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "OUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.table:
        data = json.loads(Path(args.table).read_text())
        print_summary(data["entries"], data["machine"], data["command"], data.get("minutes"), quick=not any(e["case"]["model"] == "llama" for e in data["entries"]))
        return

    started = time.time()
    command = "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:])
    entries: list[dict[str, Any]] = []
    machine = machine_line()
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-simulate-") as tmp:
        llama_dir = None if args.quick else write_llama(Path(tmp) / "llama")
        labels = None if args.strategies is None else tuple(s.strip() for s in args.strategies.split(","))
        for case in cases(args.quick, tuple(args.models.split(",")), labels):
            entry = run_case(case, Path(tmp), llama_dir, args.timeout)
            entries.append(entry)
            for row in table_rows(entry):
                print(row, flush=True)
            if args.json:
                data = {"command": command, "machine": machine, "minutes": round((time.time() - started) / 60, 1), "entries": entries}
                Path(args.json).write_text(json.dumps(data, indent=1, default=str))

    print()
    print_summary(entries, machine, command, (time.time() - started) / 60, args.quick)


if __name__ == "__main__":
    main()
