"""The training loop's steps, each in the module named for it: :mod:`~acc_train.loop.setup`
(Accelerator, data, model, prepare, resume), :mod:`~acc_train.loop.loop` (the optimizer-step
loop, :func:`run_loop` over :class:`LoopInputs`) and :mod:`~acc_train.loop.finish` (``run.json``
and ``final/``). :func:`acc_train.trainer.train` runs them in order. Importing them imports no
torch: the libraries are imported inside the functions that use them."""

from __future__ import annotations

from acc_train.loop.loop import LoopInputs, LoopResult, run_loop

__all__ = ["LoopInputs", "LoopResult", "run_loop"]
