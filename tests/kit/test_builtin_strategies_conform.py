"""acc-train's own strategies pass the conformance kit that third-party plugin authors run."""

from __future__ import annotations

import pytest

from acc_train.testing import TestStrategyConformance  # noqa: F401  (collected here, for the names below)

pytestmark = pytest.mark.acc_train_strategy("ddp", "fsdp", "deepspeed")
