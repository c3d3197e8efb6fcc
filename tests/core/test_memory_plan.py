"""A strategy plugin states its own memory plan through ``Strategy.plan_memory``; one that does
not gets a full replica per rank. Runs `acc-train plan`'s planner in-process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from acc_train import Strategy, hookimpl, plugins
from acc_train.config import load_job
from acc_train.memory_plan import MemoryPlan, PlanInput


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


class HalfSharded(Strategy):
    name = "plan-half"

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        return {}

    def plan_memory(self, plan: PlanInput) -> MemoryPlan:
        return MemoryPlan(4 * plan.parameters, 0, 12 * plan.parameters // 2, "4psi + 12psi/2", offload={"optimizer": "cpu"}, note="mine")


class BrokenPlan(Strategy):
    name = "plan-broken"

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        return {}

    def plan_memory(self, plan: PlanInput) -> MemoryPlan:
        raise RuntimeError("no idea")


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
