"""Optimizers by name: core's registered through the hook, the ``optimizer:`` section validated
against the chosen one (strict, naming the key), the checks of what each needs and where its
state can go, a plugin's optimizer from docs/hooks.md, and the memory each plans for. No launch."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import pytest

from acc_train import plugins
from acc_train.config import load_job
from acc_train.config.optimizer import check_optimizer, optimizer_kind
from acc_train.config.schema import JobConfig, OptimizerConfig
from acc_train.errors import UserError
from acc_train.model.optimizer import BUILTIN_OPTIMIZERS
from acc_train.strategy import Machine

ROOT = Path(__file__).resolve().parents[2]


def _groups() -> tuple[Any, list[dict[str, Any]]]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return model, [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def _step(model: Any, optimizer: Any) -> None:
    import torch

    loss = model(torch.randn(4, 6)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# --- the registry ------------------------------------------------------------------------------------
def test_core_registers_exactly_its_optimizers() -> None:
    assert plugins.optimizers().names() == ["adafactor", "adamw", "adamw_8bit", "sgd"]
    assert {plugins.optimizers().owner(o.name) for o in BUILTIN_OPTIMIZERS} == {plugins.BUILTIN}


# --- the optimizer: section -----------------------------------------------------------------------
def test_each_optimizer_gets_its_own_defaults_and_no_others() -> None:
    adamw = OptimizerConfig()
    assert (adamw.betas, adamw.eps, adamw.momentum, adamw.nesterov) == ([0.9, 0.95], 1e-8, None, None)
    sgd = OptimizerConfig(name="sgd")
    assert (sgd.betas, sgd.eps, sgd.momentum, sgd.nesterov) == (None, None, 0.9, False)
    ada = OptimizerConfig(name="adafactor")
    assert (ada.betas, ada.eps, ada.momentum) == (None, None, None)
    assert ada.options == {"clip_threshold": 1.0, "decay_rate": -0.8, "beta1": None, "scale_parameter": False}
    assert OptimizerConfig(name="adafactor", options={"beta1": 0.9}).options["beta1"] == 0.9


def test_fine_tune_defaults_apply_to_the_keys_the_optimizer_takes() -> None:
    model = {"name_or_path": "some/model"}
    assert JobConfig.model_validate({"model": model}).optimizer.betas == [0.9, 0.999]
    sgd = JobConfig.model_validate({"model": model, "optimizer": {"name": "sgd"}}).optimizer
    assert (sgd.lr, sgd.weight_decay, sgd.betas, sgd.momentum) == (2e-5, 0.0, None, 0.9)


def test_the_resolved_config_of_each_optimizer_validates_again() -> None:
    for name in ("adamw", "sgd", "adafactor"):
        job = load_job(sets=[f"optimizer.name={name}"])
        assert JobConfig.model_validate(job.to_dict()).optimizer == job.config.optimizer


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["optimizer.name=sdg"], "optimizer.name (--set optimizer.name=sdg): unknown optimizer 'sdg' (installed optimizers: adafactor, adamw, adamw_8bit, sgd); did you mean 'sgd'?"),
        (["optimizer.name=sgd", "optimizer.betas=[0.9,0.99]"], "optimizer.betas does not apply to optimizer 'sgd' (it takes lr, weight_decay, momentum, nesterov, options)"),
        (["optimizer.momentum=0.9"], "optimizer.momentum does not apply to optimizer 'adamw'"),
        (["optimizer.name=sgd", "optimizer.momentum=0", "optimizer.nesterov=true"], "optimizer.nesterov needs optimizer.momentum above 0"),
        (["optimizer.name=sgd", "optimizer.momentum=1.5"], "optimizer.momentum"),
        (["optimizer.name=adafactor", "optimizer.options={clip_treshold: 2.0}"], 'optimizer.options.clip_treshold: unknown key; did you mean "optimizer.options.clip_threshold"?'),
        (["optimizer.name=adafactor", "optimizer.options={decay_rate: 0.5}"], "optimizer.options.decay_rate: Input should be less than 0"),
        (["optimizer.options={alpha: 1}"], "optimizer 'adamw' takes no optimizer.options (got alpha)"),
    ],
)
def test_a_bad_optimizer_section_names_the_key(sets: list[str], says: str) -> None:
    with pytest.raises(UserError) as err:
        load_job(sets=sets)
    assert says in err.value.message


# --- where each can run, and where its state can go -----------------------------------------------------
def _job(optimizer: str, strategy: str = "ddp") -> Any:
    return load_job(sets=[f"optimizer.name={optimizer}"], flags={"strategy.name": (strategy, "--strategy")})


CPU2 = Machine("cpu", 2)


def test_adamw_8bit_needs_bitsandbytes_and_a_cuda_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    with pytest.raises(UserError, match="needs the 'bitsandbytes' package, which is not installed") as err:
        check_optimizer(_job("adamw_8bit"), CPU2)
    assert err.value.where == "optimizer.name" and "pip install bitsandbytes" in (err.value.hint or "")
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "bitsandbytes" else found(name, *a))
    with pytest.raises(UserError, match="optimizer 'adamw_8bit' runs on cuda devices; this machine trains on cpu"):
        check_optimizer(_job("adamw_8bit"), CPU2)


@pytest.mark.parametrize(
    ("optimizer", "strategy", "says"),
    [
        ("adafactor", "fsdp", "optimizer 'adafactor' keeps state not shaped like its parameters"),
        ("adafactor", "zero3", "not shaped like its parameters"),
        ("sgd", "zero2", "optimizer 'sgd' keeps momentum_buffer, which the 'deepspeed' checkpoint format of strategy 'zero2' does not save"),
        ("adafactor", "zero1", "keeps RMS, exp_avg_sq_col, exp_avg_sq_row, which the 'deepspeed' checkpoint format"),
    ],
)
def test_an_optimizer_is_refused_where_its_state_cannot_go(optimizer: str, strategy: str, says: str) -> None:
    with pytest.raises(UserError) as err:
        check_optimizer(_job(optimizer, strategy), CPU2)
    assert says in err.value.message and err.value.where == "optimizer.name"


@pytest.mark.parametrize(
    ("optimizer", "strategy"), [("sgd", "ddp"), ("sgd", "fsdp"), ("adafactor", "ddp"), ("adamw", "zero3"), ("adamw", "fsdp")]
)
def test_an_optimizer_runs_where_its_state_fits(optimizer: str, strategy: str) -> None:
    assert check_optimizer(_job(optimizer, strategy), CPU2).name == optimizer


def test_adafactor_runs_under_a_sharding_strategy_on_one_process() -> None:
    assert check_optimizer(_job("adafactor", "fsdp"), Machine("cpu", 1)).name == "adafactor"


# --- building and stepping ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor"])
def test_each_builtin_builds_over_the_groups_and_steps(name: str) -> None:
    import torch

    cfg = OptimizerConfig(name=name, lr=0.01, weight_decay=0.1)
    model, groups = _groups()
    optimizer = optimizer_kind(name).build(groups, cfg, torch.device("cpu"))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, optimizer)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(g["lr"] == 0.01 for g in optimizer.param_groups)


def test_the_builtins_are_what_they_say() -> None:
    import torch

    _, groups = _groups()
    adamw = optimizer_kind("adamw").build(groups, OptimizerConfig(), torch.device("cpu"))
    assert type(adamw) is torch.optim.AdamW and optimizer_kind("adamw").describe(adamw) == {"implementation": "foreach"}
    assert adamw.param_groups[0]["betas"] == (0.9, 0.95) and not adamw.param_groups[0]["fused"]
    _, groups = _groups()
    sgd = optimizer_kind("sgd").build(groups, OptimizerConfig(name="sgd", momentum=0.8, nesterov=True), torch.device("cpu"))
    assert type(sgd) is torch.optim.SGD and (sgd.param_groups[0]["momentum"], sgd.param_groups[0]["nesterov"]) == (0.8, True)
    _, groups = _groups()
    ada = optimizer_kind("adafactor").build(groups, OptimizerConfig(name="adafactor", lr=0.003, options={"beta1": 0.9}), torch.device("cpu"))
    from transformers.optimization import Adafactor

    group = ada.param_groups[0]
    assert type(ada) is Adafactor and (group["lr"], group["relative_step"], group["scale_parameter"], group["beta1"]) == (0.003, False, False, 0.9)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()")
def test_adamw_is_fused_on_cuda() -> None:
    import torch

    model = torch.nn.Linear(4, 4).cuda()
    adamw = optimizer_kind("adamw").build([{"params": list(model.parameters()), "weight_decay": 0.0}], OptimizerConfig(), torch.device("cuda"))
    assert optimizer_kind("adamw").describe(adamw) == {"implementation": "fused"}


def test_a_plain_number_in_the_optimizer_state_survives_the_portable_state(tmp_path: Path) -> None:
    """Adafactor keeps ``step`` as a Python int: the safetensors shards hold it as a tensor, and
    the load gives it back as an int."""
    import torch

    from acc_train.checkpoint.portable import read_portable_state, write_portable_state

    state = {"w": {"step": 7, "RMS": torch.tensor(0.5), "exp_avg_sq_row": torch.arange(3.0)}}
    write_portable_state(tmp_path, {"w": torch.ones(2)}, state)
    back = {"w": {"step": 0, "RMS": torch.tensor(0.0), "exp_avg_sq_row": torch.zeros(3)}}
    read_portable_state(tmp_path, {"w": torch.zeros(2)}, back)
    assert back["w"]["step"] == 7 and type(back["w"]["step"]) is int
    torch.testing.assert_close(back["w"]["exp_avg_sq_row"], torch.arange(3.0))


# --- a plugin's optimizer ---------------------------------------------------------------------------
def test_the_hooks_page_example_optimizer_works_as_a_plugin() -> None:
    """docs/hooks.md's optimizer plugin, registered in-process: selected by optimizer.name, its
    own options validated, its defaults applied, built and stepped, planned."""
    import torch

    page = (ROOT / "docs" / "hooks.md").read_text()
    section = page.split("## acc_train_register_optimizers", 1)[1].split("\n## ", 1)[0]
    example = re.findall(r"```python\n(.*?)```", section, flags=re.S)[1]
    module = types.ModuleType("rmsprop_plugin")
    exec(compile(example, "docs/hooks.md", "exec"), module.__dict__)
    plugins.reset()
    try:
        plugins.get_plugin_manager().register(module, name="rmsprop-plugin")
        assert "rmsprop" in plugins.optimizers().names() and plugins.optimizers().owner("rmsprop") == "rmsprop-plugin"
        job = load_job(sets=["optimizer.name=rmsprop", "optimizer.momentum=0.5", "optimizer.options={centered: true}"])
        cfg = job.config.optimizer
        assert (cfg.eps, cfg.momentum, cfg.betas) == (1e-8, 0.5, None)
        with pytest.raises(UserError, match='optimizer.options.alhpa: unknown key; did you mean "optimizer.options.alpha"'):
            load_job(sets=["optimizer.name=rmsprop", "optimizer.options={alhpa: 0.9}"])
        with pytest.raises(UserError, match="optimizer.betas does not apply to optimizer 'rmsprop'"):
            load_job(sets=["optimizer.name=rmsprop", "optimizer.betas=[0.9,0.9]"])
        kind = check_optimizer(job, CPU2)
        model, groups = _groups()
        optimizer = kind.build(groups, cfg, torch.device("cpu"))
        assert type(optimizer) is torch.optim.RMSprop and optimizer.param_groups[0]["centered"]
        _step(model, optimizer)
        assert kind.state_bytes(cfg, 4) == 12
    finally:
        plugins.reset()


# --- acc-train plan --------------------------------------------------------------------------------
def test_the_plan_counts_the_optimizers_state() -> None:
    from acc_train.memory.plan import PlanInput, replicated

    sgd = OptimizerConfig(name="sgd")
    bytes_of = {
        "adamw": optimizer_kind("adamw").state_bytes(OptimizerConfig(), 4),
        "sgd": optimizer_kind("sgd").state_bytes(sgd, 4),
        "sgd without momentum": optimizer_kind("sgd").state_bytes(OptimizerConfig(name="sgd", momentum=0.0), 4),
        "adafactor": optimizer_kind("adafactor").state_bytes(OptimizerConfig(name="adafactor"), 4),
        "adamw_8bit": optimizer_kind("adamw_8bit").state_bytes(OptimizerConfig(name="adamw_8bit"), 4),
    }
    assert bytes_of == {"adamw": 8, "sgd": 4, "sgd without momentum": 0, "adafactor": 0, "adamw_8bit": 2}
    assert optimizer_kind("adamw").state_bytes(OptimizerConfig(), 2) == 4  # pure bf16: 2-byte moments
    default = replicated(PlanInput(1000, 2, "no"))
    assert (default.optimizer, default.formula) == (8000, "4psi + 4psi + 8psi = 16psi")
    with_sgd = replicated(PlanInput(1000, 2, "no", optimizer_bytes_per_param=4.0))
    assert (with_sgd.optimizer, with_sgd.formula) == (4000, "4psi + 4psi + 4psi = 12psi")
    from acc_train.config import resolve_strategy

    fsdp = resolve_strategy("fsdp")
    assert fsdp.planner().plan_memory(PlanInput(1000, 2, "no", optimizer_bytes_per_param=0.0)).optimizer == 0
    assert fsdp.planner().plan_memory(PlanInput(1000, 2, "no")).optimizer == 4000
