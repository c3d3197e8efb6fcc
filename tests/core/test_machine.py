"""How a worker sees its machine, and what `mixed_precision: auto` becomes there."""

from __future__ import annotations

import pytest

from acc_train.machine import cpu_has_native_bf16, resolve_mixed_precision
from acc_train.errors import UserError
from acc_train.strategy import Machine


def test_auto_precision_on_cpu_is_fp32_unless_bf16_is_native() -> None:
    expected = "bf16" if cpu_has_native_bf16() else "no"
    assert resolve_mixed_precision("auto", Machine("cpu", 2)) == expected


def test_explicit_precision_is_kept_and_fp16_on_cpu_is_refused() -> None:
    assert resolve_mixed_precision("bf16", Machine("cpu", 1)) == "bf16"
    with pytest.raises(UserError, match="fp16 mixed precision needs a GPU"):
        resolve_mixed_precision("fp16", Machine("cpu", 1))


@pytest.mark.gpu
def test_auto_precision_on_gpu_is_bf16_where_supported() -> None:
    import torch

    from acc_train.machine import current_machine

    machine = current_machine()
    assert machine.device_type == "cuda"
    assert resolve_mixed_precision("auto", machine) == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")
