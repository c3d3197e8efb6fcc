"""The ddp strategy's options map onto Accelerate's DDP kwargs; its schema is strict."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from acc_train import Machine, UserError, resolve_strategy
from acc_train_ddp import DDPStrategy


def test_options_become_ddp_kwargs() -> None:
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    strategy = resolve_strategy("ddp", {"bucket_cap_mb": 50, "static_graph": True, "comm_hook": "powersgd", "powersgd_rank": 4})
    (handler,) = strategy.accelerator_kwargs(None)["kwargs_handlers"]
    assert isinstance(handler, DistributedDataParallelKwargs)
    assert handler.bucket_cap_mb == 50 and handler.static_graph is True
    assert handler.comm_hook == DDPCommunicationHookType.POWER_SGD
    assert handler.comm_state_option == {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2}
    plain = resolve_strategy("ddp").accelerator_kwargs(None)["kwargs_handlers"][0]
    assert plain.comm_hook == DDPCommunicationHookType.NO and plain.comm_state_option == {}


def test_schema_rejects_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValidationError, match="bucket_cap"):
        DDPStrategy().parse_options({"bucket_cap": 10})
    with pytest.raises(ValidationError, match="comm_hook"):
        DDPStrategy().parse_options({"comm_hook": "int8"})


def test_expected_distributed_types_never_include_a_silent_fallback() -> None:
    s = DDPStrategy()
    assert s.bind(Machine("cpu", 2)).expected_distributed_types() == {"MULTI_CPU"}
    assert s.bind(Machine("cuda", 8)).expected_distributed_types() == {"MULTI_GPU"}
    assert s.bind(Machine("cpu", 1)).expected_distributed_types() == {"NO", "MULTI_CPU"}


def test_fp16_hook_on_cpu_is_refused_with_a_hint() -> None:
    with pytest.raises(UserError, match="fp16 compression hook needs GPUs"):
        resolve_strategy("ddp", {"comm_hook": "fp16"}).bind(Machine("cpu", 2)).check_environment()
