"""An example third-party acc-train strategy: local SGD. Registered through the ``acc_train``
entry point ``local-sgd``; nothing in acc-train imports it."""

from __future__ import annotations

from acc_train_localsgd.plugin import LocalSGDOptions, LocalSGDStrategy, PerRankFormat

__all__ = ["LocalSGDOptions", "LocalSGDStrategy", "PerRankFormat"]
