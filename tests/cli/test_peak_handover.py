"""The launching command finds a CPU's peak once, before the workers start, in the precision
the run computes in, and hands it to them (``ACC_TRAIN_PEAK_FLOPS``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acc_train.outputs import device_peaks as P


def test_the_command_probes_a_cpu_before_launch_for_the_runs_precision(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from acc_train.config import load_job
    from acc_train_cli.main import _peak_env

    monkeypatch.setenv("ACC_TRAIN_CACHE_DIR", str(tmp_path))
    probed: list[str] = []
    monkeypatch.setattr(P, "_measure", lambda kind, precision, seconds: (probed.append(precision), (5e10, "fake"))[1])
    env = _peak_env(load_job(sets=["training.mixed_precision=no"]).config)
    handed = json.loads(env[P.PEAK_ENV])
    assert (handed["device"], handed["precision"], handed["flops"]) == ("cpu", "fp32", 5e10) and probed == ["fp32"]
    env = _peak_env(load_job(sets=["training.mixed_precision=no", "model.dtype=bf16"]).config)  # pure bf16 computes in bf16
    assert json.loads(env[P.PEAK_ENV])["precision"] == "bf16" and probed == ["fp32", "bf16"]
