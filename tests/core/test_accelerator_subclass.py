"""``acc_train.Accelerator`` under other people's code, in one process: an explicit ``None``
plugin means "not given" (HF Trainer passes ``fsdp_plugin=None, deepspeed_plugin=None``), and a
later Accelerator keeps the mixed precision the process's state started with."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from acc_train.accelerator import _merge_kwargs


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.delenv("ACC_TRAIN_STRATEGY", raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_an_explicit_none_plugin_is_not_given() -> None:
    plugin = object()
    merged = _merge_kwargs({"fsdp_plugin": plugin, "kwargs_handlers": []}, {"fsdp_plugin": None, "deepspeed_plugin": None, "split_batches": False})
    assert merged["fsdp_plugin"] is plugin
    assert "deepspeed_plugin" not in merged and merged["split_batches"] is False


def test_a_script_plugin_contradicting_the_strategys_is_still_refused() -> None:
    from acc_train import UserError

    with pytest.raises(UserError, match="the script passes fsdp_plugin, but the strategy already configures it"):
        _merge_kwargs({"fsdp_plugin": object()}, {"fsdp_plugin": object()})


def test_a_later_accelerator_keeps_the_processes_mixed_precision(fresh_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's first Accelerator (here a plain one, as a library builds it) decided
    ``no``; acc-train's ``auto``/``bf16`` is not forced on a later one, which Accelerate would
    refuse ("AcceleratorState has already been initialized")."""
    import accelerate

    from acc_train import Accelerator

    first = accelerate.Accelerator(cpu=True, mixed_precision="no")
    monkeypatch.setenv("ACC_TRAIN_MIXED_PRECISION", "bf16")
    later = Accelerator()
    assert later.mixed_precision == first.mixed_precision == "no"
    assert later.acc_strategy.name == "ddp"
