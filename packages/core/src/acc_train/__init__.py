"""acc-train: one training job, every distributed strategy, any machine.

Importing this package is cheap: torch and accelerate load only when ``Accelerator`` or the
training loop is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from acc_train.errors import PluginError, UserError
from acc_train.hookspecs import hookimpl
from acc_train.contracts.questions import Question
from acc_train.strategy import Machine, Strategy, StrategyOptions, WrapPolicy
from acc_train.contracts.launch import LaunchProtocol
from acc_train.memory.planner import StrategyPlanner

if TYPE_CHECKING:
    from acc_train.accelerator import Accelerator
    from acc_train.config.strategy import resolve_strategy

__all__ = [
    "Accelerator",
    "LaunchProtocol",
    "Machine",
    "PluginError",
    "Question",
    "Strategy",
    "StrategyOptions",
    "StrategyPlanner",
    "UserError",
    "WrapPolicy",
    "hookimpl",
    "resolve_strategy",
    "__version__",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Accelerator":
        from acc_train.accelerator import Accelerator

        return Accelerator
    if name == "resolve_strategy":
        from acc_train.config.strategy import resolve_strategy

        return resolve_strategy
    raise AttributeError(f"module 'acc_train' has no attribute {name!r}")
