"""Each device's dense peak FLOP/s in a precision: vendor figures for the common accelerators,
anything else (a CPU included) measured once per machine by a short matrix-product probe and
cached in a file (:func:`probe_peak_flops`).

Peaks are dense (no 2:4 sparsity). For a CPU the launching command measures the peak before the
workers start and hands it to them in ``ACC_TRAIN_PEAK_FLOPS`` (:func:`peak_for_workers`); a GPU's
worker looks up (or probes) its own GPU. torch is imported only when a device is asked about.
:mod:`acc_train.outputs.mfu` divides a run's FLOPs by these peaks.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

__all__ = [
    "PEAK_ENV", "PEAK_TABLE", "PRECISIONS", "device_peak_flops", "peak_cache_file", "peak_for_workers",
    "peak_from_env", "precision_name", "probe_peak_flops",
]  # fmt: skip

#: the variable the launching command hands each worker its device's peak in (JSON)
PEAK_ENV = "ACC_TRAIN_PEAK_FLOPS"

_T = 1e12
_NV = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
#: Dense peak FLOP/s by device and precision, with the datasheet they come from. Vendors print
#: tensor-core figures "with sparsity" (2:4): the dense peak is half of those. Matched against
#: the device's name (``torch.cuda.get_device_name``) in this order: the first entry whose every
#: word is in the name wins, so the more specific names come first.
PEAK_TABLE: list[tuple[tuple[str, ...], dict[str, float], str]] = [
    # H200 SXM: the H100 SXM's compute (H200 datasheet: BF16 1,979 TFLOPS with sparsity, TF32 989, FP32 67)
    (("h200", "nvl"), {"bf16": 835.5 * _T, "fp16": 835.5 * _T, "tf32": 417.5 * _T, "fp32": 60 * _T}, "NVIDIA H200 NVL datasheet (dense: half the sparsity figures)"),
    (("h200",), {"bf16": 989.5 * _T, "fp16": 989.5 * _T, "tf32": 494.5 * _T, "fp32": 67 * _T}, "NVIDIA H200 SXM datasheet (dense: half the sparsity figures)"),
    (("h100", "nvl"), {"bf16": 835.5 * _T, "fp16": 835.5 * _T, "tf32": 417.5 * _T, "fp32": 60 * _T}, f"NVIDIA H100 NVL datasheet, {_NV} (dense)"),
    (("h100", "pcie"), {"bf16": 756.5 * _T, "fp16": 756.5 * _T, "tf32": 378 * _T, "fp32": 51 * _T}, f"NVIDIA H100 PCIe datasheet, {_NV} (dense)"),
    (("h100",), {"bf16": 989.5 * _T, "fp16": 989.5 * _T, "tf32": 494.5 * _T, "fp32": 67 * _T}, f"NVIDIA H100 SXM datasheet, {_NV} (dense)"),
    (("b200",), {"bf16": 2250 * _T, "fp16": 2250 * _T, "tf32": 1100 * _T, "fp32": 75 * _T}, "NVIDIA HGX B200 datasheet, per GPU (dense: half the sparsity figures)"),
    (("a100",), {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T, "fp32": 19.5 * _T}, "NVIDIA A100 datasheet (dense; SXM and PCIe alike)"),
    (("l40s",), {"bf16": 362 * _T, "fp16": 362 * _T, "tf32": 183 * _T, "fp32": 91.6 * _T}, "NVIDIA L40S datasheet (dense: half the sparsity figures)"),
    # A10G (AWS g5) is sold without a datasheet of its own; the A10's figures, as Lightning's throughput table takes them
    (("a10g",), {"bf16": 125 * _T, "fp16": 125 * _T, "tf32": 62.5 * _T, "fp32": 31.2 * _T}, "NVIDIA A10 datasheet (A10G: AWS's A10; dense)"),
    (("mi300x",), {"bf16": 1307.4 * _T, "fp16": 1307.4 * _T, "tf32": 653.7 * _T, "fp32": 163.4 * _T}, "AMD Instinct MI300X datasheet (dense matrix)"),
]

#: precisions a peak is asked for in; ``no`` (Accelerate's word) is fp32
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")


def precision_name(precision: str) -> str:
    """``no`` (Accelerate's fp32) -> ``fp32``; ``bf16``, ``fp16``, ``tf32``, ``fp32`` as they are."""
    name = {"no": "fp32", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(precision, precision)
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} (one of no, {', '.join(PRECISIONS)})")
    return name


def _tf32_on() -> bool:
    """Whether fp32 matrix products run on TF32 tensor cores in this process (torch's switch)."""
    import torch

    try:
        fp32_precision = torch.backends.cuda.matmul.fp32_precision  # torch >= 2.9
        if fp32_precision in ("tf32", "ieee"):
            return fp32_precision == "tf32"
    except (AttributeError, RuntimeError):
        pass
    return bool(torch.backends.cuda.matmul.allow_tf32)


def _device_name(device: Any) -> tuple[str, str]:
    """(device type, its name): ``cuda`` devices by ``torch.cuda.get_device_name``, a CPU by
    its model name; a plain name (``"NVIDIA H100 80GB HBM3"``) is taken as a GPU's."""
    text = str(device)
    kind = text.split(":")[0]
    if kind == "cuda":
        import torch

        index = int(text.split(":")[1]) if ":" in text else torch.cuda.current_device()
        return "cuda", torch.cuda.get_device_name(index)
    if kind == "cpu":
        return "cpu", _cpu_model()
    return "named", text


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _table_lookup(name: str) -> tuple[dict[str, float], str] | None:
    words = name.lower().replace("-", " ").split()
    joined = " ".join(words)
    for keys, peaks, source in PEAK_TABLE:
        if all(any(k in w for w in words) or k in joined for k in keys):
            return peaks, source
    return None


def device_peak_flops(device: Any, precision: str) -> tuple[float, str]:
    """The dense peak FLOP/s of one device in ``precision`` (``bf16``, ``fp16``, ``no``/``fp32``,
    ``tf32``), and where the figure comes from.

    ``device``: a ``torch.device`` or its string (``cuda``, ``cuda:1``, ``cpu``), or a device's
    name. fp32 on a GPU in the table is TF32's peak where torch's TF32 switch for matrix
    products is on, FP32's where it is off; ``source`` says which. A device the table lacks (a
    CPU included) is measured by :func:`probe_peak_flops`, cached per machine.
    """
    name = precision_name(precision)
    kind, device_name = _device_name(device)
    found = _table_lookup(device_name) if kind != "cpu" else None
    if found is not None:
        peaks, source = found
        if name == "fp32" and kind == "cuda":
            on = _tf32_on()
            name = "tf32" if on else "fp32"
            source += f"; fp32 compute with torch's TF32 matmul {'on: the TF32 peak' if on else 'off: the FP32 peak'}"
        return peaks[name], f"{device_name}, {name} dense peak: {source}"
    if kind == "named":
        raise ValueError(f"no peak is known for a device named {device_name!r} (known: {', '.join(' '.join(k) for k, _, _ in PEAK_TABLE)})")
    flops, cache = probe_peak_flops(kind, name)
    return flops, f"{device_name}, {name}: measured by a matrix-product probe ({cache})"


def peak_cache_file() -> Path:
    """The probe's cache: ``$ACC_TRAIN_CACHE_DIR`` or the user cache directory, ``acc-train/peak_flops.json``."""
    base = os.environ.get("ACC_TRAIN_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "acc-train")
    return Path(base) / "peak_flops.json"


def _probe_key(kind: str, precision: str) -> dict[str, Any]:
    import torch

    name = _device_name(kind)[1] if kind == "cpu" else torch.cuda.get_device_name()
    return {
        "machine": platform.node(),
        "device": kind,
        "model": name,
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads() if kind == "cpu" else None,
        "torch": torch.__version__,
        "precision": precision,
    }


def _best_rate(torch: Any, kind: str, dtype: Any, sizes: tuple[int, ...], seconds: float) -> float:
    """The best FLOP/s of single square products of ``sizes`` over about ``seconds``."""
    device = torch.device("cuda" if kind == "cuda" else "cpu")
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        torch.mm(a, b)  # warm-up: kernels chosen, pages touched
        deadline = time.perf_counter() + seconds / len(sizes)
        slowest = 0.0
        while True:
            if kind == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.mm(a, b)
            if kind == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            slowest = max(slowest, dt)
            best = max(best, 2 * n**3 / max(dt, 1e-9))
            if time.perf_counter() > deadline:
                break
        if slowest > seconds / (4 * len(sizes)):  # the next size (8x the work) would overrun the budget
            break
    return best


def _measure(kind: str, precision: str, seconds: float) -> tuple[float, str]:
    """(peak FLOP/s, how it was measured). A CPU: the best rate of one core on products small
    enough to finish inside an idle time slice, times the threads torch computes with (a
    whole-machine product on a shared machine measures the other jobs as much as the CPU; GEMM
    scales with cores). A GPU: the best rate of large products."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if kind == "cuda":
        return _best_rate(torch, kind, dtype, (2048, 4096, 8192), seconds), "best of square products up to 8192"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        per_core = _best_rate(torch, kind, dtype, (256, 512, 1024), seconds)
    finally:
        torch.set_num_threads(threads)
    return per_core * threads, f"best single-core rate of square products up to 1024 x {threads} threads"


def probe_peak_flops(kind: str = "cpu", precision: str = "fp32", *, seconds: float = 1.5) -> tuple[float, str]:
    """This machine's matrix-product peak in ``precision``: measured once (the best rate of
    about ``seconds`` of square products, see :func:`_measure`) and cached in
    :func:`peak_cache_file`, keyed by machine, device model, CPU count, torch's threads, torch's
    version and precision (remove the file to measure again). Returns (FLOP/s, how it was measured and
    whether now or from the cache)."""
    precision = precision_name(precision)
    key = _probe_key(kind, precision)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = peak_cache_file()
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entry = entries.get(digest)
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
        return float(entry["flops"]), f"{entry.get('how', 'measured')}, {entry.get('measured_at', '')}; cached in {path}"
    flops, how = _measure(kind, precision, seconds)
    entries[digest] = {**key, "flops": flops, "how": how, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        return flops, f"{how}; measured now (cache not writable)"
    return flops, f"{how}; measured now, cached in {path}"


def peak_for_workers(device_type: str, precision: str) -> dict[str, str]:
    """The variable the launching command hands its workers: this machine's peak per device in
    the run's compute precision, measured (or read from the cache) here, once, before launch.
    Empty when it cannot be had (a GPU not in the table on a machine without one here): the
    workers then find it themselves."""
    try:
        flops, source = device_peak_flops(device_type, precision)
    except (ValueError, RuntimeError, AssertionError):
        return {}
    return {PEAK_ENV: json.dumps({"device": device_type, "precision": precision_name(precision), "flops": flops, "source": source})}


def peak_from_env(device_type: str, precision: str) -> tuple[float, str] | None:
    """The peak the launching command handed this worker, if it was for this device type and
    precision (a worker started some other way finds none)."""
    raw = os.environ.get(PEAK_ENV)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        if data["device"] == device_type and data["precision"] == precision_name(precision) and float(data["flops"]) > 0:
            return float(data["flops"]), str(data["source"])
    except (ValueError, KeyError, TypeError):
        pass
    return None
