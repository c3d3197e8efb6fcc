"""A strategy plugin states its own memory plan through ``StrategyPlanner.plan_memory``; one that does
not gets a full replica per rank. Runs `acc-train plan`'s planner in-process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from acc_train import Strategy, StrategyPlanner, hookimpl, plugins
from acc_train.config import load_job
from acc_train.memory.plan import MemoryPlan, PlanInput


@pytest.fixture(autouse=True)
def fresh_plugins() -> Iterator[None]:
    plugins.reset()
    yield
    plugins.reset()


class Replicated(Strategy):
    name = "plan-replicated"
    presets = {"plan-replicated-big": {}}

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        return {}


class HalfPlanner(StrategyPlanner):
    def plan_memory(self, plan: PlanInput) -> MemoryPlan:
        return MemoryPlan(4 * plan.parameters, 0, 12 * plan.parameters // 2, "4psi + 12psi/2", offload={"optimizer": "cpu"}, note="mine")


class HalfSharded(Strategy):
    name = "plan-half"

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        return {}

    def planner(self) -> StrategyPlanner:
        return HalfPlanner(self)


class BrokenPlanner(StrategyPlanner):
    def plan_memory(self, plan: PlanInput) -> MemoryPlan:
        raise RuntimeError("no idea")


class BrokenPlan(Strategy):
    name = "plan-broken"

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        return {}

    def planner(self) -> StrategyPlanner:
        return BrokenPlanner(self)


class Plugin:
    @hookimpl
    def acc_train_register_strategies(self, register: Any) -> None:
        for s in (Replicated(), HalfSharded(), BrokenPlan()):
            register(s)


def test_plugins_state_their_own_plan_and_the_default_is_a_replica(capsys: pytest.CaptureFixture[str]) -> None:
    from acc_train_cli.plan import build_plan

    plugins.get_plugin_manager().register(Plugin(), name="plan-test")
    job = load_job(flags={"strategy.name": ("plan-half", "--strategy"), "launch.num_processes": (2, "--num-processes")}, sets=["training.mixed_precision=no"])
    data = build_plan(job)
    rows = {r["label"]: r for r in data["rows"]}
    psi = data["parameters"]
    assert rows["plan-replicated-big"]["model_state"] == 16 * psi  # presets are the rows; the default accounting
    assert rows["plan-half"]["job"] and rows["plan-half"]["formula"] == "4psi + 12psi/2"
    assert rows["plan-half"]["offloaded"] == 6 * psi and rows["plan-half"]["device_total"] == 4 * psi + rows["plan-half"]["activations"]
    assert "plan-broken" not in rows  # one plugin's failure leaves the others' rows
    assert "could not plan 'plan-broken'" in capsys.readouterr().err


def _stored_activation_bytes(model: Any, ids: Any) -> int:
    """Bytes autograd keeps for backward in one forward and loss (each storage once, the
    parameters left out): what the plan's activation estimate is about, measured."""
    import torch

    kept: dict[int, int] = {}

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, use_cache=False)  # transformers' own loss, as a run computes it
    return sum(n for ptr, n in kept.items() if ptr not in params)


#: small models of the three layer kinds the estimate counts (Llama; Gemma-2: sandwich norms, eager
#: attention with softcapped scores, softcapped logits; Mixtral: routed experts), kv heads fewer than heads
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8, "num_key_value_heads": 2},
    "gemma2": {
        "model_type": "gemma2", "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 48, "sliding_window": 4096, "query_pre_attn_scalar": 48, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    },
    "mixtral": {
        "model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
        "num_local_experts": 8, "num_experts_per_tok": 2,
    },
}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "attn", "precision"),
    [("llama", "sdpa", "bf16"), ("llama", "eager", "no"), ("gemma2", "eager", "bf16"), ("mixtral", "sdpa", "bf16"), ("mixtral", "eager", "no")],
)
def test_the_activation_estimate_counts_what_autograd_keeps(tmp_path: Any, family: str, attn: str, precision: str) -> None:
    """Measured on CPU with autograd's saved-tensor hooks (s = 128, b = 2, 1 and 2 layers, so a
    layer's share is their difference): the per-layer term is within 1% and the whole estimate
    (less the loss backward's two fp32 gradients, which are temporaries, not saved) within 2%.
    Issue 41: Korthikanti's GPT-layer form was 38% low for a Gemma-2-2B shape in ``plan --simulate``."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from acc_train.memory.plan import activation_bytes, layer_activation_bytes, model_shape

    s, b, vocab = 128, 2, 1000
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (b, s))
    measured = {}
    for layers in (1, 2):
        config = AutoConfig.for_model(**FAMILIES[family], vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=512, tie_word_embeddings=False)
        config._attn_implementation = attn
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).train()
        measured[layers] = _stored_activation_bytes(model, ids)
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": [type(model).__name__]}))
    job = load_job(flags={"model.name_or_path": (str(tmp_path), "--model")}, sets=[f"model.attn_implementation={attn}"])
    shape = model_shape(job.config)
    assert shape.layers == 2 and shape.attn_implementation == attn
    layer = layer_activation_bytes(shape, s, precision)
    assert layer is not None and layer * s * b == pytest.approx(measured[2] - measured[1], rel=0.01)
    estimate = activation_bytes(shape, b, s, precision)
    assert estimate is not None and estimate - 8 * vocab * s * b == pytest.approx(measured[2], rel=0.02)


def test_eager_attention_keeps_the_fp32_softmax_and_its_cast() -> None:
    """The score term alone: what eager keeps beyond sdpa per score, by precision and options."""
    from acc_train.memory.plan import attention_score_factor

    assert attention_score_factor("sdpa") == attention_score_factor("flash_attention_2", 0.1) == 0
    assert attention_score_factor("eager", precision="bf16") == 6 and attention_score_factor("eager", precision="no") == 4
    assert attention_score_factor("eager", 0.1, "bf16") == 9 and attention_score_factor("eager", precision="bf16", softcapping=True) == 8


#: a Mixtral-shaped toy: 2 layers of 4 experts, each a gate-up (2I x H) and a down (H x I) matrix
TINY_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 512, "tie_word_embeddings": False,
}  # fmt: skip
TINY_EXPERTS = 2 * 4 * (2 * 128 * 64 + 64 * 128)


def test_zero3_counts_the_mixture_of_experts_weights_autograd_pins(tmp_path: Any) -> None:
    """Issue 41: under ZeRO-3 every layer's gathered experts stay alive from forward to backward
    (transformers saves a view of them for grouped_mm's backward; ZeRO-3's release frees nothing
    under it), so the plan counts them, in the gathered dtype, and says what to set; with gradient
    checkpointing, or under FSDP, or with parameters never partitioned, there is nothing to add."""
    import json

    from acc_train.config import resolve_strategy
    from acc_train.memory.plan import model_shape
    from acc_train_cli.plan import build_plan

    (tmp_path / "config.json").write_text(json.dumps(TINY_MIXTRAL))

    def plan(checkpointing: bool) -> dict[str, Any]:
        flags = {"model.name_or_path": (str(tmp_path), "--model"), "launch.num_processes": (4, "--num-processes")}
        job = load_job(flags=flags, sets=["training.mixed_precision=bf16", f"training.gradient_checkpointing={str(checkpointing).lower()}"])
        return {"shape": model_shape(job.config), **build_plan(job)}

    plain, recomputed = plan(False), plan(True)
    assert plain["shape"].expert_parameters == TINY_EXPERTS  # counted on the meta device, every layer's
    rows, rows_gc = ({r["label"]: r for r in p["rows"]} for p in (plain, recomputed))
    assert "MoE experts pinned" in rows["zero3"]["note"] and "training.gradient_checkpointing: true" in rows["zero3"]["note"]
    assert "MoE" not in rows_gc["zero3"]["note"]
    for label in ("fsdp2", "zero2", "ddp"):
        assert rows[label]["buffers"] == rows_gc[label]["buffers"] and "MoE" not in rows[label]["note"]

    # (the toy fits stage3_max_live_parameters whole: its experts were counted as live parameters
    # either way.) A model larger than that limit: the experts on top of the other live parameters
    zero3 = resolve_strategy("zero3", {})
    psi, experts, layer = 10 * 10**9, 6 * 10**9, 5 * 10**8

    def buffers(precision: str, checkpointing: bool) -> int:
        inp = PlanInput(psi, 8, precision, largest_layer=layer, expert_parameters=experts, gradient_checkpointing=checkpointing)
        return zero3.planner().plan_memory(inp).buffers

    assert buffers("bf16", False) - buffers("bf16", True) == 2 * experts  # gathered in bf16
    assert buffers("no", False) - buffers("no", True) == 4 * experts  # fp32: gathered in fp32
    llama = load_job(flags={"launch.num_processes": (4, "--num-processes")}, sets=[])
    assert model_shape(llama.config).expert_parameters == 0  # the demo Llama has none


def test_zero3_gathers_its_largest_layer_whole_and_its_gradients_in_full() -> None:
    """A layer above ``stage3_max_live_parameters`` (1e9 elements) is gathered whole, and its
    gradients exist in full in backward before ZeRO-3 partitions them (``plan --simulate`` of a
    4-layer Mixtral-8x7B shape with checkpointing: 3.2 GiB of parameters and 3.6 GiB of
    gradients beyond the partitions, BENCHMARKS.md)."""
    from acc_train.config import resolve_strategy

    zero3 = resolve_strategy("zero3", {})
    small = zero3.planner().plan_memory(PlanInput(10 * 10**9, 8, "bf16", largest_layer=2 * 10**8))
    large = zero3.planner().plan_memory(PlanInput(10 * 10**9, 8, "bf16", largest_layer=15 * 10**8))
    bare = zero3.planner().plan_memory(PlanInput(10 * 10**9, 8, "bf16"))
    assert small.buffers - bare.buffers == 2 * 2 * 10**8  # the layer's gradients; its parameters within the live limit
    assert large.buffers - bare.buffers == 2 * (15 - 10) * 10**8 + 2 * 15 * 10**8  # gathered beyond the limit, and its gradients
    assert "largest layer gathered whole" in large.note and "largest layer gathered whole" not in small.note
