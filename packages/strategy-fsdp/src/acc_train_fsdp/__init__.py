"""acc-train's FSDP strategy; registered through the ``acc_train`` entry point ``fsdp``."""

from __future__ import annotations

from acc_train_fsdp.options import FSDPOptions
from acc_train_fsdp.strategy import FSDPStrategy

__all__ = ["FSDPOptions", "FSDPStrategy"]
