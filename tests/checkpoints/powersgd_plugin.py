"""A PowerSGD-style test strategy, ``powersgd-test``: an installed plugin in the tests (copied into
a dist-info folder on ``PYTHONPATH`` by :func:`install`), written against ``acc_train.api`` alone.

Each rank compresses each matrix gradient to rank 1 (one power iteration, warm-started from the
previous step's ``q``) with error feedback: what the approximation left out is added to the next
step's gradient. DDP then averages the approximations. The error and ``q`` of every matrix are
per-rank state beyond model and optimizer, so a resumed run continues exactly only if they come
back: :meth:`PowerSGDTestStrategy.state_dict` / ``load_state_dict`` carry them, with the run's
count of compressions as a JSON value. run.json's ``powersgd_compressions`` counts this launch's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from acc_train.api import RunContext, Strategy, hookimpl

NAME = "powersgd-test"
MODULE = "powersgd_test_plugin"
#: where the rank's compressor lives in ``RunContext.extras``
KEY = "powersgd_test"


class Compressor:
    """Rank-1 compression with error feedback, one matrix parameter at a time."""

    def __init__(self, errors: dict[str, Any] | None = None, qs: dict[str, Any] | None = None, total: int = 0) -> None:
        self.errors: dict[str, Any] = dict(errors or {})
        self.qs: dict[str, Any] = dict(qs or {})
        #: compressions over the whole run (restored on resume) and in this launch
        self.total = total
        self.this_launch = 0

    def hook(self, name: str) -> Callable[[Any], Any]:
        def compress(grad: Any) -> Any:
            import torch

            if grad.ndim != 2:  # biases and norm weights: sent whole, as PowerSGD does
                return grad
            m = grad + self.errors[name].to(grad.device) if name in self.errors else grad.clone()
            q = self.qs.get(name)
            # deterministic start, no draw from the RNG: q = ones / sqrt(n)
            q = torch.full((m.shape[1], 1), 1 / math.sqrt(m.shape[1]), dtype=m.dtype, device=m.device) if q is None else q.to(m.device)
            p = m @ q
            p = p / p.norm().clamp_min(1e-12)
            q = m.t() @ p
            approx = p @ q.t()
            self.errors[name], self.qs[name] = m - approx, q
            self.total += 1
            self.this_launch += 1
            return approx

        return compress


class PowerSGDTestStrategy(Strategy):
    name = NAME
    description = "PowerSGD-style rank-1 gradient compression with per-rank error feedback (a test plugin)"

    #: this process's compressor, for :meth:`summary` (which is handed the accelerator alone)
    _compressor: Compressor | None = None

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        return {}  # plain DDP: the compression happens in each rank's gradient hooks, before DDP averages

    def state_dict(self, run: RunContext) -> dict[str, Any]:
        c = run.extras.get(KEY)
        if c is None:
            return {}
        return {"errors": dict(c.errors), "q": dict(c.qs), "compressions": c.total}

    def load_state_dict(self, run: RunContext, state: dict[str, Any]) -> None:
        run.extras[KEY] = Compressor(state["errors"], state["q"], state["compressions"])  # hooked in at train start

    def summary(self, accelerator: Any) -> dict[str, Any]:
        c = self._compressor
        return {"powersgd_compressions": c.this_launch if c else 0, "powersgd_compressions_total": c.total if c else 0}


@hookimpl
def acc_train_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(PowerSGDTestStrategy())


@hookimpl
def acc_train_train_start(run: RunContext) -> None:
    strategy = run.job.strategy
    if not isinstance(strategy, PowerSGDTestStrategy):
        return
    compressor = run.extras.setdefault(KEY, Compressor())
    strategy._compressor = compressor
    for name, param in run.accelerator.unwrap_model(run.model).named_parameters():
        if param.requires_grad:
            param.register_hook(compressor.hook(name))


def install(folder: Path) -> Path:
    """This module as an installed plugin distribution in ``folder`` (put it on PYTHONPATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = folder / "powersgd_test-1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: powersgd-test\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[acc_train]\n{NAME} = {MODULE}\n")
    (folder / f"{MODULE}.py").write_text(Path(__file__).read_text())
    return folder
