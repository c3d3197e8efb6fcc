"""The optimizer-step loop: forward, backward, step, log, save, evaluate, until ``max_steps``.
A step's checkpoint is saved before its evaluations, so an evaluation that fails costs no
trained step: the run stops naming it, and resumes from that checkpoint.

It knows nothing strategy-specific and fires lifecycle hooks rather than writing outputs itself
(core's reporter writes ``metrics.jsonl``). It reads values back from the accelerator only every
``training.read_every`` steps and before an evaluation, a checkpoint, a stop and the end
(:mod:`acc_train.loop.ledger`): every other step queues its work and goes on, and the ranks
agree on a stop request over gloo (:class:`acc_train.launch.stop_signals.StopAgreement`).

Step time, as ``run.json`` reports it, is the time between the ends of consecutive steps (on
the device's timeline where it has one), so it holds fetching the batches, forward and backward
of every micro-batch, the optimizer and scheduler steps, and the loop's own work between steps
(reads, hooks, rows). Evaluation and checkpoint saves are left out (they come every N steps;
``run.json`` reports the time saves block the loop separately)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.checkpoint import CheckpointManager, TrainerState, fault_point, step_dir_name
from acc_train.contracts.replica_groups import replica_groups_of
from acc_train.errors import UserError
from acc_train.evaluation.kinds import job_evaluators, metrics_problem
from acc_train.loop.ledger import StepClock, StepLedger, StepReading, StepValues
from acc_train.loop.loss import eval_loss, packed_mask_kind, sequence_shards, step_windows, token_loss
from acc_train.outputs.mfu import mfu
from acc_train.plugins import call_lifecycle
from acc_train.run import RunContext
from acc_train.launch.stop_signals import StopAgreement

if TYPE_CHECKING:
    from acc_train.data import ResumableSampler
    from acc_train.data.stream import StreamRows
    from acc_train.launch.stop_signals import StopRequest

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
    #: each evaluator's last metrics and their step, by its name: ``{"step": N, "metrics": {...}}``
    evaluations: dict[str, dict[str, Any]] = field(default_factory=dict)
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


def evaluation_failed(where: str, step: int, exc: Exception, saved: list[str]) -> UserError:
    """The error a failed evaluation stops the run with: which evaluation, after which step,
    what it raised, and which checkpoint a resume continues from."""
    what = exc.message if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
    what = (what.splitlines() or [""])[0]
    if saved:
        name = Path(saved[-1]).name
        kept = f"checkpoint {name} is written{' (this step)' if name == step_dir_name(step) else ''}: fix the cause and continue with --resume latest"
    else:
        kept = "no checkpoint was written before it (checkpoint.every): fix the cause and start the run again"
    hint = exc.hint if isinstance(exc, UserError) and exc.hint else None
    return UserError(
        f"the evaluation after step {step} failed: {what}",
        where=where,
        hint=f"{hint}; {kept}" if hint else kept,
    )


def evaluate(accelerator: Any, model: Any, eval_dl: Any, mask: str | None = None, config: Any = None) -> float:
    """Mean loss per token over the evaluation loader, all ranks together."""
    return eval_loss(accelerator, model, eval_dl, mask, config)


def run_loop(inputs: LoopInputs) -> LoopResult:
    """Train from ``inputs.state.step`` to ``run.max_steps``; returns what was measured."""
    import torch

    run, state, manager = inputs.run, inputs.state, inputs.manager
    accelerator, model, optimizer, scheduler = run.accelerator, run.model, run.optimizer, inputs.scheduler
    cfg = run.job.config
    t_cfg = cfg.training
    groups = replica_groups_of(run.job.strategy)  # launches apart training one model (None: this one alone)
    world = accelerator.data_parallel_size * (groups.data_part()[1] if groups else 1)  # every launch reading a part of each batch
    gas = t_cfg.gradient_accumulation_steps
    # ranks whose losses are different parts of the step's: data-parallel ranks and the parts of
    # a context-parallel group; strategies average gradients over them
    loss_parts = accelerator.num_processes // accelerator.loss_replicas
    basis = run.mfu_basis or {}
    result = LoopResult(start_step=state.step)
    elapsed_before = state.elapsed_s  # training time of the runs this one resumes
    t_start = time.perf_counter()
    clipping = bool(t_cfg.max_grad_norm)
    parameters = list(model.parameters())  # walked once, not at every clip
    mask = packed_mask_kind(accelerator.unwrap_model(model))
    # SDPA over full attention: the forward's masks all given by the loop, none checked on the device
    attention_config = getattr(accelerator.unwrap_model(model), "config", None) if mask == "bool" else None
    meter = run.model_state_meter
    ledger = StepLedger(accelerator)
    agreement = StopAgreement(inputs.stop) if inputs.stop is not None else None
    every = cfg.checkpoint.every
    # the evaluators the job asks for, each started for this run (None: nothing to do in it)
    evaluators = [(kind, call) for kind in job_evaluators(cfg) if (call := kind.start(run, inputs.eval_dl)) is not None]
    evaluates = bool(evaluators)

    def evaluating(step: int) -> bool:
        return evaluates and (bool(t_cfg.eval_every and step % t_cfg.eval_every == 0) or step >= run.max_steps)

    def saving(step: int) -> bool:
        return bool(every and step % every == 0) or step >= run.max_steps

    def reads_at(step: int) -> bool:
        """Steps the loop reads the device at, known before they run (a stop is read too); the
        run's first step too, once, so the progress bar and the first row show a loss at once."""
        return step % t_cfg.read_every == 0 or evaluating(step) or saving(step) or step == result.start_step + 1

    def log_rows(readings: list[StepReading]) -> None:
        """The rows of the steps just read, in order, to the ``acc_train_log`` hooks."""
        for reading, (step, end_s, took) in zip(readings, clock.resolve()):
            state.tokens += reading.tokens
            result.tokens += reading.tokens
            if step - result.start_step > WARMUP_STEPS:
                result.step_times.append(took)
            if step % t_cfg.log_every and step < run.max_steps:
                continue
            result.last_loss = reading.loss
            result.best_loss = reading.loss if result.best_loss is None else min(result.best_loss, reading.loss)
            tokens_per_s = result.tokens / max(end_s, 1e-9)
            metrics: dict[str, Any] = {
                "step": step,
                "epoch": reading.epoch,
                "loss": reading.loss,
                "lr": reading.lr,
                "grad_norm": reading.grad_norm,
                "tokens": state.tokens,
                "tokens_per_s": tokens_per_s,
                "elapsed_s": round(elapsed_before + end_s, 4),
            }
            if "peak_flops" in basis:
                metrics["mfu"] = mfu(tokens_per_s, basis["flops_per_token"], basis["peak_flops"])
            metrics.update({k: v for k, v in reading.extra.items() if k not in metrics})  # what plugins added at step_end
            call_lifecycle("acc_train_log", run=run, step=step, metrics=metrics)

    def committed(step: int, path: Path) -> None:
        result.saved.append(str(path))
        call_lifecycle("acc_train_checkpoint_saved", run=run, step=step, path=str(path))

    manager.on_commit = committed

    def run_evaluations(step: int) -> None:
        """The step's evaluations, after its checkpoint (when one is due) is saved, each
        evaluator's metrics recorded by one path: ``acc_train_eval_end`` with the row (core's
        reporter writes it to ``metrics.jsonl`` and the trackers) and ``run.json``'s
        ``evaluations``. One that raises (lm-eval out of memory, a task's dataset gone) or
        returns what is not metrics stops the run as a UserError naming it and the step, with
        every checkpoint saved so far committed, so no trained step is lost to it and
        ``--resume latest`` continues (as HF Trainer and Lightning, the run stops rather than
        train on without the scores it was asked for)."""
        for kind, evaluate_one in evaluators:
            try:
                metrics = evaluate_one(step)
                problem = metrics_problem(metrics) if metrics is not None else None
                if problem is not None:
                    raise UserError(f"evaluator {kind.name!r} {problem}", hint="an evaluator returns {name: number} (or nested mappings of them), or None")
                if metrics:
                    metrics = dict(metrics)
                    result.evaluations[kind.name] = {"step": step, "metrics": metrics}
                    call_lifecycle("acc_train_eval_end", run=run, step=step, metrics={"step": step, **metrics})
            except torch.distributed.DistError:
                raise  # a lost peer is the process group's failure, reported as such (no collective now)
            except Exception as exc:  # noqa: BLE001 - whatever failed is reported by name, the checkpoint kept
                manager.finish()  # an asynchronous save still being written is committed first
                raise evaluation_failed(kind.where, step, exc, result.saved) from exc
    model.train()
    clock = StepClock(accelerator.device)
    step_loss: Any = None
    step_started = False  # the groups' step_start was called for the step being trained
    try:
        while state.step < run.max_steps:
            if inputs.sampler is not None:  # (a stream continues from its own position, endlessly)
                inputs.train_dl.set_epoch(state.epoch)  # Accelerate's loader re-sets the sampler's epoch from its own count
                inputs.sampler.set_start(state.batches_in_epoch * world * t_cfg.micro_batch_size)
            for batch, step_tokens, step_real in step_windows(inputs.train_dl, t_cfg.gradient_accumulation_steps, accelerator, ledger):
                if result.first_batch_at is None:
                    result.first_batch_at = time.time()
                if groups is not None and state.batches_in_epoch % gas == 0 and not step_started:  # the step's first micro-batch
                    position, step_started = (state.epoch, state.batches_in_epoch), True
                    groups.step_start(run)
                    if (state.epoch, state.batches_in_epoch) != position:  # the state was replaced (a rejoining replica healed)
                        step_loss = None
                        clock.restart()
                        break  # read the data again from the new position
                with accelerator.accumulate(model):
                    with sequence_shards(accelerator, batch) as part:  # (this rank's part of each row under context parallelism)
                        loss = token_loss(model, part, step_tokens, mask, attention_config)  # this micro-batch's share of the step's per-token mean
                        # strategies average gradients over ranks and divide them by the accumulation steps
                        accelerator.backward(loss * loss_parts * t_cfg.gradient_accumulation_steps)
                    grad_norm = None
                    if accelerator.sync_gradients and (clipping or reads_at(state.step + 1)):
                        # without clipping, the norm is measured only where the loop reads it
                        grad_norm = accelerator.clip_grad_norm_(parameters, t_cfg.max_grad_norm or math.inf)
                    if accelerator.sync_gradients and meter is not None:
                        meter.at_gradient_sync()
                    committed = groups is None or not accelerator.sync_gradients or groups.commit_step(run)
                    if committed:
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if not committed:  # discarded: not counted, its batches trained again, the scheduler left as it is
                    state.batches_in_epoch -= gas - 1
                    state.samples_in_epoch -= (gas - 1) * world * t_cfg.micro_batch_size
                    step_loss, step_started = None, False
                    break  # read this step's data again
                state.batches_in_epoch += 1
                state.samples_in_epoch += world * t_cfg.micro_batch_size
                step_loss = loss.detach().float() if step_loss is None else step_loss + loss.detach().float()
                if not accelerator.sync_gradients:
                    continue
                lr = scheduler.get_last_lr()[0]
                if not accelerator.optimizer_step_was_skipped:
                    scheduler.step()
                state.step += 1
                run.step = state.step
                step_started = False
                clock.mark(state.step)
                # plugins may add keys to this dict (they go into the step's row when it is written)
                step_metrics: dict[str, Any] = {"step": state.step, "epoch": state.epoch, "lr": lr}
                ledger.add(StepValues(state.step, state.epoch, lr, step_loss, grad_norm, step_real, step_metrics))
                step_loss = None
                if state.batches_in_epoch >= inputs.batches_per_epoch:
                    state.epoch += 1
                    state.batches_in_epoch = state.samples_in_epoch = 0
                fault_point("train-step", state.step)
                last = state.step >= run.max_steps
                stop_signal = agreement.poll() if agreement is not None else None
                call_lifecycle("acc_train_step_end", run=run, step=state.step, metrics=step_metrics)
                if reads_at(state.step) or stop_signal is not None:
                    log_rows(ledger.read())
                if saving(state.step) or stop_signal is not None:  # before the step's evaluations: see run_evaluations
                    state.elapsed_s = elapsed_before + time.perf_counter() - t_start
                    if inputs.stream is not None:  # every rank's position after the rows this step used
                        from accelerate.utils import gather_object

                        state.stream = gather_object([inputs.stream.state_dict()])
                    manager.save(model, optimizer, scheduler, state)
                if evaluating(state.step):
                    run_evaluations(state.step)
                if evaluating(state.step) or saving(state.step) or stop_signal is not None:
                    clock.restart()  # evaluation and saving stay out of the step time
                if stop_signal is not None and not last:
                    result.stopped_by = stop_signal
                    break
                if last:
                    break
            if result.stopped_by is not None:
                break
    except BaseException as exc:
        # the rows of the steps already summed over ranks are written first (no collective:
        # a peer may be gone), unless the failure is the process group's own
        if not isinstance(exc, torch.distributed.DistError):
            with contextlib.suppress(Exception):
                log_rows(ledger.read_local())
        raise
    finally:
        for _, evaluate_one in evaluators:
            close = getattr(evaluate_one, "close", None)
            if close is not None:
                close()
    if agreement is not None:
        agreement.close()
    # an asynchronous last save is committed before the run is summed up
    result.checkpoint_final_wait_s = manager.finish()
    result.checkpoint_blocked_s = list(manager.blocked_s)
    result.checkpoint_overlap_s = list(manager.overlap_s)
    result.resumed_via = manager.loaded_via
    result.elapsed_s = time.perf_counter() - t_start
    return result
