"""One replica group's torchft session: its Manager, the cross-group gradient average, healing, events.

Built at ``acc_train_train_start`` (after a resume), used by the strategy at every step:

- :meth:`FTSession.start_step` joins the step's quorum (synchronously, so that a group that
  rejoins heals before its first forward, and the loop can read the data from the healed position);
- the gradient average runs at the end of the backward of each step's last micro-batch (an autograd
  callback queued by the parameters' post-accumulate hooks): one all-reduce per dtype over the
  quorum's groups, before the loop clips;
- :meth:`FTSession.commit` is torchft's ``should_commit``: False after a failed all-reduce.

Healing copies only what is registered with the Manager: the model, the optimizer, the scheduler,
the loop's position (``run.state``) and the RNG are.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any

__all__ = ["FTSession", "group_of"]

#: the replica id prefix; torchft appends ``:<uuid>`` per launch
REPLICA_PREFIX = "acc_train_group_"


def group_of(replica_id: str) -> int | None:
    """The group index in a torchft replica id (``acc_train_group_3:uuid`` -> 3)."""
    m = re.match(rf"{REPLICA_PREFIX}(\d+)", replica_id)
    return int(m.group(1)) if m else None


def _across_groups(manager, bucket):  # noqa: ANN001, ANN202 - DDP checks a comm hook's annotations: none here
    """DDP's comm hook: the bucket's mean over the quorum's groups (a group of one process has
    nothing to reduce within). A failed all-reduce hands the bucket back as it is: the manager
    knows of the error and the step is discarded at ``should_commit``."""
    import torch

    buffer = bucket.buffer()
    work = manager.allreduce(buffer)
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - a lost peer: the manager discards the step
        manager.report_error(exc)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)
    return done


class _QuorumRecorder:
    """Stands in front of the Manager's client to keep the last quorum's result (torchft's
    Manager keeps only counts; the members tell which group was lost or joined)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class FTSession:
    """The torchft Manager of one replica group of one process, bound to the run."""

    def __init__(self, run: Any, options: Any, lighthouse: str | None) -> None:
        import torch
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        self.run = run
        self.group = options.replica_group
        self.num_groups = options.num_groups
        self.quorum_timeout_s = options.quorum_timeout_s
        self.events: list[dict[str, Any]] = []
        self.discarded = 0
        self.participants = 0
        self._members: set[int] | None = None
        self._healed = False
        self._lost_at: float | None = None
        timeout = timedelta(seconds=options.timeout_s)
        # the group's own store (one process): torchft's Manager joins it as a client
        self._store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=options.min_groups,
            use_async_quorum=False,  # heal before the forward: the loop re-reads the data from the healed position
            timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr="localhost",
            store_port=self._store.port,
            lighthouse_addr=lighthouse,
            replica_id=f"{REPLICA_PREFIX}{self.group}",
            heartbeat_interval=timedelta(seconds=options.heartbeat_interval_s),
        )
        self._recorder = _QuorumRecorder(self.manager._client)
        self.manager._client = self._recorder
        model = run.accelerator.unwrap_model(run.model, keep_torch_compile=False)
        self.manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
        self.manager.register_state_dict_fn("optimizer", run.optimizer.load_state_dict, run.optimizer.state_dict)
        self.manager.register_state_dict_fn("scheduler", run.scheduler.load_state_dict, run.scheduler.state_dict)
        self.manager.register_state_dict_fn("trainer", self._load_trainer, self._trainer_state)
        self.manager.register_state_dict_fn("rng", lambda s: torch.set_rng_state(s["torch"]), lambda: {"torch": torch.get_rng_state()})
        self._params = [p for p in run.model.parameters() if p.requires_grad]
        self._queued = False
        self._hooks: list[Any] = []
        if hasattr(run.model, "register_comm_hook"):  # Accelerate wrapped it in DDP (a one-rank group under the launcher)
            run.model.register_comm_hook(state=self.manager, hook=_across_groups)
        else:  # a plain module: average at the end of the backward
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]

    # -- the loop's position, healed with the model ---------------------------------------

    def _trainer_state(self) -> dict[str, Any]:
        return {k: v for k, v in self.run.state.to_json().items() if k != "stream"}

    def _load_trainer(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self.run.state, key, value)
        self.run.step = self.run.state.step
        self._healed = True

    # -- the step -------------------------------------------------------------------------

    def start_step(self) -> None:
        """Join the step's quorum; record who was lost, who joined, and this group's heal."""
        step = self.run.state.step
        t0 = time.perf_counter()
        self.manager.start_quorum()
        if self._members is None and step == 0:
            self._await_all_groups(t0)
        took = time.perf_counter() - t0
        self.participants = self.manager.num_participants()
        quorum = self._recorder.last
        members = {g for g in (group_of(r) for r in (getattr(quorum, "replica_ids", None) or [])) if g is not None}
        if self._healed:
            self._healed = False
            self.events.append({"step": self.run.state.step, "kind": "healed", "group": self.group, "seconds": round(took, 4)})
        elif self._members is not None:
            for g in sorted(self._members - members):
                # the stall: from the failed step (or this quorum's start) until the quorum without it
                since = self._lost_at if self._lost_at is not None else t0
                self.events.append({"step": step, "kind": "lost", "group": g, "seconds": round(time.perf_counter() - since, 4)})
            for g in sorted(members - self._members):
                self.events.append({"step": step, "kind": "joined", "group": g, "seconds": round(took, 4)})
        self._lost_at = None
        self._members = members

    def _await_all_groups(self, t0: float) -> None:
        """A fresh run starts with every group: groups launched together start seconds apart, and
        the first alone would otherwise train without them (they then heal from it). Waits up to
        the quorum timeout, then trains with the groups there."""
        while self.manager.num_participants() < self.num_groups and time.perf_counter() - t0 < self.quorum_timeout_s:
            time.sleep(0.2)
            self.manager.start_quorum()
        if self.manager.num_participants() < self.num_groups:
            from acc_train.api import warn_once_per_machine

            warn_once_per_machine(
                f"replica group {self.group}: {self.manager.num_participants()} of {self.num_groups} groups joined in "
                f"{self.quorum_timeout_s:g} s (strategy.quorum_timeout_s); training with them, the others heal when they come"
            )

    def _on_grad(self, param: Any) -> None:
        if self._queued or not self.run.accelerator.sync_gradients:
            return
        import torch

        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._average)

    def _average(self) -> None:
        """The gradients' mean over the quorum's groups: one flat all-reduce per dtype. A failed
        one is torchft's to report (the step is then discarded at :meth:`commit`)."""
        import torch

        self._queued = False
        by_dtype: dict[Any, list[Any]] = {}
        for p in self._params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            try:
                self.manager.allreduce(flat).wait()
            except Exception as exc:  # noqa: BLE001 - a lost peer: the manager discards the step
                self.manager.report_error(exc)
                return
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n

    def commit(self) -> bool:
        ok = bool(self.manager.should_commit())
        if not ok:
            self.discarded += 1
            self._lost_at = time.perf_counter() if self._lost_at is None else self._lost_at
            self.events.append({"step": self.run.state.step + 1, "kind": "discarded", "group": self.group, "seconds": 0.0})
        return ok

    # -- the end --------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        return {"ft_events": list(self.events), "replica_groups": self.participants, "ft_discarded_steps": self.discarded}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.manager.shutdown(wait=False)
