"""MFU without a launch: FLOPs per token against a hand count and torchtitan's formula, LoRA's
frozen base, the peak table by device name, TF32 against FP32, the probe measured once and
cached, the launcher's hand-over, and real tokens (padding left out) counted per step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from acc_train.outputs import device_peaks as P
from acc_train.outputs import mfu as M

TINY = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
}  # fmt: skip


def test_flops_per_token_of_a_tiny_llama_by_hand() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    # by hand: embedding 64*32; a layer: q 32*32, k and v 32*16 each (2 kv heads of 8), o 32*32,
    # SwiGLU 3*32*64, two norms 2*32; a final norm 32; the output projection 64*32
    layer = 1024 + 512 + 512 + 1024 + 6144 + 64
    total = 2048 + 2 * layer + 32 + 2048
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    assert sum(p.numel() for p in model.parameters()) == total == 22688
    n = total - 2048  # the input embedding is a lookup, not a matrix product
    expected = 6 * n + 12 * 2 * 32 * 16  # attention: 12 * layers * hidden * seq_len
    assert expected == 136128
    assert M.model_flops_per_token(model.config, 16) == expected  # from the config alone
    assert M.model_flops_per_token(TINY, 16, total_params=total) == expected  # a dict, with the counted total
    assert M.model_flops_per_token(TINY, 32) == expected + 12 * 2 * 32 * 16  # the attention term grows with seq_len
    tied = LlamaForCausalLM(LlamaConfig(**{**TINY, "tie_word_embeddings": True}))
    # tied: the one matrix is the output projection's product, so it stays in N
    assert M.model_flops_per_token(tied.config, 16) == 6 * (total - 2048) + 12 * 2 * 32 * 16


def _torchtitan_flops(num_params: int, n_layers: int, n_heads: int, dim: int, seq_len: int) -> int:
    """torchtitan (``torchtitan/models/utils.py`` ``get_dense_model_nparams_and_flops``): 6 * N
    (without the embedding) + 12 * l * h * q * t, q = dim // n_heads."""
    return 6 * num_params + 12 * n_layers * n_heads * (dim // n_heads) * seq_len


def test_flops_per_token_of_llama_3_8b_matches_torchtitan() -> None:
    config = {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
    }  # fmt: skip
    total = 8_030_261_248  # Llama 3 8B's published parameter count
    assert M._llama_parameters(*M._architecture(config)) == total
    expected = _torchtitan_flops(total - 128256 * 4096, 32, 32, 4096, 8192)
    assert M.model_flops_per_token(config, 8192) == expected
    # 6 * 7.505e9 = 45.03e9 for the matrices, 12 * 32 * 4096 * 8192 = 12.88e9 for attention at 8k
    assert M.model_flops_per_token(config, 8192) / 1e9 == pytest.approx(57.91, abs=0.01)


def test_lora_frozen_parameters_cost_forward_and_activation_gradient(tiny_model_dir: Path) -> None:
    import transformers

    from acc_train.model.adapters import apply_lora
    from acc_train.config import load_job

    cfg = load_job(sets=[f"model.name_or_path={tiny_model_dir}", "model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj]"]).config
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    full_total, full_trainable = M.parameter_counts(base)
    assert full_total == full_trainable
    model = apply_lora(base, cfg)
    total, trainable = M.parameter_counts(model)
    c = base.config
    embedding = c.vocab_size * c.hidden_size
    adapters = trainable
    assert adapters == c.num_hidden_layers * 2 * 4 * (c.hidden_size + c.hidden_size)  # q and v: A (4x32) and B (32x4) each
    assert total == full_total + adapters
    attention = 12 * c.num_hidden_layers * c.hidden_size * 16
    frozen_matrix = full_total - embedding
    assert M.model_flops_per_token(c, 16, trainable_params=trainable, total_params=total) == 6 * adapters + 4 * frozen_matrix + attention
    full = M.model_flops_per_token(c, 16, total_params=full_total)
    assert M.model_flops_per_token(c, 16, trainable_params=trainable, total_params=total) < full
    with pytest.raises(ValueError, match="trainable_params"):
        M.model_flops_per_token(c, 16, trainable_params=total + 1, total_params=total)
    with pytest.raises(ValueError, match="seq_len"):
        M.model_flops_per_token(c, 0)


@pytest.mark.parametrize(
    ("name", "precision", "flops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
        ("NVIDIA H100 PCIe", "fp16", 756.5e12),
        ("NVIDIA H100 NVL", "bf16", 835.5e12),
        ("NVIDIA H200", "bf16", 989.5e12),
        ("NVIDIA H200 NVL", "bf16", 835.5e12),
        ("NVIDIA B200", "bf16", 2250e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-PCIE-40GB", "tf32", 156e12),
        ("NVIDIA A10G", "bf16", 125e12),  # not an A100
        ("NVIDIA L40S", "fp16", 362e12),
        ("AMD Instinct MI300X", "bf16", 1307.4e12),
        ("NVIDIA H100 80GB HBM3", "fp32", 67e12),
    ],
)
def test_peak_table_by_device_name(name: str, precision: str, flops: float) -> None:
    peak, source = P.device_peak_flops(name, precision)
    assert peak == flops
    assert "datasheet" in source and name in source and precision in source


def test_a_device_outside_the_table_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="NVIDIA GeForce GTX 1080"):
        P.device_peak_flops("NVIDIA GeForce GTX 1080", "bf16")
    with pytest.raises(ValueError, match="unknown precision"):
        P.device_peak_flops("NVIDIA H100", "int8")


def test_fp32_on_a_gpu_is_tf32_or_fp32_by_torchs_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(P, "_device_name", lambda device: ("cuda", "NVIDIA H100 80GB HBM3"))
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert P._tf32_on()
        peak, source = P.device_peak_flops("cuda", "no")
        assert peak == 494.5e12 and "TF32 matmul on" in source
        torch.backends.cuda.matmul.allow_tf32 = False
        assert not P._tf32_on()
        peak, source = P.device_peak_flops("cuda", "no")
        assert peak == 67e12 and "TF32 matmul off" in source
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_the_probe_measures_once_per_machine_and_precision(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ACC_TRAIN_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[tuple[str, str]] = []

    def measure(kind: str, precision: str, seconds: float) -> tuple[float, str]:
        calls.append((kind, precision))
        return 123e9, "fake"

    monkeypatch.setattr(P, "_measure", measure)
    first, source = P.device_peak_flops("cpu", "no")
    assert first == 123e9 and "measured now" in source and calls == [("cpu", "fp32")]
    again, source = P.device_peak_flops("cpu", "fp32")
    assert again == first and "cached in" in source and len(calls) == 1
    P.device_peak_flops("cpu", "bf16")  # another precision: measured
    assert calls[-1] == ("cpu", "bf16") and len(calls) == 2
    entries = json.loads((tmp_path / "cache" / "peak_flops.json").read_text())
    assert {e["precision"] for e in entries.values()} == {"fp32", "bf16"}
    assert all(e["model"] and e["torch"] and e["machine"] is not None for e in entries.values())
    import torch

    monkeypatch.setattr(torch, "__version__", "0.0.0-other")  # another torch: measured again
    P.device_peak_flops("cpu", "no")
    assert len(calls) == 3
    (tmp_path / "cache" / "peak_flops.json").write_text("not json")  # a damaged cache is measured over
    assert P.device_peak_flops("cpu", "no")[0] == 123e9 and len(calls) == 4


def test_the_real_probe_measures_a_plausible_cpu_peak(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ACC_TRAIN_CACHE_DIR", str(tmp_path))
    flops, how = P.probe_peak_flops("cpu", "fp32", seconds=0.3)
    assert 1e9 < flops < 1e14, flops  # more than a GFLOP/s, less than any CPU's 100 TFLOP/s
    assert "threads" in how and "measured now" in how
    assert P.probe_peak_flops("cpu", "fp32", seconds=0.3) == (flops, P.probe_peak_flops("cpu", "fp32")[1])


def test_the_launcher_hands_its_peak_to_workers_of_the_same_precision(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ACC_TRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(P, "_measure", lambda kind, precision, seconds: (7e10, "fake"))
    env = P.peak_for_workers("cpu", "no")
    monkeypatch.setenv(P.PEAK_ENV, env[P.PEAK_ENV])
    monkeypatch.setattr(P, "_measure", lambda *a: pytest.fail("a worker probed"))
    assert P.peak_from_env("cpu", "fp32")[0] == 7e10
    assert P.peak_from_env("cpu", "bf16") is None and P.peak_from_env("cuda", "fp32") is None
    monkeypatch.setenv(P.PEAK_ENV, "{broken")
    assert P.peak_from_env("cpu", "fp32") is None


def test_mfu_is_model_flops_over_peak() -> None:
    assert M.mfu(1000.0, 6e9, 1.2e13) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        M.mfu(1.0, 1.0, 0.0)
    assert M.compute_precision("no", "bf16") == "bf16" and M.compute_precision("no", "auto") == "fp32"
    assert M.compute_precision("fp16", "auto") == "fp16"


class _OneRank:
    device = "cpu"
    batch_replicas = 1
    num_processes = 1

    def reduce(self, tensor: Any, reduction: str) -> Any:
        return tensor


def test_steps_count_real_tokens_not_padding() -> None:
    import numpy as np

    from acc_train.data.rows import REAL_TOKENS, Collate, real_tokens, token_row
    from acc_train.loop.loss import step_windows

    rows = [token_row(np.arange(1, n + 1, dtype=np.int64), None, np.array([], dtype=np.int64)) for n in (3, 7, 5, 2)]
    padded = [Collate(seq_len=8, packed=False, pad_id=0)(rows[i : i + 2]) for i in (0, 2)]
    assert [b["input_ids"].numel() for b in padded] == [14, 10]  # padded to each batch's longest
    packed = [Collate(seq_len=8, packed=True, pad_id=0)(rows[i : i + 2]) for i in (0, 2)]
    assert [b[REAL_TOKENS].tolist() for b in packed] == [[3, 7], [5, 2]]
    assert [int(real_tokens(b)) for b in packed] == [10, 7]
    for batches in (padded, packed):
        out = list(step_windows(batches, 2, _OneRank()))
        assert [int(real) for _, _, real in out] == [17, 17]  # both micro-batches of the step: 3+7+5+2
        assert [int(counted) for _, counted, _ in out] == [13, 13]  # loss tokens: each row's length - 1
