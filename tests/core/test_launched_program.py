"""What :func:`acc_train.launch.launched.adopt_accelerate` does to the Accelerators of a program run
unchanged, in one process (the 2-process runs are in tests/cli/test_unchanged_programs.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from acc_train import UserError, resolve_strategy
from acc_train.launch.launched import adopt_accelerate
from acc_train.strategy import Machine


@pytest.fixture
def adopted(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """``adopt(strategy)``, with Accelerate's class and torch's DDP restored afterwards."""
    import accelerate
    import torch
    from accelerate.state import AcceleratorState, GradientState

    for name in ("__init__", "prepare", "prepare_model"):
        monkeypatch.setattr(accelerate.Accelerator, name, getattr(accelerate.Accelerator, name))
    monkeypatch.setattr(torch.nn.parallel.DistributedDataParallel, "__init__", torch.nn.parallel.DistributedDataParallel.__init__)
    AcceleratorState._reset_state(True)
    yield lambda strategy: adopt_accelerate(strategy.bind(Machine("cpu", 1)))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_ddp_options_no_variable_carries_are_applied_in_the_worker(adopted) -> None:
    import accelerate

    program = adopted(resolve_strategy("ddp", {"bucket_cap_mb": 7, "static_graph": True}))
    accelerator = accelerate.Accelerator(cpu=True)
    assert accelerator.ddp_handler.bucket_cap_mb == 7 and accelerator.ddp_handler.static_graph is True
    assert accelerator.acc_launched and program.accelerators == 1


def test_ddp_defaults_leave_accelerates_own_handler(adopted) -> None:
    import accelerate

    adopted(resolve_strategy("ddp"))
    assert accelerate.Accelerator(cpu=True).ddp_handler is None


def test_a_plugin_asking_for_another_strategy_is_refused_naming_both(adopted) -> None:
    import accelerate
    from accelerate.utils import FullyShardedDataParallelPlugin

    adopted(resolve_strategy("ddp"))
    with pytest.raises(UserError) as err:
        accelerate.Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    assert 'asks Accelerate for strategy "fsdp", but acc-train launch was asked for strategy "ddp"' in str(err.value)
    assert "--strategy fsdp" in err.value.hint


def test_torch_ddp_is_refused_under_a_sharding_strategy_only(adopted) -> None:
    import torch

    adopted(resolve_strategy("zero3"))
    with pytest.raises(UserError, match='so strategy "deepspeed" would not apply to it'):
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))


def test_the_wrapped_accelerator_keeps_its_signature(adopted) -> None:
    """Libraries (HF Trainer among them) read Accelerator.__init__'s parameters to see what it takes."""
    import inspect

    import accelerate

    adopted(resolve_strategy("ddp"))
    assert "fsdp_plugin" in inspect.signature(accelerate.Accelerator.__init__).parameters
    assert "device_placement" in inspect.signature(accelerate.Accelerator.prepare).parameters
