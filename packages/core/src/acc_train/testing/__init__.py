"""acc-train's conformance kit: the standard suite every strategy plugin should pass.

It is a pytest plugin (entry point ``pytest11: acc_train``), enabled either on the command line::

    pytest --acc-train-strategy local-sgd            # repeatable

or by a marker in one of your own test modules::

    import pytest
    from acc_train.testing import TestStrategyConformance  # noqa: F401  (pytest collects it here)

    pytestmark = pytest.mark.acc_train_strategy("local-sgd")

For each strategy it checks that the strategy registers and lists (without importing torch),
that its options schema rejects unknown keys at every level, that it trains on 2 CPU processes on
the tiniest model and exports the weights it trained, that it ran as the distributed type it
claims (Accelerate's state during the run, never a silent fallback), that each rank held the
share of the parameters it claims (:meth:`acc_train.api.StrategyPlanner.parameter_shards`), that stopping
and resuming reproduces the uninterrupted run, that every checkpoint carries a valid manifest,
that after the run's steps the ranks hold the same model (equal replicas, or shards that make up
the exported model), that the effect the plugin states distinguishes it (a ``run.json`` key counting
its own work, present and changing between the kit's two launches: ``effects={"NAME": "KEY"}`` on
the marker, or ``--acc-train-effect NAME=KEY``) and, where the strategy declares itself equivalent
to DDP (:meth:`acc_train.api.StrategyPlanner.equivalent_to_ddp`), that its losses match DDP's. One strategy's suite
shares two launches (a run, and a copy of it resumed from the middle); tests that launch are
marked ``launch`` and grouped with ``xdist_group`` so pytest-xdist keeps them on one worker
(``pip install "acc-train-core[kit]"`` brings pytest and pytest-xdist).
"""

from __future__ import annotations

from acc_train.testing.runs import KIT_RESUME_STEP, KIT_STEPS, KitLaunchError, KitRuns, build_tiny_assets, kit_group
from acc_train.testing.suite import TestStrategyConformance

__all__ = [
    "KIT_RESUME_STEP",
    "KIT_STEPS",
    "KitLaunchError",
    "KitRuns",
    "TestStrategyConformance",
    "build_tiny_assets",
    "kit_group",
]
