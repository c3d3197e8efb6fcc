"""`plan --simulate` held to a real run: the demo job's fsdp2 step at 2 ranks in fp32, simulated
(fake process group, fake tensors) and run for real under torchrun over gloo, measured by the
same tracker (``measure_step``), agrees part by part (``bench/bench_simulate.py``'s smallest case;
today byte for byte), at two sequence lengths: the simulation computes attention as the run does
(SDPA's ``is_causal``, no b x s x s mask; issue 41: the mask made the simulated activations
b*s^2*4*L bytes too many, +13% at seq 512)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "bench_simulate.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_simulate", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _demo_job(bench: ModuleType, seq_len: int, micro_batch: int) -> Any:
    """The demo job under fsdp2 at 2 ranks, fp32, at this shape (positions up to ``seq_len``)."""
    from acc_train.config import load_job, resolve_strategy
    from acc_train.simulate import job_under

    flags: dict[str, tuple[Any, str]] = {
        "launch.num_processes": (2, "test"),
        "training.mixed_precision": ("no", "test"),
        "data.seq_len": (seq_len, "test"),
        "training.micro_batch_size": (micro_batch, "test"),
        "model.config": ({"max_position_embeddings": max(seq_len, 1024)}, "test"),
    }
    name, options, _ = bench.STRATEGIES["fsdp2"]
    return job_under(load_job(None, flags, []), resolve_strategy(name, options))


@pytest.mark.launch
@pytest.mark.xdist_group("simulate_vs_real")
@pytest.mark.parametrize(("seq_len", "micro_batch"), [(512, 8), (2048, 1)])
def test_fsdp2_simulated_step_agrees_with_a_real_run(tmp_path: Path, seq_len: int, micro_batch: int) -> None:
    bench = _bench()
    job = _demo_job(bench, seq_len, micro_batch)
    sim = bench.simulate(job, 2, timeout=300)
    assert sim["ok"], sim["why"]
    real = bench.measure(job, 2, tmp_path, timeout=300)  # the one torchrun launch
    assert real["ok"], real["why"]
    compared = bench.compare(sim, real)
    assert sorted(map(int, compared)) == [0, 1]  # rank 0 and the last
    for rank, parts in compared.items():
        assert parts["peak"]["measured"] > 0 and parts["activations"]["measured"] > 0
        activations = parts["activations"]["diff_pct"]
        assert activations is not None and abs(activations) <= 2, f"rank {rank} activations: {parts['activations']}"
        for part, figures in parts.items():
            assert figures["diff_pct"] is not None and abs(figures["diff_pct"]) <= 5, f"rank {rank} {part}: {figures}"
