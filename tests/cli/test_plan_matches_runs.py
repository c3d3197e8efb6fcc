"""`acc-train plan` against what real runs measure: for the tiny model on 2 CPU ranks, the plan's
model-state bytes per rank agree with run.json's ``per_rank[*].model_state_bytes`` under DDP,
FSDP and ZeRO-3. The same short runs show the report that training writes when it ends.

The tiny model stored in bf16 (as hub checkpoints are) trains with fp32 masters under every
strategy (``model.dtype: auto``, bf16 mixed precision), as run.json's measured ``param_dtype`` and
``master_dtype`` show, and the plan agrees with it; pure bf16 happens only when asked for."""

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


#: the bf16-stored model under ``model.dtype: auto`` and bf16 mixed precision, by --strategy: what
#: each rank holds and what its optimizer steps (DeepSpeed's bf16 mode casts the module and
#: steps fp32 master partitions; DDP and FSDP hold fp32 parameters and autocast)
BF16_STORED = {"ddp": ("float32", "float32"), "fsdp": ("float32", "float32"), "zero3": ("bfloat16", "float32")}


#: --strategy -> the support matrix's combination that trains the bf16-stored model under it in bf16
#: mixed precision (tests/matrix/combinations.py: 6 steps, and its own features beside; its
#: resume is tested in tests/matrix/test_cells.py), and "pure-ddp" the one in pure bf16
BF16_RUNS = {"ddp": "ddp-bf16", "fsdp": "fsdp2-bf16-streaming", "zero3": "zero3-bf16-compile-streaming", "pure-ddp": "ddp-pure-bf16"}


@pytest.fixture(scope="module")
def bf16_runs(matrix_runs) -> dict[str, tuple[Path, str]]:
    """The bf16-stored model on 2 processes: one run per strategy in bf16 mixed precision
    (``model.dtype: auto``), and one DDP run in pure bf16 (``model.dtype: bf16``): (output
    dir, what the command printed on stderr)."""
    runs = {}
    for name, combination in BF16_RUNS.items():
        out = matrix_runs(combination)
        runs[name] = (out, (out.parent / "stderr.txt").read_text())
    return runs


@pytest.fixture(scope="module")
def bf16_plans(tiny_bf16_model_dir: Path) -> dict[str, dict[str, dict]]:
    """The plan of the bf16-stored model in bf16 mixed precision, and in pure bf16."""
    plans = {}
    for name, args in (("mixed", ("--mixed-precision", "bf16")), ("pure", ("--set", "model.dtype=bf16"))):
        proc = run_cli("plan", "--json", "--model", str(tiny_bf16_model_dir), "--num-processes", "2", *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        plans[name] = {r["label"]: r for r in json.loads(proc.stdout)["rows"]}
    return plans


def _assert_plan_agrees(summary: dict, row: dict) -> None:
    for rank in summary["per_rank"]:
        measured = rank["model_state_bytes"]
        held = measured["params"] + measured["grads"] + measured["optimizer"]
        assert row["model_state"] == pytest.approx(held, rel=0.10), (rank["rank"], measured, row)


@pytest.mark.parametrize("strategy", sorted(BF16_STORED))
def test_a_bf16_checkpoint_trains_with_fp32_masters_and_the_plan_agrees(bf16_runs: dict, bf16_plans: dict, strategy: str) -> None:
    summary = json.loads((bf16_runs[strategy][0] / "run.json").read_text())
    assert summary["mixed_precision"] == "bf16" and summary["world_size"] == 2 and summary["strategy"].startswith(strategy)
    param_dtype, master_dtype = BF16_STORED[strategy]
    for rank in summary["per_rank"]:
        assert (rank["param_dtype"], rank["master_dtype"]) == (param_dtype, master_dtype), rank
    _assert_plan_agrees(summary, bf16_plans["mixed"][STRATEGIES[strategy]])
    assert "no fp32 master copy" not in bf16_runs[strategy][1]  # no pure-bf16 warning unless asked


def test_pure_bf16_only_when_asked_with_one_warning_and_the_plan_agrees(bf16_runs: dict, bf16_plans: dict) -> None:
    run, stderr = bf16_runs["pure-ddp"]
    summary = json.loads((run / "run.json").read_text())
    assert summary["mixed_precision"] == "no"
    for rank in summary["per_rank"]:
        assert (rank["param_dtype"], rank["master_dtype"]) == ("bfloat16", "bfloat16"), rank
        assert rank["model_state_bytes"]["params"] == summary["model_parameters"] * 2
    assert stderr.count("no fp32 master copy") == 1, stderr[-3000:]
    _assert_plan_agrees(summary, bf16_plans["pure"]["ddp"])


def _final_dtypes(run: Path) -> set[str]:
    from safetensors import safe_open

    dtypes = set()
    for file in (run / "final").glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            dtypes |= {str(f.get_slice(name).get_dtype()) for name in f.keys()}
    return dtypes


@pytest.mark.parametrize("strategy", sorted(BF16_STORED))
def test_final_is_written_in_the_dtype_the_model_was_stored_in(bf16_runs: dict, runs: dict, strategy: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    final = bf16_runs[strategy][0] / "final"  # trained with fp32 masters (model.dtype: auto), stored in bf16
    assert _final_dtypes(bf16_runs[strategy][0]) == {"BF16"}
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(final).dtype == torch.bfloat16
    if strategy in runs:  # the fp32-stored model stays fp32
        assert _final_dtypes(runs[strategy][0]) == {"F32"}
