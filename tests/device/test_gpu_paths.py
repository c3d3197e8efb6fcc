"""The paths only a CUDA GPU takes (issue 26, item 4), read against Accelerate's and DeepSpeed's
GPU paths: device placement, fused AdamW, sdpa and flash attention, DeepSpeed's CUDA ops and
accelerator, NCCL, CUDA peak memory and RNG state, and the offload presets whose optimizer steps
on the CPU while the model trains on the GPU. Skipped without a GPU (conftest); the device check's
``gpu-tests`` row runs them on a lent H200 (at world size 1: every GPU the machine has)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import run_cli, tiny_job_args

pytestmark = pytest.mark.gpu

PROGRAMS = Path(__file__).resolve().parent.parent / "launch_programs"


def gpus() -> str:
    import torch

    return str(torch.cuda.device_count())


# --- in process ------------------------------------------------------------------------------------


def test_adamw_is_fused_on_cuda_and_steps_there() -> None:
    """acc-train's adamw is torch's fused kernel on CUDA (one launch per step), as run.json says."""
    import torch

    from acc_train.config.schema import OptimizerConfig
    from acc_train.model.optimizer import AdamW

    p = torch.nn.Parameter(torch.ones(4, 4, device="cuda"))
    kind = AdamW()
    opt = kind.build([{"params": [p], "weight_decay": 0.0}], OptimizerConfig(betas=[0.9, 0.95], eps=1e-8), torch.device("cuda", 0))
    assert kind.describe(opt) == {"implementation": "fused"}
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    assert p.device.type == "cuda" and torch.all(p < 1)
    assert opt.state[p]["exp_avg"].device.type == "cuda"


def test_sdpa_in_bf16_on_cuda_matches_eager() -> None:
    """transformers' sdpa (torch's flash or memory-efficient kernel on the GPU) against eager
    attention under bf16 autocast: the kernels acc-train's demo and real jobs use by default."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    sdpa = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).cuda()
    eager = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="eager")).cuda()
    eager.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        a, b = sdpa(input_ids=ids).logits.float(), eager(input_ids=ids).logits.float()
    assert sdpa.config._attn_implementation == "sdpa"
    torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
    # torch's own flash kernel takes these shapes in bf16 (head_dim 32)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.isfinite(out).all()


def test_flash_attention_2_needs_its_package_on_a_gpu() -> None:
    """On CUDA, flash_attention_2 is refused before launch when flash-attn is missing (naming
    it), and accepted where it is installed."""
    import importlib.util

    from acc_train.config.schema import ModelConfig
    from acc_train.errors import UserError
    from acc_train.model.build import check_attn_implementation

    mcfg = ModelConfig(attn_implementation="flash_attention_2")
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(UserError, match="flash-attn"):
            check_attn_implementation(mcfg, "cuda")
    else:
        check_attn_implementation(mcfg, "cuda")


def test_deepspeed_runs_on_cuda_and_builds_its_fused_adam() -> None:
    """DeepSpeed's accelerator is CUDA with NCCL (not the CPU accelerator acc-train's CPU runs
    use), and its FusedAdam CUDA op builds with the machine's nvcc and steps."""
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    assert accelerator.device_name() == "cuda"
    assert accelerator.communication_backend_name() == "nccl"
    from deepspeed.ops.adam import FusedAdam

    p = torch.nn.Parameter(torch.ones(1024, device="cuda"))
    opt = FusedAdam([p], lr=1e-2, adam_w_mode=True)
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.all(p < 1)


def test_cuda_rng_state_is_captured_and_restored() -> None:
    """Checkpoints carry the CUDA generator once CUDA is initialised, so a resume draws the same
    dropout masks on the GPU."""
    import torch

    from acc_train.checkpoint.rng import capture_rng, restore_rng

    torch.cuda.init()
    as_json, tensors = capture_rng()
    assert "cuda" in tensors
    first = torch.rand(4, device="cuda")
    restore_rng(as_json, tensors)
    torch.testing.assert_close(torch.rand(4, device="cuda"), first)


# --- launched ---------------------------------------------------------------------------------------


@pytest.mark.launch
@pytest.mark.xdist_group("gpu-launches")
def test_a_bf16_ddp_run_trains_on_the_gpu(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """bf16 on the GPU: parameters and batches on CUDA, fused AdamW, sdpa attention, and the peak
    memory is CUDA's allocator's (not the process's RSS)."""
    import torch

    out = tmp_path / "run"
    args = tiny_job_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", "--num-processes", gpus(), "--max-steps", "4")
    args[args.index("--mixed-precision") + 1] = "bf16"
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["device"] == "cuda"
    assert summary["optimizer"]["implementation"] == "fused"
    assert summary["attn_implementation"] == "sdpa"
    total = torch.cuda.get_device_properties(0).total_memory
    for rank in summary["per_rank"]:
        assert 0 < rank["peak_memory_bytes"] < total
    assert math.isfinite(summary["final_loss"])


@pytest.mark.launch
@pytest.mark.xdist_group("gpu-launches")
@pytest.mark.parametrize(("strategy", "distributed_type"), [("ddp", "MULTI_GPU"), ("fsdp", "FSDP"), ("zero3", "DEEPSPEED")])
def test_a_launched_program_gets_nccl_and_the_gpu(strategy: str, distributed_type: str) -> None:
    """``acc-train launch`` on GPUs: Accelerate's own GPU path (no CPU switch) with NCCL; the
    model and every batch on CUDA, bf16 as asked."""
    proc = run_cli("--strategy", strategy, "--num-processes", gpus(), "--mixed-precision", "bf16", "launch", str(PROGRAMS / "device_report.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    assert ranks, proc.stdout[-2000:]
    for r in ranks:
        if r["world"] > 1 or strategy != "ddp":
            assert r["type"] == distributed_type
        assert "nccl" in (r["backend"] or "nccl")  # fsdp's is "cuda:nccl,cpu:gloo"; world size 1 under ddp may run without a group
        assert (r["device"], r["param_device"], r["batch_device"]) == ("cuda", "cuda", "cuda")
        assert r["mixed_precision"] == "bf16"
        assert len(r["losses"]) == 8 and all(math.isfinite(x) for x in r["losses"])


@pytest.mark.launch
@pytest.mark.xdist_group("gpu-launches")
@pytest.mark.parametrize("preset", ["fsdp-offload", "zero3-offload"])
def test_offload_presets_train_on_the_gpu(preset: str, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> None:
    """The optimizer steps on the CPU while the model computes on the GPU: FSDP2's CPU offload
    with acc-train's AdamW (built for the run's CUDA device, stepping CPU-resident parameters),
    and ZeRO-3's, where Accelerate swaps it for DeepSpeed's CPU Adam (a C++ op built on first use)."""
    out = tmp_path / "run"
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, out, "--strategy", preset, "--num-processes", gpus(), "--max-steps", "4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "run.json").read_text())
    assert summary["device"] == "cuda"
    assert math.isfinite(summary["final_loss"])
