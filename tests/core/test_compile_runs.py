"""training.compile in real launches (2 CPU processes, fp32): the reference job compiled under
ddp and fsdp2 is really compiled (run.json), trains to the eager DDP reference's losses, writes
a final/ and checkpoints under the model's own names (an eager run resumes from them).

Backend ``aot_eager``: dynamo captures the graphs and AOTAutograd traces forward and backward,
as with inductor, but runs them with the same aten kernels as eager, so the launch pays no C++
compile (inductor's is benchmarked in bench/bench_compile.py). Tolerance 1e-5 on a loss of
about 4: the kernels are eager's, in fp32, so only a changed order of floating-point operations
could differ (~1e-7 relative per step, measured 0.0 here); a wrong or skipped update moves the
loss by 1e-3 or more within a step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import assert_same_losses, read_metrics, reference_args, resume_from_step_10, run_cli

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("reference-runs")]

COMPILE = ("--set", "training.compile.backend=aot_eager")
#: compiled losses against eager ones (see the module docstring)
TOLERANCE = 1e-5


def _compiled(tmp_path_factory: pytest.TempPathFactory, model: Path, data: dict[str, Path], strategy: str) -> Path:
    out = tmp_path_factory.mktemp(f"compiled-{strategy}") / "run"
    proc = run_cli(*reference_args(model, data, out, "--strategy", strategy, *COMPILE))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def compiled_ddp(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> Path:
    return _compiled(tmp_path_factory, tiny_model_dir, tiny_data, "ddp")


@pytest.fixture(scope="module")
def compiled_fsdp2(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> Path:
    return _compiled(tmp_path_factory, tiny_model_dir, tiny_data, "fsdp2")


@pytest.mark.parametrize(("strategy", "distributed_type"), [("ddp", "DistributedType.MULTI_CPU"), ("fsdp2", "DistributedType.FSDP")])
def test_compiled_run_is_compiled_and_trains_to_eagers_losses(request: pytest.FixtureRequest, ddp_run: Path, strategy: str, distributed_type: str) -> None:
    run = request.getfixturevalue(f"compiled_{strategy}")
    summary = json.loads((run / "run.json").read_text())
    assert summary["distributed_type"] == distributed_type
    if strategy == "fsdp2":
        assert summary["fsdp_version"] == 2
    compiled = summary["compile"]
    assert {k: compiled[k] for k in ("enabled", "backend", "mode", "fullgraph", "dynamic", "regional", "compiled")} == {
        "enabled": True, "backend": "aot_eager", "mode": "default", "fullgraph": False, "dynamic": None, "regional": False, "compiled": True,
    }  # fmt: skip
    assert compiled["graphs"] >= 1  # dynamo's counters in the worker: the forward really went through it
    assert json.loads((ddp_run / "run.json").read_text())["compile"] == {"enabled": False}
    assert_same_losses(read_metrics(run), read_metrics(ddp_run), abs=TOLERANCE)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_compiled_runs_final_model_has_the_models_own_names(request: pytest.FixtureRequest, ddp_run: Path, strategy: str) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = request.getfixturevalue(f"compiled_{strategy}")
    got, eager = load_file(str(run / "final" / "model.safetensors")), load_file(str(ddp_run / "final" / "model.safetensors"))
    assert sorted(got) == sorted(eager)  # no torch.compile "_orig_mod." prefix
    for key, tensor in eager.items():
        torch.testing.assert_close(got[key], tensor, atol=TOLERANCE, rtol=0, msg=key)
    AutoModelForCausalLM.from_pretrained(run / "final")  # loads with no missing or unexpected keys


def test_eager_run_resumes_a_compiled_runs_checkpoint(compiled_ddp: Path, ddp_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    resumed = resume_from_step_10(compiled_ddp, tmp_path, tiny_model_dir, tiny_data, "--strategy", "ddp")
    assert json.loads((resumed / "run.json").read_text())["compile"] == {"enabled": False}
    assert_same_losses(read_metrics(resumed), read_metrics(ddp_run), abs=TOLERANCE)
