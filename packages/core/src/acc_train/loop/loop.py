"""The optimizer-step loop: forward, backward, step, log, evaluate, save, until ``max_steps``.

It knows nothing strategy-specific and fires lifecycle hooks rather than writing outputs itself
(core's reporter writes ``metrics.jsonl``). Step time, as ``run.json`` reports it, is the wall
clock of whole iterations: from the end of the previous step (or the start) to the end of this
one's ``acc_train_step_end`` hooks, so it holds fetching the batches, forward and backward of
every micro-batch, the optimizer and scheduler steps, reducing and logging the loss, and the
hooks. Evaluation and checkpoint saves are left out (they come every N steps; ``run.json``
reports the time saves block the loop separately).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.checkpoint import CheckpointManager, TrainerState, fault_point
from acc_train.loop.loss import eval_loss, sequence_shards, step_windows, token_loss
from acc_train.mfu import mfu
from acc_train.plugins import call_lifecycle
from acc_train.run import RunContext

if TYPE_CHECKING:
    from acc_train.data import ResumableSampler
    from acc_train.data.stream import StreamRows
    from acc_train.stop_signals import StopRequest

__all__ = ["WARMUP_STEPS", "LoopInputs", "LoopResult", "run_loop", "evaluate"]

#: Steps at the start of a run left out of the step times (allocator and cache warm-up).
WARMUP_STEPS = 3


@dataclass
class LoopInputs:
    """What the loop steps. Model, optimizer, job, accelerator and ``max_steps`` are on ``run``."""

    run: RunContext
    #: where training stands; restored from a checkpoint on resume, advanced by the loop
    state: TrainerState
    scheduler: Any
    train_dl: Any
    eval_dl: Any | None
    sampler: ResumableSampler | None
    #: micro-batches each rank reads in one epoch
    batches_per_epoch: int
    manager: CheckpointManager
    #: data.streaming: this rank's stream (no sampler, no epochs; its position goes in every checkpoint)
    stream: StreamRows | None = None
    #: set by the worker's signal handlers (launch.save_signals); None: signals are not handled
    stop: StopRequest | None = None


@dataclass
class LoopResult:
    """What the loop measured, for ``run.json``."""

    start_step: int
    #: wall time of this run's loop, saves and evaluations included
    elapsed_s: float = 0.0
    #: seconds of each whole iteration after the warm-up steps (see the module docstring)
    step_times: list[float] = field(default_factory=list)
    last_loss: float | None = None
    best_loss: float | None = None
    eval_loss: float | None = None
    #: committed checkpoints, in order
    saved: list[str] = field(default_factory=list)
    #: the signal the ranks agreed to stop on (a checkpoint of the last step was written), or None
    stopped_by: int | None = None
    #: per save: seconds the loop was blocked
    checkpoint_blocked_s: list[float] = field(default_factory=list)
    #: after the last step: waiting for the last asynchronous save's writes
    checkpoint_final_wait_s: float = 0.0
    #: per asynchronous save: seconds its writes overlapped the loop
    checkpoint_overlap_s: list[float] = field(default_factory=list)
    #: how the resumed checkpoint was restored ("native" or "portable"; None without a resume)
    resumed_via: str | None = None
    #: wall-clock time (``time.time()``) the first training batch was in hand
    first_batch_at: float | None = None
    #: real tokens (padding left out) this run trained on, all ranks
    tokens: int = 0


def evaluate(accelerator: Any, model: Any, eval_dl: Any) -> float:
    """Mean loss per token over the evaluation loader, all ranks together."""
    return eval_loss(accelerator, model, eval_dl)


def run_loop(inputs: LoopInputs) -> LoopResult:
    """Train from ``inputs.state.step`` to ``run.max_steps``; returns what was measured."""
    import torch

    run, state, manager = inputs.run, inputs.state, inputs.manager
    accelerator, model, optimizer, scheduler = run.accelerator, run.model, run.optimizer, inputs.scheduler
    cfg = run.job.config
    t_cfg = cfg.training
    world = accelerator.data_parallel_size
    # ranks whose losses are different parts of the step's: data-parallel ranks and the parts of
    # a context-parallel group; strategies average gradients over them
    loss_parts = accelerator.num_processes // accelerator.loss_replicas
    basis = run.mfu_basis or {}
    result = LoopResult(start_step=state.step)
    elapsed_before = state.elapsed_s  # training time of the runs this one resumes
    t_start = time.perf_counter()
    t_step = t_start  # start of the current iteration's span
    loss_sum = torch.zeros((), device=accelerator.device)
    grad_norm: Any = None
    meter = run.model_state_meter

    def committed(step: int, path: Path) -> None:
        result.saved.append(str(path))
        call_lifecycle("acc_train_checkpoint_saved", run=run, step=step, path=str(path))

    manager.on_commit = committed
    model.train()

    while state.step < run.max_steps:
        if inputs.sampler is not None:  # (a stream continues from its own position, endlessly)
            inputs.train_dl.set_epoch(state.epoch)  # Accelerate's loader re-sets the sampler's epoch from its own count
            inputs.sampler.set_start(state.batches_in_epoch * world * t_cfg.micro_batch_size)
        for batch, step_tokens, step_real in step_windows(inputs.train_dl, t_cfg.gradient_accumulation_steps, accelerator):
            if result.first_batch_at is None:
                result.first_batch_at = time.time()
            with accelerator.accumulate(model):
                with sequence_shards(accelerator, batch) as part:  # (this rank's part of each row under context parallelism)
                    loss = token_loss(model, part, step_tokens)  # this micro-batch's share of the step's per-token mean
                    # strategies average gradients over ranks and divide them by the accumulation steps
                    accelerator.backward(loss * loss_parts * t_cfg.gradient_accumulation_steps)
                if accelerator.sync_gradients:  # without clipping, the norm is still measured
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), t_cfg.max_grad_norm or math.inf)
                    if meter is not None:
                        meter.at_gradient_sync()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state.batches_in_epoch += 1
            state.samples_in_epoch += world * t_cfg.micro_batch_size
            loss_sum += loss.detach().float()
            if not accelerator.sync_gradients:
                continue
            lr = scheduler.get_last_lr()[0]
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
            state.step += 1
            run.step = state.step
            state.tokens += step_real
            result.tokens += step_real
            if state.batches_in_epoch >= inputs.batches_per_epoch:
                state.epoch += 1
                state.batches_in_epoch = state.samples_in_epoch = 0
            fault_point("train-step", state.step)
            now = time.perf_counter()
            elapsed = elapsed_before + now - t_start
            metrics: dict[str, Any] = {"step": state.step, "epoch": state.epoch}
            last = state.step >= run.max_steps
            logging_step = state.step % t_cfg.log_every == 0 or last
            stop_now = False
            if logging_step or inputs.stop is not None:
                # one reduction carries the step's loss and whether any rank was asked to stop
                # (a signal reaches the ranks at different moments: they agree here, at a step boundary)
                signum = float(inputs.stop.signum or 0) if inputs.stop is not None else 0.0
                asked = torch.tensor([1.0 if signum else 0.0, signum], device=loss_sum.device)
                reduced = accelerator.reduce(torch.cat([loss_sum.float().reshape(1), asked]), reduction="sum")
                askers, signals = reduced[1:].tolist()
                stop_now = askers > 0
            if logging_step:
                mean_loss = reduced[0] / accelerator.loss_replicas  # the shares of the step's per-token mean
                result.last_loss = float(mean_loss.item())
                result.best_loss = result.last_loss if result.best_loss is None else min(result.best_loss, result.last_loss)
                metrics.update(
                    loss=result.last_loss,
                    lr=lr,
                    grad_norm=float(grad_norm) if grad_norm is not None else None,
                    tokens=state.tokens,
                    tokens_per_s=result.tokens / max(now - t_start, 1e-9),
                    elapsed_s=round(elapsed, 4),
                )
                if "peak_flops" in basis:
                    metrics["mfu"] = mfu(metrics["tokens_per_s"], basis["flops_per_token"], basis["peak_flops"])
            loss_sum.zero_()
            call_lifecycle("acc_train_step_end", run=run, step=state.step, metrics=metrics)
            if state.step - result.start_step > WARMUP_STEPS:
                result.step_times.append(time.perf_counter() - t_step)
            if inputs.eval_dl is not None and ((t_cfg.eval_every and state.step % t_cfg.eval_every == 0) or last):
                result.eval_loss = evaluate(accelerator, model, inputs.eval_dl)
                call_lifecycle("acc_train_eval_end", run=run, step=state.step, metrics={"step": state.step, "eval_loss": result.eval_loss})
            every = cfg.checkpoint.every
            if (every and state.step % every == 0) or last or stop_now:
                state.elapsed_s = elapsed
                if inputs.stream is not None:  # every rank's position after the rows this step used
                    from accelerate.utils import gather_object

                    state.stream = gather_object([inputs.stream.state_dict()])
                manager.save(model, optimizer, scheduler, state)
            t_step = time.perf_counter()  # evaluation and saving stay out of the step time
            if stop_now and not last:
                result.stopped_by = round(signals / askers)  # the signal the ranks that got one got
                break
            if last:
                break
        if result.stopped_by is not None:
            break
    # an asynchronous last save is committed before the run is summed up
    result.checkpoint_final_wait_s = manager.finish()
    result.checkpoint_blocked_s = list(manager.blocked_s)
    result.checkpoint_overlap_s = list(manager.overlap_s)
    result.resumed_via = manager.loaded_via
    result.elapsed_s = time.perf_counter() - t_start
    return result
