"""`plan --simulate` held to a real run: the demo job's fsdp2 step at 2 ranks in fp32, simulated
(fake process group, fake tensors) and run for real under torchrun over gloo, measured by the
same tracker (``measure_step``), agrees part by part (``bench/bench_simulate.py``'s smallest case;
today byte for byte)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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


@pytest.mark.launch
@pytest.mark.xdist_group("simulate_vs_real")
def test_fsdp2_simulated_step_agrees_with_a_real_run(tmp_path: Path) -> None:
    bench = _bench()
    case = bench.Case("demo", 2, "fsdp2")
    job = bench.build_job(case)
    sim = bench.simulate(job, case.ranks, timeout=300)
    assert sim["ok"], sim["why"]
    real = bench.measure(job, case.ranks, tmp_path, timeout=300)  # the one torchrun launch
    assert real["ok"], real["why"]
    compared = bench.compare(sim, real)
    assert sorted(map(int, compared)) == [0, 1]  # rank 0 and the last
    for rank, parts in compared.items():
        assert parts["peak"]["measured"] > 0
        for part, figures in parts.items():
            assert figures["diff_pct"] is not None and abs(figures["diff_pct"]) <= 5, f"rank {rank} {part}: {figures}"
