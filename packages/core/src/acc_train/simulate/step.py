"""One rank of the target world, simulated in this process: the job's model built at full size
from fake tensors, the strategy applied through the Accelerator a run builds, two optimizer
steps of the job's shape, measured by torch's memory trackers.

Two steps, because the optimizer allocates its state in the first: a run's peak is reached from
the second on, with the optimizer state, the gradients and the activations all held. The
trackers measure the second alone (one iteration each, as they are made for), and the
collectives are counted over it.

The optimizer step is counted at its end (parameters, gradients and the whole state held), not
while it runs: under fake tensors a fused or multi-tensor step is counted as a new copy of every
tensor it updates in place (AdamW fused on a 7B model: 5 times its state), and even a
parameter-by-parameter step leaves temporaries behind, where the fused AdamW a GPU run uses
(``optimizer.name: adamw``) updates in place and allocates nothing more. It steps parameter by
parameter here (``foreach`` and ``fused`` off), which needs no multi-tensor kernel on fake tensors.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from acc_train.config import ResolvedJob

__all__ = ["simulate_rank", "measure_step", "torch_optimizer", "PARTS"]

#: what each of the trackers' categories is, in the report's terms
PARTS = {
    "Sharded Param": "parameters", "Parameter": "parameters", "Buffer": "parameters",
    "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "Gradient": "gradients",
    "OptState": "optimizer", "Optstate": "optimizer",
    "Activation": "activations",
    "Unsharded Param": "other", "All Gather": "other", "Reduce Scatter": "other", "Temp": "other", "Inputs": "other", "Other": "other",
}  # fmt: skip

#: the device the job runs on in the cluster: the optimizer is built as there (AdamW fused on CUDA)
TARGET_DEVICE = "cuda"


def _build_model(job: ResolvedJob) -> Any:
    """The job's model at full size, from its config alone (fake tensors: its weights are never
    read), in ``model.dtype``, checkpointed and with LoRA as a run sets them."""
    import transformers

    from acc_train.model.adapters import apply_lora
    from acc_train.model.build import enable_gradient_checkpointing, model_config, training_dtype

    cfg = job.config
    mcfg = model_config(cfg)
    if cfg.model.attn_implementation:
        mcfg._attn_implementation = cfg.model.attn_implementation
    model = transformers.AutoModelForCausalLM.from_config(mcfg, dtype=training_dtype(cfg.model), trust_remote_code=cfg.model.trust_remote_code)
    if cfg.training.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg)
    return model


def _optimizer(model: Any, job: ResolvedJob) -> Any:
    """The job's optimizer with the loop's parameter groups, built as on the target device."""
    import torch

    from acc_train.config.optimizer import optimizer_kind
    from acc_train.model.optimizer import parameter_groups

    cfg = job.config.optimizer
    optimizer = optimizer_kind(cfg.name).build(parameter_groups(model, cfg.weight_decay), cfg, torch.device(TARGET_DEVICE))
    for group in optimizer.param_groups:  # see the module's docstring
        for key in ("foreach", "fused"):
            if key in group:
                group[key] = False
    return optimizer


def _batch(job: ResolvedJob, vocab: int, device: Any) -> dict[str, Any]:
    import torch

    b, s = job.config.training.micro_batch_size, job.config.data.seq_len
    ids = torch.randint(0, vocab, (b, s), device=device)
    return {"input_ids": ids, "labels": ids.clone()}


class _PeakWhere:
    """The peak as the tracker's current snapshots reach it, with where it was reached: the
    innermost module running, and the phase. (Its own peak snapshot is not read: it can mix
    categories of different moments.)"""

    def __init__(self, tracker: Any) -> None:
        self.module: str | None = None
        self.phase = "forward"
        self.in_optimizer = False
        self.step_done = False
        self.snapshot: dict[str, int] = {}
        update = tracker._update_peak_stats

        def record(state: Any) -> None:
            update(state)
            if self.in_optimizer and not self.step_done:
                return  # counted at the step's end (the module's docstring)
            current = next(iter(tracker.get_tracker_snapshot("current").values()), {})
            if current.get("Total", 0) > self.snapshot.get("Total", 0):
                self.snapshot = {str(getattr(k, "value", k)): int(v) for k, v in current.items()}
                parents = [p for p in tracker._mod_tracker.parents if p != "Global"]
                self.module = max(parents, key=lambda p: p.count("."), default=None)
                self.phase = "optimizer step" if self.in_optimizer else "backward" if tracker._mod_tracker.is_bw else "forward"

        tracker._update_peak_stats = record
        self.record = lambda: record("optimizer step")


@contextmanager
def _peaks_per_module_skipped() -> Iterator[None]:
    """torch's ``MemTracker`` (and ``FSDPMemTracker``, and the ZeRO tracker, which build on it)
    without its per-module peaks: after every operation it walks every module it tracks (a weak
    dictionary: ~400 modules of a 7B Llama) to update each running module's own peak, which
    nothing here reads (:class:`_PeakWhere` keeps the peak and where it was reached). That walk was
    46% of a zero3 7B rehearsal's time (cProfile, BENCHMARKS.md). The tracker's own overall peak
    is still kept."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    def overall_only(self: Any, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)

    original = MemTracker._update_peak_stats
    MemTracker._update_peak_stats = overall_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        MemTracker._update_peak_stats = original  # type: ignore[method-assign]


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a prepared one (Accelerate's wrapper; DeepSpeed's ZeRO
    optimizer, which steps a torch optimizer over its flat partitions), or None."""
    import torch

    while getattr(optimizer, "optimizer", None) is not None:  # (Accelerate's wrapper subclasses Optimizer)
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def _tracker(strategy: Any, model: Any, optimizer: Any) -> tuple[Any, str]:
    """The strategy's own tracker (its planner's ``memory_tracker``), or torch's ``MemTracker``."""
    own = strategy.planner().memory_tracker(model, optimizer)
    if own is not None:
        return own, type(own).__name__
    inner = torch_optimizer(optimizer)
    if inner is None or inner is not getattr(optimizer, "optimizer", optimizer):  # state beside the torch optimizer
        raise NotImplementedError(
            f"torch's MemTracker takes a torch optimizer, and {type(getattr(optimizer, 'optimizer', optimizer)).__name__} keeps "
            "state of its own beside it; the strategy names no tracker that counts it (StrategyPlanner.memory_tracker)"
        )
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, inner)
    return tracker, "MemTracker"


def _track_held_outside(tracker: Any) -> None:
    """Tell the tracker of what an engine allocated before it was entered and holds outside the
    model and the optimizer (DDP's gradient buckets: :data:`acc_train.simulate.world.HELD_OUTSIDE`),
    as temporary memory. A real run's DDP rebuilds its buckets in the second step's forward,
    where the tracker sees them allocated; the simulation keeps the first ones."""
    from acc_train.simulate.world import HELD_OUTSIDE

    if not HELD_OUTSIDE:
        return
    from torch.distributed._tools.mem_tracker import _MemRefType

    for tensor in HELD_OUTSIDE:
        tracker._update_and_maybe_create_winfos(tensor, _MemRefType.TEMP)


def simulate_rank(job: ResolvedJob, rank: int, world_size: int, local_world_size: int) -> dict[str, Any]:
    """Simulate ``rank`` of the job's world: its peak and the parts of it, where it was reached,
    the collectives of one step, and what the simulation cost (seconds, this process's RSS)."""
    start = time.perf_counter()
    from acc_train.simulate.world import fake_world

    with fake_world(rank, world_size, local_world_size) as reads:
        result = measure_step(job)
    return {
        "rank": rank,
        **result,
        "host_reads_answered": reads.count,
        "seconds": round(time.perf_counter() - start, 2),
        "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def measure_step(job: ResolvedJob) -> dict[str, Any]:
    """Two steps of the job's shape in this process's world, the second measured: under
    :func:`acc_train.simulate.world.fake_world` the simulation; in a real process group of real
    tensors (launched by torchrun, ``bench/bench_simulate.py``) what the simulation is held to,
    by the same trackers. Random token ids; the figures are bytes of this rank."""
    from torch.utils.data import DataLoader

    from acc_train.accelerator import Accelerator
    from acc_train.machine import bound_here
    from acc_train.simulate.collectives import CollectiveCounter

    t_cfg = job.config.training
    job.strategy = bound_here(job.strategy)  # the fake world's machine
    accelerator = Accelerator(strategy=job.strategy, job=job, mixed_precision=t_cfg.mixed_precision)
    model = _build_model(job)
    optimizer = _optimizer(model, job)
    # an empty loader of the job's micro-batch, as the loop's stand-in: a strategy may read the size from it
    model, optimizer, _ = accelerator.prepare(model, optimizer, DataLoader([], batch_size=t_cfg.micro_batch_size))
    vocab = accelerator.unwrap_model(model).config.vocab_size
    # where the model's parameters are (fake tensors keep "cpu" and "cpu:0" apart; real ones do not)
    device = next(accelerator.unwrap_model(model).parameters()).device

    def step() -> None:
        loss = model(**_batch(job, vocab, device), use_cache=False).loss  # as the loop calls it (loop/loss.py)
        accelerator.backward(loss)
        if t_cfg.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), t_cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the first step allocates the optimizer state (the module's docstring)
    tracker, tracker_name = _tracker(job.strategy, model, optimizer)
    where = _PeakWhere(tracker)
    counter = CollectiveCounter()
    with _peaks_per_module_skipped(), tracker:  # its own optimizer hooks first: the state is tracked as such when ours run
        _track_held_outside(tracker)
        inner = torch_optimizer(optimizer)

        def step_pre(*_: Any) -> None:
            where.in_optimizer = True

        def step_post(*_: Any) -> None:  # the state now held in full, the gradients not yet freed
            where.step_done = True
            where.record()
            where.in_optimizer = where.step_done = False

        hooks = [inner.register_step_pre_hook(step_pre), inner.register_step_post_hook(step_post)]
        with counter.mode:
            step()
        for hook in hooks:
            hook.remove()
    snapshot = where.snapshot
    tracked = {name: value for name, value in snapshot.items() if name != "Total" and value}
    parts = {"parameters": 0, "gradients": 0, "optimizer": 0, "activations": 0, "other": 0}
    for name, value in tracked.items():
        parts[PARTS.get(name, "other")] += value
    return {
        "peak_bytes": int(snapshot.get("Total", 0)),
        **{f"{part}_bytes": value for part, value in parts.items()},
        "tracked": tracked,
        "tracker": tracker_name,
        "at": {"module": where.module, "phase": where.phase},
        "collectives": counter.summary(),
    }
