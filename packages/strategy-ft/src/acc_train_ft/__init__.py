"""Fault-tolerant strategies for acc-train over torchft; registered through the ``acc_train`` entry point ``ft``."""

from __future__ import annotations

from acc_train_ft.plugin import FTDDPStrategy, FTOptions

__all__ = ["FTDDPStrategy", "FTOptions"]
