"""acc-train's DeepSpeed strategy; registered through the ``acc_train`` entry point ``deepspeed``."""

from __future__ import annotations

from acc_train_deepspeed.strategy import DeepSpeedOptions, DeepSpeedStrategy

__all__ = ["DeepSpeedOptions", "DeepSpeedStrategy"]
