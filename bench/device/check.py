"""The device check: the one command a session lent an H200 runs there, and its CPU rehearsal.

    python bench/device/check.py --out $OUT                  # on the device (installs the carried wheels)
    python bench/device/check.py --out $OUT --rows fsdp,lora # rerun some rows
    python bench/device/check.py --rehearse --out DIR        # the same code on CPU, tiny model, no installs

On the device it installs ``bench/device/wheels/*.whl`` (prepared here by
``prepare_wheels.py`` and carried) with ``pip install --no-index --no-deps --target``: no network,
no dependency resolution; the target folder goes first on ``sys.path`` and on ``PYTHONPATH`` for
every subprocess, so the rows run acc-train's wheels (not the sources), over the image's torch.
Then it runs the rows in priority order (:data:`ROWS`), each in subprocesses of its own with its
own deadline, all within ``--budget`` seconds; a row that fails or runs out of time records its
``error`` and the next one starts. After every row ``results.json``, ``results.md`` and
``check.log`` (every command and its whole output, one log) are rewritten in ``--out``, so a run
cut short still brings back the rows it finished.

Rows (the job of ``bench/gpu_fsdp_vs_ddp.py``: the ~1.1B demo Llama, bf16, world size 1):

- ``gpu-tests``: the suite's ``gpu``-marked tests (the Trainer's is its own rows below);
- ``ddp``, ``fsdp`` (FSDP2), ``zero3``: acc-train; tokens/s and MFU from run.json, peak memory
  against ``acc-train plan``'s estimate for the same job, the loss after the same steps;
- ``handwritten``: ``bench/handwritten_loop.py`` on the same model, data and settings (bf16
  autocast, fused AdamW, torch DDP, no Accelerate); its MFU through ``acc_train.outputs.mfu``;
- ``gc``, ``lora``, ``compile``: ddp with ``training.gradient_checkpointing``, ``model.lora``,
  ``training.compile``;
- ``zero3-fused-adam``: the hand-written ZeRO-3 loop with DeepSpeed's fused CUDA Adam
  (``deepspeed.ops.adam.FusedAdam``, compiled on first use by the image's nvcc): acc-train hands
  DeepSpeed a torch optimizer, so this row is the one that builds and runs DeepSpeed's CUDA ops;
- ``trainer-fsdp``, ``trainer-zero3``: ``acc-train launch`` of the unchanged HF Trainer program
  (``tests/launch_programs/trainer_train.py``) at world size 1, saving and resuming;
- ``simulate`` (last: it must not take the time of the rows above): ``acc-train plan --simulate
  --json`` for the job (``plan_args``), fsdp2 and zero3, one command each, on the CPU (no GPU
  visible to it); each simulated peak per rank beside the fsdp or zero3 row's measured peak
  (run.json's, ``torch.cuda.max_memory_allocated`` on CUDA) and simulated / measured. Rehearsing,
  the measured side is the process's RSS peak, reported without a ratio.

``--rehearse`` runs every row the same way on CPU with a tiny model, a few steps and fp32 (CPUs
without native bf16 run it 20 times slower), from the sources on ``PYTHONPATH``; CI runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SITE = Path(tempfile.gettempdir()) / "acc-train-device-site"

#: bench/gpu_fsdp_vs_ddp.py's MODEL_1B (~1.1B parameters with the demo's byte vocabulary)
MODEL_1B = {"hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 16}
#: the rehearsal's: as small as a Llama gets while every code path still runs
MODEL_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}

FIELDS = ("name", "tokens_per_s", "mfu", "peak_memory_bytes", "loss", "seconds", "error")


@dataclass(frozen=True)
class Job:
    """The training job every throughput row shares."""

    model: dict[str, Any]
    steps: int
    micro_batch_size: int
    seq_len: int
    max_bytes: int
    precision: str  # acc-train's training.mixed_precision: bf16 or no
    device: str  # cuda or cpu
    #: the demo data's cache: the check's own, built by the first row and reused by the rest
    #: (torch's extension builds, DeepSpeed's ops among them, stay in torch's usual place)
    cache_dir: str | None = None

    @property
    def mfu_precision(self) -> str:
        return "fp32" if self.precision == "no" else self.precision

    def acc_train_args(self) -> list[str]:
        return [
            "--num-processes", "1", "--max-steps", str(self.steps), "--micro-batch-size", str(self.micro_batch_size),
            "--mixed-precision", self.precision, "--seed", "42",
            "--set", f"model.config={json.dumps(self.model)}", "--set", f"data.seq_len={self.seq_len}",
            "--set", f"data.demo_max_bytes={self.max_bytes}", "--set", "data.eval_fraction=0",
            "--set", f"scheduler.warmup_steps={math.ceil(self.steps / 10)}",
            "--set", "checkpoint.every=0", "--set", "training.progress_bar=false", "--set", "training.log_every=1",
            *(["--set", f"data.cache_dir={self.cache_dir}"] if self.cache_dir else []),
        ]  # fmt: skip


DEVICE_JOB = Job(MODEL_1B, steps=20, micro_batch_size=4, seq_len=1024, max_bytes=2_000_000, precision="bf16", device="cuda")
REHEARSAL_JOB = Job(MODEL_TINY, steps=6, micro_batch_size=2, seq_len=64, max_bytes=100_000, precision="no", device="cpu")


class RowFailed(Exception):
    """A row's own failure: its message is the row's ``error``."""


class Check:
    """One check's state: where it writes, the job, the environment of its subprocesses, the clock."""

    def __init__(self, out: Path, job: Job, env: dict[str, str], budget: float, rehearse: bool, work: Path) -> None:
        self.out, self.job, self.env, self.rehearse, self.work = out, job, env, rehearse, work
        self.log_path = out / "check.log"
        self.deadline = time.monotonic() + budget
        self.budget = budget
        self._tiny_model: Path | None = None
        #: ``acc-train plan --json``'s answers by arguments: rows of one job share one plan
        self._plans: dict[tuple[str, ...], dict[str, Any] | None] = {}
        self._pending: tuple[tuple[str, ...], subprocess.Popen[str]] | None = None
        #: the rows run so far by name, as recorded (the simulate row reads the fsdp and zero3 rows')
        self.results: dict[str, dict[str, Any]] = {}

    def log(self, text: str) -> None:
        with self.log_path.open("a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, cmd: list[str], timeout: float, *, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` in a process group of its own, killed whole at ``timeout``; logged in full."""
        self.log(f"$ {' '.join(cmd)}   (deadline {timeout:.0f} s)")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            _dump_stacks(proc)
            _kill_group(proc)
            output, _ = _drain(proc)
            self.log(output)
            raise RowFailed(f"timed out after {timeout:.0f} s in {_where_it_hung(output)} (each process's Python stack is in check.log): {' '.join(cmd[:6])} ...") from None
        self.log(output or "")
        self.log(f"-> exit {proc.returncode} in {time.monotonic() - t0:.1f} s")
        return subprocess.CompletedProcess(cmd, proc.returncode, output or "", "")

    def start(self, cmd: list[str]) -> subprocess.Popen[str]:
        """A command run beside the row's own (``acc-train plan``); :meth:`finish` collects it."""
        self.log(f"$ {' '.join(cmd)}   (beside the row)")
        return subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def finish(self, proc: subprocess.Popen[str], timeout: float) -> tuple[int | None, str]:
        try:
            out, err = proc.communicate(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = _drain(proc)
            self.log(f"(beside the row) timed out\n{err}")
            return None, out
        self.log(f"(beside the row) exit {proc.returncode}\n{err[-3000:]}")
        return proc.returncode, out

    def plan_rows(self, args: list[str], start_only: bool = False) -> dict[str, Any] | None:
        """``acc-train plan --json ARGS``'s rows by label (None where plan failed). Started beside a
        row's training by a first call with ``start_only``, collected by the next call."""
        key = tuple(args)
        if key not in self._plans:
            self._plans[key] = None
            self._pending = (key, self.start([sys.executable, "-m", "acc_train_cli", "plan", "--json", *args]))
        pending = self._pending
        if not start_only and pending is not None and pending[0] == key:
            self._pending = None
            rc, text = self.finish(pending[1], max(self.left(), 5))
            try:
                self._plans[key] = {r["label"]: r for r in json.loads(text)["rows"]} if rc == 0 else None
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                self.log(f"(beside the row) plan's JSON unreadable: {exc}")
        return None if start_only else self._plans[key]

    def tiny_model(self, timeout: float) -> Path:
        """The suite's tiny model and tokenizer (the Trainer rows' model), without dropout."""
        if self._tiny_model is None:
            path = self.work / "tiny-model"
            code = (
                "import json, sys; from pathlib import Path; from acc_train.testing.runs import save_tiny_model; "
                "p = save_tiny_model(Path(sys.argv[1])); c = json.loads((p / 'config.json').read_text()); "
                "c['attention_dropout'] = 0.0; (p / 'config.json').write_text(json.dumps(c))"
            )
            proc = self.run([sys.executable, "-c", code, str(path)], timeout)
            if proc.returncode != 0:
                raise RowFailed(f"could not save the tiny model: {_last_line(proc.stdout)}")
            self._tiny_model = path
        return self._tiny_model


def _dump_stacks(proc: subprocess.Popen[str]) -> None:
    """Where a timed-out command hangs: SIGABRT to its process group, on which every Python
    process of it prints its threads' stacks (``PYTHONFAULTHANDLER``, set for every command the
    check runs) into the output the log keeps, and ends (no core file: the check set their limit
    to 0)."""
    try:
        os.killpg(proc.pid, signal.SIGABRT)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def _where_it_hung(output: str) -> str:
    """From a timed-out command's output: the innermost frame of each stack that SIGABRT dumped
    (faulthandler's "Current thread" first) and the last line the command printed before."""
    lines = output.splitlines()
    first_dump = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), len(lines))
    said = next((line.strip() for line in reversed(lines[:first_dump]) if line.strip()), "")
    frames: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith(("Current thread", "Thread 0x")) and i + 1 < len(lines):
            m = re.match(r'\s+File "(.+)", line (\d+) in (\S+)', lines[i + 1])
            if m:
                frame = f"{Path(m.group(1)).name}:{m.group(2)} {m.group(3)}"
                if frame not in frames:
                    (frames.insert(0, frame) if line.startswith("Current") else frames.append(frame))
    where = ", ".join(frames[:4]) or "(no Python stack came back)"
    return f"{where}; its last line: {said[:200]!r}" if said else where


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """The process and everything it started (launchers, workers): SIGTERM (a launcher passes it
    on and its workers may save), 10 s, then SIGKILL to whatever of the group is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _drain(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """What a killed process group wrote; given up after 10 s (a stray holder of the pipe)."""
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        return "(output lost: the pipe stayed open after the kill)", ""
    return out or "", err or ""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _last_line(text: str) -> str:
    """The most telling line of a failed command's output: its last error line, else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or line.startswith(("error", "acc-train:", "FAILED", "E ")):
            return line[:500]
    return lines[-1][:500] if lines else "(no output)"


# --- rows -----------------------------------------------------------------------------------------


def acc_train_row(strategy: str, plan_label: str, *sets: str, rehearsal_sets: tuple[str, ...] | None = None) -> Callable[[Check, float], dict[str, Any]]:
    """A row training the job through ``acc-train`` (with ``--set`` items ``sets``, or
    ``rehearsal_sets`` when rehearsing), its plan beside it."""

    def row(check: Check, timeout: float) -> dict[str, Any]:
        job = check.job
        chosen = rehearsal_sets if check.rehearse and rehearsal_sets is not None else sets
        extra = [a for s in chosen for a in ("--set", s)]
        out = check.work / f"run-{strategy}-{len(list(check.work.iterdir()))}"
        check.plan_rows([*plan_args(job), *extra], start_only=True)
        try:
            proc = check.run([sys.executable, "-m", "acc_train_cli", "--strategy", strategy, "--output-dir", str(out), *job.acc_train_args(), *extra], timeout)
            plans = check.plan_rows([*plan_args(job), *extra])
            if proc.returncode != 0:
                raise RowFailed(f"acc-train --strategy {strategy} exited {proc.returncode}: {_last_line(proc.stdout)}")
            summary = json.loads((out / "run.json").read_text())
        finally:
            shutil.rmtree(out, ignore_errors=True)  # final/ of the 1B model is 4.4 GB; the device's disk is 64 GB
        result: dict[str, Any] = {
            "tokens_per_s": summary.get("tokens_per_s"),
            "mfu": summary.get("mfu"),
            "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0) for r in summary.get("per_rank", [{}])) or None,
            "loss": summary.get("final_loss"),
            "step_time_s": summary.get("step_time_median_s"),
            "distributed_type": summary.get("distributed_type"),
            "device": summary.get("device"),
        }
        if "mfu" not in summary:
            result["note"] = "run.json has no mfu (acc_train.outputs.mfu not merged yet)"
        if plans and plan_label in plans:
            result["plan_bytes"] = plans[plan_label]["device_total"]
            if result["peak_memory_bytes"]:
                result["peak_vs_plan"] = result["peak_memory_bytes"] / result["plan_bytes"]
        return result

    return row


def plan_args(job: Job) -> list[str]:
    """``acc-train plan``'s arguments for the job (plan takes no --max-steps or --seed)."""
    args = job.acc_train_args()
    for flag in ("--max-steps", "--seed"):
        i = args.index(flag)
        del args[i : i + 2]
    return args


def handwritten_row(strategy: str, optimizer: str = "torch") -> Callable[[Check, float], dict[str, Any]]:
    """``bench/handwritten_loop.py`` on the job (one process, started with the variables torchrun sets), its MFU through acc_train.outputs.mfu.
    Rehearsing, the optimizer is torch's: DeepSpeed's FusedAdam on its CPU accelerator is another
    op (C++, minutes to build on a small CPU), not the CUDA one this row is for."""

    def row(check: Check, timeout: float) -> dict[str, Any]:
        job = check.job
        chosen = "torch" if check.rehearse else optimizer
        out = check.work / f"handwritten-{strategy}-{chosen}.json"
        # one process, as a hand-written single-GPU loop starts: plain python with the env://
        # variables torchrun would set (no elastic agent or rendezvous between the check and the loop)
        cmd = [
            sys.executable, str(ROOT / "bench" / "handwritten_loop.py"), "--strategy", strategy, "--steps", str(job.steps),
            "--micro-batch-size", str(job.micro_batch_size), "--seq-len", str(job.seq_len), "--seed", "42",
            "--model-config", json.dumps(job.model), "--max-bytes", str(job.max_bytes), "--device", job.device,
            "--mixed-precision", job.precision, "--optimizer", chosen, "--out", str(out),
        ]  # fmt: skip
        env = {**check.env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        # the threads acc-train's launcher gives its one worker where the user set none (launcher.launch)
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        t0 = time.monotonic()
        proc = check.run(cmd, timeout, env=env)
        if proc.returncode != 0:
            raise RowFailed(f"handwritten_loop.py --strategy {strategy} exited {proc.returncode}: {_last_line(proc.stdout)}")
        summary = json.loads(out.read_text())
        result: dict[str, Any] = {
            "tokens_per_s": summary["tokens_per_s"],
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in summary["per_rank"]),
            "loss": summary["losses"][-1],
            "step_time_s": summary["step_time_s"],
            "device": summary.get("device"),
        }
        result.update(handwritten_mfu(check, summary["tokens_per_s"], max(timeout - (time.monotonic() - t0), 10)))
        return result

    return row


#: run in a subprocess: the MFU of a hand-written run through acc_train.outputs.mfu (issue 26's item 1)
MFU_PROGRAM = """
import json, sys
args = json.loads(sys.argv[1])
try:
    from acc_train.outputs.device_peaks import device_peak_flops
    from acc_train.outputs.mfu import mfu, model_flops_per_token
except ImportError as exc:
    print(json.dumps({"error": f"acc_train.outputs.mfu is missing ({exc}): the hand-written loop's MFU is not computed"}))
    raise SystemExit(0)
import torch
import transformers
from acc_train.model.build import DEMO_MODEL_CONFIG

config = transformers.LlamaConfig(**{**DEMO_MODEL_CONFIG, **args["model"]})
device = torch.device("cuda", 0) if args["device"] == "cuda" else torch.device("cpu")
flops_per_token = model_flops_per_token(config, args["seq_len"])
peak, source = device_peak_flops(device, args["precision"])
print(json.dumps({"mfu": mfu(args["tokens_per_s"], flops_per_token, peak), "flops_per_token": flops_per_token, "peak_flops": peak, "peak_source": source}))
"""


def handwritten_mfu(check: Check, tokens_per_s: float, timeout: float) -> dict[str, Any]:
    job = check.job
    args = {"model": job.model, "seq_len": job.seq_len, "device": job.device, "precision": job.mfu_precision, "tokens_per_s": tokens_per_s}
    try:
        proc = check.run([sys.executable, "-c", MFU_PROGRAM, json.dumps(args)], timeout)
    except RowFailed as exc:
        return {"error": f"MFU: {exc}"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"MFU through acc_train.outputs.mfu failed: {_last_line(proc.stdout)}"}
    return json.loads(lines[-1])


def gpu_tests_row(check: Check, timeout: float) -> dict[str, Any]:
    """The suite's gpu-marked tests (skipped, so quick, where no GPU is: the rehearsal)."""
    files = sorted({str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text()})
    # on the device, 4 xdist workers share the GPU (tiny models; --dist loadgroup keeps each
    # group's launches on one worker); rehearsing, everything skips and one process is quicker
    workers = ["-n", "0"] if check.rehearse else ["-n", "4"]
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-k", "not test_hf_trainer_on_one_gpu",
        "-o", f"timeout={int(timeout)}", *workers, *files,
    ]  # fmt: skip
    proc = check.run(cmd, timeout)
    summary = next((line for line in reversed(proc.stdout.splitlines()) if " in " in line and ("passed" in line or "failed" in line or "skipped" in line or "error" in line)), "")
    result = {"tests": summary.strip("= ")}
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise RowFailed(f"pytest exited {proc.returncode}: {summary.strip('= ') or _last_line(proc.stdout)}")
    return result


def trainer_row(strategy: str) -> Callable[[Check, float], dict[str, Any]]:
    """``acc-train launch`` of the unchanged HF Trainer program at world size 1: the strategy
    applied, 6 steps saved at 3 and 6, a new Trainer resumed from checkpoint-3."""

    def row(check: Check, timeout: float) -> dict[str, Any]:
        t0 = time.monotonic()
        model = check.tiny_model(timeout)
        out = check.work / f"trainer-{strategy}"
        cmd = [
            sys.executable, "-m", "acc_train_cli", "--strategy", strategy, "--num-processes", "1", "--mixed-precision", "no",
            "launch", str(ROOT / "tests" / "launch_programs" / "trainer_train.py"), str(model), str(out),
        ]  # fmt: skip
        proc = check.run(cmd, timeout - (time.monotonic() - t0))
        if proc.returncode != 0:
            raise RowFailed(f"acc-train --strategy {strategy} launch trainer_train.py exited {proc.returncode}: {_last_line(proc.stdout)}")
        found = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
        if not found:
            raise RowFailed("trainer_train.py printed no RESULT line")
        first, resumed = found[0]["first"], found[0]["resumed"]
        want = (strategy == "fsdp", strategy == "zero3")
        problems = []
        if (first["fsdp"], first["deepspeed"]) != want:
            problems.append(f"Trainer saw fsdp={first['fsdp']} deepspeed={first['deepspeed']}, expected fsdp={want[0]} deepspeed={want[1]}")
        if resumed["steps_run"] != 3:
            problems.append(f"the resumed Trainer ran {resumed['steps_run']} steps, expected 3")
        losses = first["losses"]
        result = {"loss": losses[max(losses, key=int)] if losses else None, "distributed_type": first["type"], "steps_run": first["steps_run"]}
        if problems:
            raise RowFailed("; ".join(problems))
        return result

    return row


#: ``plan --simulate``'s strategies and the training rows that measured them
SIMULATED = (("fsdp2", "fsdp"), ("zero3", "zero3"))


def _plan_json(output: str) -> dict[str, Any]:
    """``plan --json``'s object from a command's output, stdout and stderr together: the JSON is
    written at the end in one piece, from a line that is ``{`` alone."""
    lines = output.splitlines(keepends=True)
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].rstrip("\n") == "{"), None)
    if start is None:
        raise ValueError("no JSON object in the output")
    return json.JSONDecoder().raw_decode("".join(lines[start:]))[0]


def measured_peak(row: dict[str, Any] | None, name: str) -> dict[str, Any]:
    """What training row ``name`` measured, for the simulation beside it: run.json's per-rank peak
    (``torch.cuda.max_memory_allocated`` on CUDA, the process's RSS peak on CPU), or why there is none."""
    if row is None:
        return {"measured_peak_bytes": None, "measured": f"none: the {name} row did not run in this check"}
    if not row.get("peak_memory_bytes"):
        why = f"its error: {row['error'][:200]}" if row.get("error") else "run.json had no per-rank peak"
        return {"measured_peak_bytes": None, "measured": f"none: the {name} row has no peak ({why})"}
    if row.get("device") == "cuda":
        return {"measured_peak_bytes": row["peak_memory_bytes"], "measured": f"torch.cuda.max_memory_allocated (the {name} row's run.json)"}
    return {"measured_peak_bytes": row["peak_memory_bytes"], "measured": f"process RSS peak on {row.get('device') or 'an unknown device'} (the {name} row's run.json): the whole process, no ratio"}


def simulate_row(check: Check, timeout: float) -> dict[str, Any]:
    """``acc-train plan --simulate --json`` for the check's job (``plan_args``, as the fsdp and
    zero3 rows plan it), one command per strategy, each simulated peak per rank beside the peak
    that strategy's training row measured, and simulated / measured where that is CUDA's
    allocated peak. A measured side missing is said, not failed; a simulation missing is the
    row's error, the other strategy's figures kept."""
    t0 = time.monotonic()
    # the simulation is a CPU rehearsal, as a user runs it: fake tensors, no GPU touched
    env = {**check.env, "CUDA_VISIBLE_DEVICES": ""}
    found: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    for i, (label, trained) in enumerate(SIMULATED):
        entry: dict[str, Any] = {"row": trained, **measured_peak(check.results.get(trained), trained)}
        found[label] = entry
        share = (timeout - (time.monotonic() - t0)) / (len(SIMULATED) - i)  # a hang in one leaves the next its share
        cmd = [sys.executable, "-m", "acc_train_cli", "plan", "--simulate", "--strategies", label, "--json", *plan_args(check.job)]
        t1 = time.monotonic()
        try:
            proc = check.run(cmd, share, env=env)
        except RowFailed as exc:
            entry["error"] = str(exc)
            errors.append(f"{label}: {exc}")
            continue
        entry["seconds"] = round(time.monotonic() - t1, 1)
        try:
            strategy = next(s for s in _plan_json(proc.stdout)["strategies"] if s["name"] == label) if proc.returncode == 0 else None
        except (ValueError, KeyError, TypeError, StopIteration) as exc:
            strategy, entry["error"] = None, f"plan --simulate's JSON unreadable: {exc}"
        if strategy is None:
            entry.setdefault("error", f"plan --simulate exited {proc.returncode}: {_last_line(proc.stdout)}")
            errors.append(f"{label}: {entry['error']}")
            continue
        simulated = strategy.get("simulated")
        entry["plan_bytes"] = (strategy.get("plan") or {}).get("device_total_bytes")
        if simulated is None:
            entry["error"] = strategy.get("how") or "not simulated"
            errors.append(f"{label}: {entry['error']}")
            continue
        entry["simulated_peak_bytes"] = simulated["peak_bytes"]
        entry["how"] = simulated.get("how")
        if entry["measured_peak_bytes"] and "max_memory_allocated" in entry["measured"]:
            entry["simulated_vs_measured"] = simulated["peak_bytes"] / entry["measured_peak_bytes"]
    result: dict[str, Any] = {"simulation": found}
    if errors:
        result["error"] = "; ".join(errors)
    return result


@dataclass(frozen=True)
class Row:
    name: str
    #: seconds on the H200 (the rehearsal gives each row this or 180 s, whichever is more)
    deadline: float
    run: Callable[[Check, float], dict[str, Any]]
    what: str


#: in priority order: what a cut-short check must not lose comes first
ROWS: tuple[Row, ...] = (
    Row("gpu-tests", 150, gpu_tests_row, "the suite's gpu-marked tests (the Trainer's are the trainer-* rows)"),
    Row("ddp", 60, acc_train_row("ddp", "ddp"), "acc-train --strategy ddp"),
    Row("fsdp", 60, acc_train_row("fsdp", "fsdp2"), "acc-train --strategy fsdp (FSDP2)"),
    Row("zero3", 75, acc_train_row("zero3", "zero3"), "acc-train --strategy zero3"),
    Row("handwritten", 50, handwritten_row("ddp"), "bench/handwritten_loop.py --strategy ddp: torch DDP, autocast, fused AdamW, no Accelerate"),
    Row("gc", 50, acc_train_row("ddp", "ddp", "training.gradient_checkpointing=true"), "ddp with training.gradient_checkpointing"),
    Row("lora", 50, acc_train_row("ddp", "ddp", "model.lora={r: 16}"), "ddp with model.lora (r 16, all linear layers)"),
    # rehearsing, aot_eager: the same option and row without inductor's minutes of C++ builds on a CPU
    Row("compile", 100, acc_train_row("ddp", "ddp", "training.compile=true", rehearsal_sets=("training.compile.backend=aot_eager",)),
        "ddp with training.compile (inductor; aot_eager when rehearsing)"),
    Row("zero3-fused-adam", 100, handwritten_row("zero3", "ds-fused-adam"), "hand-written ZeRO-3 with DeepSpeed's FusedAdam (its CUDA op built by nvcc)"),
    Row("trainer-fsdp", 60, trainer_row("fsdp"), "acc-train launch: HF Trainer unchanged, fsdp, save and resume"),
    Row("trainer-zero3", 70, trainer_row("zero3"), "acc-train launch: HF Trainer unchanged, zero3, save and resume"),
    # last: the rows above must not lose their time to it; it reads the fsdp and zero3 rows' peaks
    Row("simulate", 120, simulate_row, "acc-train plan --simulate for the job, fsdp2 and zero3: simulated peak per rank against the fsdp and zero3 rows' measured peak"),
)


# --- running ----------------------------------------------------------------------------------------


def install_wheels(wheels: Path, log: Callable[[str], None]) -> None:
    """The carried wheels into :data:`SITE` (no index, no resolution), put first on sys.path."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"no wheels in {wheels}: run bench/device/prepare_wheels.py here and carry bench/device/wheels")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, found)]
    log(f"$ {' '.join(cmd[:12])} ... ({len(found)} wheels)")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log(proc.stdout + proc.stderr + f"-> exit {proc.returncode} in {time.monotonic() - t0:.1f} s")
    if proc.returncode != 0:
        raise SystemExit(f"installing the wheels failed: {_last_line(proc.stdout + proc.stderr)}")
    sys.path.insert(0, str(SITE))


def environment_report(env: dict[str, str]) -> dict[str, Any]:
    """Versions the rows run on (read in a subprocess, with the rows' environment)."""
    code = (
        "import json, importlib.metadata as m, sys\n"
        "names = ['torch', 'accelerate', 'transformers', 'deepspeed', 'huggingface-hub', 'kernels', 'peft', 'datasets', 'pyarrow', 'numpy',"
        " 'pydantic', 'safetensors', 'tokenizers', 'triton', 'acc-train-core']\n"
        "v = {}\n"
        "for n in names:\n"
        "    try: v[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: v[n] = None\n"
        "import torch, acc_train\n"
        "v['python'] = sys.version.split()[0]; v['acc_train_from'] = acc_train.__file__\n"
        "v['cuda'] = torch.version.cuda; v['gpu'] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None\n"
        "print(json.dumps(v))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": _last_line(proc.stdout + proc.stderr)}


def write_results(check: Check, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    (check.out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (check.out / "results.md").write_text(results_markdown(rows, meta))


def results_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    env = meta.get("environment", {})
    job = meta["job"]
    lines = [
        f"# acc-train device check{' (rehearsal, CPU)' if meta['rehearse'] else ''}",
        "",
        f"{env.get('gpu') or platform.processor() or platform.machine()}; torch {env.get('torch')} (CUDA {env.get('cuda')}), accelerate {env.get('accelerate')}, "
        f"transformers {env.get('transformers')}, deepspeed {env.get('deepspeed')}, Python {env.get('python')}",
        f"job: model {job['model']}, {job['steps']} steps, micro-batch {job['micro_batch_size']} x {job['seq_len']} tokens, precision {job['precision']}, world size 1",
        "",
        "row | tokens/s | MFU | step ms (median) | peak GiB | plan GiB | peak/plan | loss | s | error",
        "--- | --- | --- | --- | --- | --- | --- | --- | --- | ---",
    ]
    for r in rows:
        def num(key: str, fmt: str, scale: float = 1.0) -> str:
            v = r.get(key)
            return format(v * scale, fmt) if isinstance(v, (int, float)) else ""

        error = (r.get("error") or "").replace("|", "/")
        lines.append(
            f"{r['name']} | {num('tokens_per_s', ',.0f')} | {num('mfu', '.1%')} | {num('step_time_s', '.1f', 1e3)} | {num('peak_memory_bytes', '.2f', 2**-30)} | "
            f"{num('plan_bytes', '.2f', 2**-30)} | {num('peak_vs_plan', '.2f')} | {num('loss', '.4f')} | {num('seconds', '.0f')} | {error}"
        )
    by = {r["name"]: r for r in rows}
    hw, ddp = by.get("handwritten", {}), by.get("ddp", {})
    if hw.get("step_time_s") and ddp.get("step_time_s"):
        lines += ["", f"ddp against the hand-written loop: median step time {ddp['step_time_s'] / hw['step_time_s']:.3f} (goal: within 1.02)"]
    extra = [f"- {r['name']}: {r['tests']}" for r in rows if r.get("tests")]
    return "\n".join(lines + simulation_markdown(by.get("simulate", {})) + ([""] + extra if extra else [])) + "\n"


def simulation_markdown(row: dict[str, Any]) -> list[str]:
    """The simulate row's table: each strategy's simulated peak per rank beside its training row's."""
    found = row.get("simulation")
    if not found:
        return []

    def size(v: Any) -> str:
        if not isinstance(v, (int, float)):
            return ""
        return f"{v / 2**30:.2f} GiB" if v >= 2**30 else f"{v / 2**20:.1f} MiB"

    lines = [
        "", "acc-train plan --simulate (CPU, fake tensors) against the training rows' peak per rank:", "",
        "strategy | simulated | measured | simulated/measured | plan | measured by | error",
        "--- | --- | --- | --- | --- | --- | ---",
    ]  # fmt: skip
    for label, e in found.items():
        ratio = e.get("simulated_vs_measured")
        error = (e.get("error") or "").replace("|", "/")
        lines.append(
            f"{label} ({e['row']} row) | {size(e.get('simulated_peak_bytes'))} | {size(e.get('measured_peak_bytes'))} | "
            f"{format(ratio, '.3f') if isinstance(ratio, float) else ''} | {size(e.get('plan_bytes'))} | {e['measured']} | {error}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where results.json, results.md and check.log go (the device's $OUT)")
    parser.add_argument("--rows", help=f"comma-separated rows to run (default: all, in this order): {','.join(r.name for r in ROWS)}")
    parser.add_argument("--rehearse", action="store_true", help="CPU, tiny model, few steps, no installs: the same rows")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole check, the install included (default: 360 on the device, 900 rehearsing)")
    parser.add_argument("--wheels", type=Path, default=HERE / "wheels", help="the carried wheels (device only)")
    args = parser.parse_args(argv)

    names = [r.name for r in ROWS]
    chosen = names if not args.rows else [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in names]
    if unknown:
        parser.error(f"unknown rows {', '.join(unknown)}; the rows are {', '.join(names)}")
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    # a command that runs out of time prints its Python stacks on SIGABRT (_dump_stacks), without core files
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    job = REHEARSAL_JOB if args.rehearse else DEVICE_JOB
    work = Path(tempfile.mkdtemp(prefix="acc-train-check-"))
    job = dataclasses.replace(job, cache_dir=str(work / "data-cache"))
    budget = args.budget if args.budget is not None else (900.0 if args.rehearse else 360.0)
    check = Check(args.out, job, env, budget, args.rehearse, work)
    check.log_path.write_text(f"acc-train device check, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, rows {','.join(chosen)}\n")

    env["ACC_TRAIN_CONFIG_FILE"] = str(check.work / "no-default-config.yaml")
    if args.rehearse:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        install_wheels(args.wheels, check.log)
        # the wheels, not a source checkout, and first: over the image's accelerate and transformers
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "/packages/" not in p]])
        if shutil.which("nvidia-smi"):
            with check.log_path.open("a") as log:
                subprocess.run(["nvidia-smi"], stdout=log, stderr=subprocess.STDOUT, check=False, timeout=60)
    meta: dict[str, Any] = {"rehearse": args.rehearse, "job": job.__dict__, "budget_s": budget, "environment": environment_report(env)}
    check.log(f"environment: {json.dumps(meta['environment'])}")
    results: list[dict[str, Any]] = []
    for row in (r for r in ROWS if r.name in chosen):
        result: dict[str, Any] = dict.fromkeys(FIELDS)
        result["name"] = row.name
        allowed = min(max(row.deadline, 180.0) if args.rehearse else row.deadline, check.left())
        if allowed < 10:
            result["error"] = f"not run: the check's budget ({budget:.0f} s) was spent; rerun with --rows {row.name}"
            results.append(result)
            write_results(check, results, meta)
            continue
        check.log(f"\n===== row {row.name}: {row.what} (deadline {allowed:.0f} s) =====")
        t0 = time.monotonic()
        try:
            result.update(row.run(check, allowed))
        except RowFailed as exc:
            result["error"] = str(exc)
        except Exception as exc:  # a bug in the check itself: the row records it, the others run
            result["error"] = f"{type(exc).__name__} in the check: {exc}"
        result["seconds"] = round(time.monotonic() - t0, 1)
        check.log(f"===== row {row.name}: {json.dumps(result)}")
        results.append(result)
        check.results[row.name] = result
        write_results(check, results, meta)
    meta["seconds"] = round(time.monotonic() - t_start, 1)
    write_results(check, results, meta)
    shutil.rmtree(check.work, ignore_errors=True)
    failed = [r["name"] for r in results if r.get("error")]
    print((check.out / "results.md").read_text())
    print(f"{len(results)} rows in {meta['seconds']:.0f} s; failed: {', '.join(failed) or 'none'}; details in {check.log_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
