"""Memory savers without a launch: ``training.gradient_checkpointing`` on the model (same
gradients, no KV cache, a clear error where the model cannot), ``model.attn_implementation``
(refused before launch where it cannot run, recorded in run.json as used), and the plan."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from acc_train.config import load_job
from acc_train.errors import UserError
from acc_train.model.build import check_attn_implementation, check_model_builds, enable_gradient_checkpointing
from tests.conftest import run_cli

TINY = "model.config={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 2}"


def _tiny_llama() -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    return transformers.LlamaForCausalLM(cfg)


def _step(model: Any, ids: Any) -> tuple[Any, list[Any]]:
    model.train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out, [p.grad.clone() for p in model.parameters()]


def test_gradient_checkpointing_gives_the_same_gradients_without_a_kv_cache() -> None:
    import torch

    base = _tiny_llama()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    plain_out, plain_grads = _step(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    enable_gradient_checkpointing(model)
    out, grads = _step(model, ids)
    assert model.config.use_cache is False
    assert out.loss.item() == plain_out.loss.item()
    for a, b in zip(plain_grads, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert layers and all(m.gradient_checkpointing for m in layers)


def test_a_model_without_gradient_checkpointing_is_refused_naming_the_option() -> None:
    class NoCheckpointing:
        supports_gradient_checkpointing = False

    with pytest.raises(UserError) as info:
        enable_gradient_checkpointing(NoCheckpointing())
    assert info.value.where == "training.gradient_checkpointing"
    assert "turn it off" in (info.value.hint or "")


def test_flash_attention_is_refused_on_cpu_and_without_its_package() -> None:
    job = load_job(sets=["model.attn_implementation=flash_attention_2"])
    with pytest.raises(UserError) as info:
        check_attn_implementation(job.config.model, "cpu")
    assert info.value.where == "model.attn_implementation" and "CUDA" in str(info.value)
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(UserError) as info:
            check_attn_implementation(job.config.model, "cuda")
        assert "pip install flash-attn" in (info.value.hint or "")
    check_attn_implementation(load_job(sets=["model.attn_implementation=eager"]).config.model, "cpu")


def test_an_attention_the_model_does_not_know_is_refused_before_launch() -> None:
    with pytest.raises(UserError) as info:
        check_model_builds(load_job(sets=[TINY, "model.attn_implementation=nonesuch"]).config)
    assert info.value.where == "model.attn_implementation" and "nonesuch" in str(info.value)
    check_model_builds(load_job(sets=[TINY, "model.attn_implementation=eager"]).config)


def test_the_command_refuses_flash_attention_on_this_cpu_machine_with_exit_2(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CPU machine's refusal")
    proc = run_cli("--set", "model.attn_implementation=flash_attention_2", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: model.attn_implementation: flash_attention_2 runs on CUDA GPUs only" in proc.stderr
    assert not (tmp_path / "run").exists()




def _train_in_process(out: Path, *sets: str) -> dict[str, Any]:
    from accelerate.state import AcceleratorState, GradientState

    from acc_train.outputs.metrics import read_metrics
    from acc_train.trainer import check_output_dir, train

    job = load_job(
        flags={"output_dir": (str(out), "--output-dir"), "training.max_steps": (4, "--max-steps")},
        sets=[TINY, "data.seq_len=32", "data.demo_max_bytes=60000", "training.micro_batch_size=4", "training.mixed_precision=no",
              "training.progress_bar=false", "checkpoint.every=0", *sets],
    )  # fmt: skip
    check_output_dir(job)
    train(job)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return {"run": json.loads((out / "run.json").read_text()), "losses": [r["loss"] for r in read_metrics(out).steps.values()]}


def test_run_json_records_the_attention_used_and_the_checkpointed_layers(tmp_path: Path, single_process: None) -> None:
    """One process, in-process: the losses of a checkpointed run are those of the same run without
    it (fp32, recompute only); run.json says what the model ran with."""
    plain = _train_in_process(tmp_path / "plain")
    saved = _train_in_process(tmp_path / "saved", "training.gradient_checkpointing=true")
    eager = _train_in_process(tmp_path / "eager", "model.attn_implementation=eager")
    assert plain["run"]["attn_implementation"] == saved["run"]["attn_implementation"] == "sdpa"  # transformers' default for Llama
    assert eager["run"]["attn_implementation"] == "eager"
    assert plain["run"]["activation_checkpointing"] == {"transformers_layers": 0, "checkpoint_wrappers": 0}
    assert saved["run"]["activation_checkpointing"] == {"transformers_layers": 2, "checkpoint_wrappers": 0}
    assert len(saved["losses"]) == 4
    assert saved["losses"] == pytest.approx(plain["losses"], abs=1e-6)
    assert eager["losses"] == pytest.approx(plain["losses"], abs=1e-4)  # another kernel: fp32 rounding only


def test_the_plan_recomputes_activations_under_every_strategy() -> None:
    def plan(*extra: str) -> dict[str, Any]:
        proc = run_cli("plan", "--json", "--num-processes", "2", "--mixed-precision", "no", "--set", "data.seq_len=512", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    off, on = plan(), plan("--set", "training.gradient_checkpointing=true")
    assert on["gradient_checkpointing"] and not off["gradient_checkpointing"]
    before = {r["label"]: r for r in off["rows"]}
    for row in on["rows"]:
        assert row["activations_recomputed"], row["label"]
        assert row["activations"] < before[row["label"]]["activations"] or before[row["label"]]["activations_recomputed"], row["label"]
        assert row["model_state"] == before[row["label"]]["model_state"]
