"""Every cell of the support matrix (docs/reference/support-matrix.md) that can train on a CPU is
trained here: a covering set of short launches, each combining several of a row's features (a
precision, an optimizer, LoRA, gradient checkpointing, compile, streaming), on the tiny model as
hub checkpoints store it (bf16). Each launch asserts that every feature it claims took effect
(run.json says so, not only the config), that the loss falls, and that a resume from its middle
checkpoint gives the uninterrupted run's losses exactly. The cells whose columns describe a GPU
(the GPU column, fp16, adamw_8bit) and the offload rows stay with the device check.

``docs/_gen/matrix.py`` names ``test_combination_trains_and_resumes_exactly[NAME]`` for each
(row, column) in ``COMBINATIONS[NAME]``; ``tests/core/test_docs_site.py`` checks they agree and
that no accepted CPU cell is left without a test.

The data is ordered (tests/conftest.py ``ordered_data``: each line the tiny vocabulary's words
in one cyclic order), so the loss can fall within 6 steps; the word salad the other launches
train on sits at its entropy from the first step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import matrix_args, read_metrics, run_cli, stopped_copy
from tests.matrix.combinations import COMBINATIONS, ROWS, SAVED, STEPS, Combination

pytestmark = pytest.mark.launch


#: combinations whose runs tests/cli/test_plan_matches_runs.py also reads (one group: one launch each)
PLAN_RUNS = {"ddp-bf16", "ddp-pure-bf16", "fsdp2-bf16-streaming", "zero3-bf16-compile-streaming"}


def _param(name: str) -> object:
    return pytest.param(name, marks=pytest.mark.xdist_group("plan-runs" if name in PLAN_RUNS else f"matrix-{name}"))


#: what a row holds and steps (run.json's per-rank param_dtype, master_dtype) under model.dtype:
#: bf16 where it is not pure bf16: ZeRO without its bf16 mode keeps fp32 masters (stages 1-2)
#: or partitions in fp32 (stage 3), and says so in one warning (the strategy's low_precision_warning)
NOT_PURE = {"zero1": ("bfloat16", "float32"), "zero2": ("bfloat16", "float32"), "zero3": ("float32", "float32")}


def _assert_features_took_effect(summary: dict, stderr: str, combination: Combination) -> None:
    columns = combination.columns
    strategy = ROWS[combination.row][1]
    assert summary["strategy"] == strategy and summary["world_size"] == int(ROWS[combination.row][3])
    pure = "pure bf16" in columns
    assert summary["mixed_precision"] == ("no" if pure else "bf16")
    if pure:
        warning = "is not pure bf16 training" if combination.row in NOT_PURE else "no fp32 master copy"
        assert stderr.count(warning) == 1, stderr[-3000:]
    for rank in summary["per_rank"]:
        if pure:  # bf16 weights and no fp32 master copy, where the strategy has that
            assert (rank["param_dtype"], rank["master_dtype"]) == NOT_PURE.get(combination.row, ("bfloat16", "bfloat16")), rank
        else:  # bf16 compute over fp32 masters (DeepSpeed's bf16 mode keeps its module in bf16)
            assert rank["master_dtype"] == "float32", rank
        assert (rank["frozen_param_bytes"] > 0) == ("LoRA" in columns), rank
    assert summary["optimizer"]["name"] == ("sgd" if "sgd" in columns else "adamw")
    assert summary["compile"]["enabled"] == ("compile" in columns)
    if "compile" in columns:
        assert summary["compile"]["compiled"] is True and summary["compile"]["graphs"] >= 1
    checkpointed = summary["activation_checkpointing"]
    assert (checkpointed["transformers_layers"] + checkpointed["checkpoint_wrappers"] > 0) == ("gradient checkpointing" in columns)
    assert summary["data"]["streaming"] == ("streaming" in columns)
    mesh = {"hsdp 2x2": {"dp_replicate": 2, "dp_shard": 2}, "tp 2": {"tp": 2}, "fsdp 2 x tp 2": {"dp_shard": 2, "tp": 2}}.get(combination.row)
    assert (summary.get("mesh") or {}).get("shape") == mesh


@pytest.mark.parametrize("name", [_param(name) for name in sorted(COMBINATIONS)])
def test_combination_trains_and_resumes_exactly(matrix_runs, name: str, tiny_bf16_model_dir: Path, ordered_data: dict[str, Path], tmp_path: Path) -> None:
    run = matrix_runs(name)
    summary = json.loads((run / "run.json").read_text())
    _assert_features_took_effect(summary, (run.parent / "stderr.txt").read_text(), COMBINATIONS[name])
    full = read_metrics(run)
    assert sorted(full) == list(range(1, STEPS + 1))
    first, last = (full[1].loss + full[2].loss) / 2, (full[STEPS - 1].loss + full[STEPS].loss) / 2
    assert last < first - 0.1, f"{name}: the loss did not fall: {[round(full[s].loss, 4) for s in full]}"

    resumed = stopped_copy(run, tmp_path / "resumed", saved=SAVED, lost=STEPS)
    proc = run_cli(*matrix_args(tiny_bf16_model_dir, ordered_data, resumed, name, "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = read_metrics(resumed)
    assert json.loads((resumed / "run.json").read_text())["start_step"] == SAVED
    assert [s for s in again if s > SAVED] == list(range(SAVED + 1, STEPS + 1))
    for step in range(SAVED + 1, STEPS + 1):
        assert again[step].loss == pytest.approx(full[step].loss, abs=1e-6), (name, step)
