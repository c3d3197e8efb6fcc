"""The ``ft-ddp`` strategy: replica groups that train through a lost group (torchft).

How a job becomes fault tolerant through acc-train's strategy contract alone:

- every replica group is its own ``acc-train`` launch (its own rendezvous and output directory),
  named by ``strategy.replica_group`` of ``strategy.num_groups``; a lighthouse
  (``acc-train lighthouse``) keeps the quorum of live groups by heartbeat;
- :class:`FTGroups` (the contract's replica groups): ``data_part`` splits every global batch
  between the groups; ``step_start`` joins the step's quorum before its first forward; a group that
  (re)joins heals there from a live peer (model, optimizer, scheduler, data position, RNG) and the
  loop reads the data from the healed position;
- gradients are averaged across the quorum's groups at the end of each step's backward
  (:mod:`acc_train_ft.session`), before clipping;
- ``FTGroups.commit_step`` asks torchft whether the step stands: a step whose all-reduce
  lost a peer is discarded (not counted, the scheduler left, its batches trained again).

No torch, accelerate or torchft import at module level: listing strategies stays fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pydantic import Field

from acc_train.api import ReplicaGroups, RunContext, Strategy, StrategyOptions, UserError, hookimpl
from acc_train_ft.lighthouse import DEFAULT_PORT as DEFAULT_LIGHTHOUSE_PORT

__all__ = ["FTOptions", "FTDDPStrategy", "LIGHTHOUSE_ENV", "DEFAULT_LIGHTHOUSE_PORT"]

#: torchft's own variable for the lighthouse's address, read when ``strategy.lighthouse`` is unset
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: where the plugin keeps its session (:class:`acc_train_ft.session.FTSession`) in ``RunContext.extras``
EXTRAS_KEY = "ft"


class FTOptions(StrategyOptions):
    replica_group: int = Field(0, ge=0, description="This launch's replica group, 0 .. num_groups-1 (each group is its own acc-train launch).")
    num_groups: int = Field(2, ge=1, description="Replica groups in the job; each reads its part of every global batch.")
    lighthouse: str | None = Field(None, description=f"The lighthouse's address, HOST:PORT (`acc-train lighthouse` prints it); unset: ${LIGHTHOUSE_ENV}.")
    min_groups: int = Field(1, ge=1, description="Live groups a step needs to commit; with fewer, steps are discarded until enough rejoin.")
    quorum_timeout_s: float = Field(60.0, gt=0, description="How long a step waits for its quorum (a group's start-up included).")
    timeout_s: float = Field(30.0, gt=0, description="Collectives across groups and a heal's state transfer; a peer silent for longer is lost.")
    heartbeat_interval_s: float = Field(0.1, gt=0, description="How often a group tells the lighthouse it is alive (the lighthouse's own timeout decides when it is lost).")


class FTGroups(ReplicaGroups):
    """The groups of ft-ddp: each reads its part of every batch, joins each step's quorum (healing
    there when it rejoins) and commits a step only where torchft says it stands."""

    def data_part(self) -> tuple[int, int]:
        return (self.strategy.options.replica_group, self.strategy.options.num_groups)

    def step_start(self, run: RunContext) -> None:
        session = run.extras.get(EXTRAS_KEY)
        if session is not None:
            session.start_step()

    def commit_step(self, run: RunContext) -> bool:
        session = run.extras.get(EXTRAS_KEY)
        return True if session is None else session.commit()


class FTDDPStrategy(Strategy[FTOptions]):
    name = "ft-ddp"
    description = "fault-tolerant data parallel over torchft: replica groups of one process that train through a lost group"
    options_schema = FTOptions
    replica_groups = FTGroups  # a relaunched group is the same command again: it takes its output directory over and heals

    def lighthouse_address(self) -> str | None:
        """The lighthouse's URL, from the option or ``$TORCHFT_LIGHTHOUSE``, or None."""
        raw = self.options.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not raw:
            return None
        return raw if "://" in raw else f"http://{raw}"

    def check_job(self, config: Any) -> None:
        o = self.options
        if o.num_groups < 2:
            raise UserError(
                f"{self.name} with strategy.num_groups={o.num_groups}: one replica group cannot train through its own loss",
                where="strategy.num_groups",
                hint="run 2 or more groups (each its own acc-train launch), or use --strategy ddp",
            )
        if o.replica_group >= o.num_groups:
            raise UserError(
                f"strategy.replica_group={o.replica_group} is out of range for strategy.num_groups={o.num_groups}",
                where="strategy.replica_group",
                hint=f"number the groups 0 .. {o.num_groups - 1}",
            )
        if self.lighthouse_address() is None:
            raise UserError(
                f"{self.name} needs the lighthouse's address",
                where="strategy.lighthouse",
                hint=f"start one with `acc-train lighthouse` and pass --set strategy.lighthouse=HOST:{DEFAULT_LIGHTHOUSE_PORT} (or set ${LIGHTHOUSE_ENV})",
            )
        if o.min_groups > o.num_groups:
            raise UserError(
                f"strategy.min_groups={o.min_groups} is more than strategy.num_groups={o.num_groups}: no step could commit",
                where="strategy.min_groups",
                hint=f"set it to at most {o.num_groups}",
            )
        if config.data.streaming:
            raise UserError(
                f"{self.name} splits the cached data between groups; a stream's position is per process",
                where="data.streaming",
                hint="drop data.streaming",
            )

    def check_environment(self) -> None:
        if self.machine.world_size != 1:
            raise UserError(
                f"{self.name} runs replica groups of one process each; this launch has {self.machine.world_size}",
                where="--num-processes",
                hint="start one acc-train launch per group with --num-processes 1",
            )

    def accelerator_kwargs(self, job: Any) -> dict[str, Any]:
        if job is None:
            raise UserError(
                f"{self.name} works inside acc-train's own training loop, not under `acc-train launch`",
                where="--strategy",
                hint="train through a job config (acc-train --config ...)",
            )
        from accelerate.utils import DistributedDataParallelKwargs

        # Accelerate wraps even a one-process group in DDP, whose comm hook then averages across the
        # groups (acc_train_ft.session). DDP reorders its buckets after its first iteration unless it
        # looks for unused parameters: a relaunched group's first iteration would then pair its
        # buckets with differently ordered ones of its peers.
        return {"kwargs_handlers": [DistributedDataParallelKwargs(find_unused_parameters=True)]}

    #: the run's session, for :meth:`summary` (handed the accelerator alone)
    _session: Any = None

    def summary(self, accelerator: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"replica_group": self.options.replica_group, "num_groups": self.options.num_groups}
        if self._session is not None:
            out.update(self._session.summary())
        return out


@hookimpl
def acc_train_register_strategies(register: Callable[[Strategy], None]) -> None:
    register(FTDDPStrategy())


@hookimpl
def acc_train_register_commands(register: Callable[[Any], None]) -> None:
    from acc_train_ft.lighthouse import lighthouse

    register(lighthouse)


@hookimpl
def acc_train_train_start(run: Any) -> None:
    strategy = run.job.strategy
    if not isinstance(strategy, FTDDPStrategy):
        return
    from acc_train_ft.session import FTSession

    session = FTSession(run, strategy.options, strategy.lighthouse_address())
    run.extras[EXTRAS_KEY] = strategy._session = session


@hookimpl(tryfirst=True)  # the key it adds goes into the step's row of metrics.jsonl
def acc_train_step_end(run: Any, step: int, metrics: dict[str, Any]) -> None:
    session = run.extras.get(EXTRAS_KEY) if run is not None else None
    if session is not None:
        metrics["replica_groups"] = session.participants


@hookimpl
def acc_train_train_end(run: Any, summary: dict[str, Any]) -> None:
    session = run.extras.pop(EXTRAS_KEY, None) if run is not None else None
    if session is not None:
        session.close()
