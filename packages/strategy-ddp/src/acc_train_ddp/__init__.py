"""acc-train's DDP strategy; registered through the ``acc_train`` entry point ``ddp``."""

from __future__ import annotations

from acc_train_ddp.plugin import DDPOptions, DDPStrategy

__all__ = ["DDPOptions", "DDPStrategy"]
