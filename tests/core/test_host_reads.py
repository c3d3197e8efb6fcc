"""A step that neither logs, evaluates nor saves never waits for the accelerator (issue 32).

A plugin (a real distribution with an ``acc_train`` entry point, found as installed ones are)
counts, on every rank, each read of a tensor's value on the host between ``acc_train_step_end``
of two steps: ``aten._local_scalar_dense`` (``item``, ``float``, ``int``, ``bool``, indexing into
Python) through a dispatch mode, and ``Tensor.tolist``, ``numpy`` and ``cpu``. On a CPU these cost
nothing, but each one is a place where, on a GPU, the host would block until the device has run
everything queued. Each read is named by its innermost frame outside torch's wrappers and the
innermost frame outside torch, so a failure says where the read came from.

Allowed, by name, are reads of tensors that stay on the CPU on a GPU machine too, and a strategy
library's own checks that its hand-written loop makes as well:

- ``torch/optim``: the optimizer's step counters (``state["step"]``, CPU tensors by default);
- ``acc_train/launch/stop_signals.py``: the ranks' stop flags, host tensors all-reduced over gloo;
- ``deepspeed/runtime/utils.py``: DeepSpeed's overflow check of the gradient norm
  (``is_invalid_grad_norm``), which ``engine.step()`` makes under any loop;
- ``deepspeed/runtime/zero/``: ZeRO-3's checks that the ranks agree on the parameters they
  fetch (``assert_ints_same_as_other_ranks``), inside its forward and backward under any loop.

On the loop before issue 32 the ddp case fails, naming ``loop/loss.py`` (the token counts),
``loop/loop.py`` (the stop flags and the loss) and ``transformers/masking_utils.py`` (the packed
boundaries inferred from the position ids on every forward). Before issue 41 the demo job and
padded rows still failed in ``transformers/masking_utils.py``: transformers' own position ids
checked for restarts, and the padding mask checked for padding, on every forward.

The ``gpu``-marked test does the same on a GPU with ``torch.cuda.set_sync_debug_mode("error")``,
where every synchronizing call raises.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_cli, tiny_job_args

pytestmark = pytest.mark.launch

PROBE = '''
import json, os, sys, traceback
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from acc_train import hookimpl

FIRST, LAST = (int(x) for x in os.environ["HOST_READS_STEPS"].split("-"))
OUT = os.environ["HOST_READS_OUT"]
SITES = []
WRAPPERS = ("torch/utils/_python_dispatch", "torch/_tensor.py", "torch/overrides.py", "torch/_compile", "torch/_dynamo", "host_reads_probe")


def site():
    frames = traceback.extract_stack()[:-2]
    inner = next((f for f in reversed(frames) if not any(w in f.filename for w in WRAPPERS)), frames[-1])
    caller = next((f for f in reversed(frames) if "/torch/" not in f.filename and "host_reads_probe" not in f.filename), inner)
    short = lambda f: "/".join(f.filename.split("/")[-4:]) + ":" + str(f.lineno)
    return short(inner) + " <- " + short(caller)


class Reads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            SITES.append(site())
        return func(*args, **(kwargs or {}))


def counting(name):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        SITES.append(site() + " [" + name + "]")
        return original(self, *args, **kwargs)

    return original, read


MODE = None
PATCHED = {}


@hookimpl
def acc_train_step_end(run, step, metrics):
    global MODE
    if step == FIRST - 1:
        MODE = Reads()
        MODE.__enter__()
        if os.environ.get("HOST_READS_CUDA_ERROR"):  # every synchronizing CUDA call raises
            torch.cuda.set_sync_debug_mode("error")
        for name in ("tolist", "numpy", "cpu"):
            PATCHED[name], patched = counting(name)
            setattr(torch.Tensor, name, patched)
    elif step == LAST and MODE is not None:
        if os.environ.get("HOST_READS_CUDA_ERROR"):
            torch.cuda.set_sync_debug_mode(0)
        MODE.__exit__(None, None, None)
        MODE = None
        for name, original in PATCHED.items():
            setattr(torch.Tensor, name, original)
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(OUT, f"rank-{rank}.json"), "w") as f:
            json.dump(SITES, f)
'''

#: where reads of tensors that stay on the host (or DeepSpeed's own overflow check) come from
ALLOWED = ("torch/optim/", "acc_train/launch/stop_signals.py", "deepspeed/runtime/utils.py", "deepspeed/runtime/zero/")


def install_probe(folder: Path) -> Path:
    """The probe as an installed plugin distribution in ``folder`` (put it on PYTHONPATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = folder / "host_reads_probe-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: host-reads-probe\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[acc_train]\nhost-reads = host_reads_probe\n")
    (folder / "host_reads_probe.py").write_text(textwrap.dedent(PROBE))
    return folder


def unexplained(sites: list[str]) -> list[str]:
    """Reads that are not one of :data:`ALLOWED` (judged by the frame that made them)."""
    return [s for s in sites if not any(a in s.split(" <- ")[0] for a in ALLOWED)]


#: the built-in demo job, small: continuous text whose rows never restart (no position ids, no mask)
DEMO_JOB = ("--set", "data.seq_len=32", "--set", "data.demo_max_bytes=60000", "--micro-batch-size", "4", "--mixed-precision", "no", "--set", "training.progress_bar=false")


def probed_run(tmp_path: Path, model: Path | None, data: dict[str, Path] | None, *args: str, cuda_error: bool = False) -> tuple[Path, dict[int, list[str]]]:
    """A 12-step run with the probe over steps 3-9 (``read_every`` is 10 and nothing evaluates
    or saves before step 10; the loop reads once at the run's first step, for the progress bar,
    and the probe starts after it, at step 2's end): its output directory and each rank's reads. Without a model and
    data: the demo job."""
    probe = install_probe(tmp_path / "probe")
    reads = tmp_path / "reads"
    reads.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH", "")])),
        "HOST_READS_STEPS": "3-9",
        "HOST_READS_OUT": str(reads),
        **({"HOST_READS_CUDA_ERROR": "1"} if cuda_error else {}),
    }
    out = tmp_path / "run"
    steps = ("--max-steps", "12", "--set", "checkpoint.every=0", "--set", "training.eval_every=0")
    job = tiny_job_args(model, data, out, *steps, *args) if model is not None and data is not None else [*DEMO_JOB, "--output-dir", str(out), *steps, *args]
    proc = run_cli(*job, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sites = {int(f.stem.split("-")[1]): json.loads(f.read_text()) for f in reads.glob("rank-*.json")}
    return out, sites


def assert_rows_for_every_step(out: Path, steps: int) -> None:
    """Reading less often loses nothing: a row per step, each with its loss, norm and tokens."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in rows if "loss" in r]
    assert [r["step"] for r in training] == list(range(1, steps + 1))
    assert all(r["grad_norm"] is not None and r["tokens"] > 0 for r in training)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_steps_that_neither_log_evaluate_nor_save_read_nothing_back(strategy: str, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    out, sites = probed_run(tmp_path, tiny_model_dir, tiny_data, "--strategy", strategy, "--num-processes", "2")
    assert sorted(sites) == [0, 1]
    for rank, found in sites.items():
        assert unexplained(found) == [], f"rank {rank} read the device back on steps 3-9 at: {sorted(set(unexplained(found)))}"
    assert_rows_for_every_step(out, 12)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_steps_that_neither_log_evaluate_nor_save_never_synchronize_the_gpu(strategy: str, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """torch raises at any synchronizing CUDA call on steps 3-9 (DeepSpeed's own overflow check
    synchronizes under zero3 in any loop, so zero3 is counted by the CPU test only)."""
    out, sites = probed_run(tmp_path, tiny_model_dir, tiny_data, "--strategy", strategy, "--num-processes", "1", cuda_error=True)
    assert unexplained(sites[0]) == []
    assert_rows_for_every_step(out, 12)


@pytest.mark.parametrize("job", ["demo", "padded"])
def test_the_demo_and_padded_rows_read_nothing_back(job: str, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """Issue 41: the demo's rows never restart, so the loop gives no position ids; transformers 5
    then made its own and checked on every forward whether they restart
    (``masking_utils.find_packed_sequence_indices``); padded rows (``data.packing=false``) were
    checked for padding. One process: the reads are per forward, whatever the world size."""
    if job == "demo":
        out, sites = probed_run(tmp_path, None, None, "--strategy", "ddp", "--num-processes", "1")
    else:
        out, sites = probed_run(tmp_path, tiny_model_dir, tiny_data, "--strategy", "ddp", "--num-processes", "1", "--set", "data.packing=false")
    assert sorted(sites) == [0]
    assert unexplained(sites[0]) == [], f"the {job} job read the device back on steps 3-9 at: {sorted(set(unexplained(sites[0])))}"
    assert_rows_for_every_step(out, 12)
