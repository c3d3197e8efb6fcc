"""The training loop's steps, each in the module named for it: :mod:`~acc_train.loop.setup`
(Accelerator, data, model, prepare, resume), :mod:`~acc_train.loop.loop` (the optimizer-step
loop) and :mod:`~acc_train.loop.finish` (``run.json`` and ``final/``). :func:`acc_train.trainer.train`
runs them in order. Only workers import these modules; torch and friends are imported inside
their functions all the same."""

from __future__ import annotations

__all__: list[str] = []
