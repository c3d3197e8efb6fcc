"""`acc-train plan` against what real runs measure: for the tiny model on 2 CPU ranks, the plan's
model-state bytes per rank agree with run.json's ``per_rank[*].model_state_bytes`` under DDP,
FSDP and ZeRO-3. The same short runs show the report that training writes when it ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli, tiny_job_args

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("plan-runs")]

#: --strategy of the run -> the plan's row for the same configuration
STRATEGIES = {"ddp": "ddp", "fsdp": "fsdp2", "zero3": "zero3"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> dict[str, tuple[Path, str]]:
    """One 2-step, 2-process run per strategy: (output dir, the command's stdout)."""
    out = {}
    for name in STRATEGIES:
        run = tmp_path_factory.mktemp(f"plan-{name}") / "run"
        args = tiny_job_args(tiny_model_dir, tiny_data, run, "--num-processes", "2", "--strategy", name, "--max-steps", "2", "--set", "checkpoint.every=0")
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[name] = (run, proc.stdout)
    return out


@pytest.fixture(scope="module")
def plan(tiny_model_dir: Path) -> dict[str, dict]:
    proc = run_cli("plan", "--json", "--model", str(tiny_model_dir), "--num-processes", "2", "--mixed-precision", "no")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["label"]: r for r in json.loads(proc.stdout)["rows"]}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_plan_agrees_with_measured_model_state(runs: dict, plan: dict, strategy: str) -> None:
    summary = json.loads((runs[strategy][0] / "run.json").read_text())
    row = plan[STRATEGIES[strategy]]
    assert summary["world_size"] == 2
    for rank in summary["per_rank"]:
        measured = rank["model_state_bytes"]
        held = measured["params"] + measured["grads"] + measured["optimizer"]
        assert row["model_state"] == pytest.approx(held, rel=0.10), (strategy, rank["rank"], measured, row)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_training_ends_with_the_summary_table_and_report_png(runs: dict, strategy: str) -> None:
    run, stdout = runs[strategy]
    assert "done: 2 steps" in stdout
    for key in ("world size", "tokens/s", "final loss", "best loss", "eval loss", "checkpoints"):
        assert key in stdout, key
    assert "step-000002 (step 2, latest)" in stdout
    assert (run / "report.png").read_bytes()[:4] == b"\x89PNG"
