"""run.json's CPU peak is the worker's own, not its parent's carried over through exec."""

from __future__ import annotations

import subprocess
import sys


def test_the_cpu_peak_is_the_processes_own_after_exec() -> None:
    probe = "from acc_train.loop.finish import peak_memory_bytes; print(peak_memory_bytes('cpu'))"
    parent = (
        "import os, sys; block = bytearray(600 * 2**20); block[::4096] = b'x' * len(block[::4096]); "  # touch 600 MiB
        f"os.execv(sys.executable, [sys.executable, '-c', {probe!r}])"
    )
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120, check=True)
    peak = int(out.stdout.strip())
    assert peak < 400 * 2**20, f"{peak / 2**20:.0f} MiB: the parent's 600 MiB counted as the child's"
