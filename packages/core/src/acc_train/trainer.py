"""The training loop. It knows nothing strategy-specific: the strategy shapes the Accelerator,
names the checkpoint format, and that is all."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from acc_train.checkpoint import (
    CheckpointManager,
    TrainerState,
    check_async_save,
    check_same_model,
    fault_point,
    find_checkpoint,
    model_fingerprint,
    verify_checkpoint,
)
from acc_train.config import ResolvedJob
from acc_train.errors import UserError
from acc_train.plugins import call_lifecycle, checkpoint_formats, library_versions, register_temporarily
from acc_train.run import RunContext, RunReporter

__all__ = ["train", "prepare_output_dir", "RUN_FILES"]

#: What a run writes into its output directory (an existing one is never silently replaced).
RUN_FILES = ("config.yaml", "metrics.jsonl", "run.json", "checkpoints", "final", "logs")

#: Steps at the start of a run left out of the step-time average (allocator and cache warm-up).
WARMUP_STEPS = 3


def prepare_output_dir(job: ResolvedJob) -> Path:
    """Create the output directory, refusing to overwrite a previous run unless asked.

    Called once, before workers start. Writes the resolved ``config.yaml``.
    """
    cfg = job.config
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"{str(out)!r} exists and is not a directory", where="--output-dir")
    # a config.yaml alone is a launch that never trained: it is simply replaced
    existing = [name for name in RUN_FILES if name != "config.yaml" and (out / name).exists()]
    if existing and not cfg.resume and not cfg.overwrite:
        raise UserError(
            f"{str(out)!r} already holds a run ({', '.join(existing)})",
            where="--output-dir",
            hint="pass --resume latest to continue it, --overwrite to replace it, or another --output-dir",
        )
    if existing and cfg.overwrite and not cfg.resume:
        for name in existing:
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
    if cfg.checkpoint.async_save:
        check_async_save(checkpoint_formats().get(job.strategy.checkpoint_format_name()))
    if cfg.resume:  # fail before launch, and before writing anything, on a bad --resume
        path = find_checkpoint(out, cfg.resume)
        if path is not None:
            from acc_train.model import model_config

            check_same_model(verify_checkpoint(path), model_fingerprint(model_config(cfg)), path)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "config.yaml.tmp"
    tmp.write_text(job.to_yaml())
    os.replace(tmp, out / "config.yaml")
    return out


def _peak_memory_bytes(device_type: str) -> int:
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _param_checksum(model: Any) -> float:
    import torch

    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def _optimizer(model: Any, cfg: Any) -> Any:
    import torch

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def train(job: ResolvedJob) -> dict[str, Any]:
    """Run the job on this process (one rank of the launched workers). Returns run.json's content."""
    import torch
    from accelerate.utils import ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    from acc_train.accelerator import Accelerator
    from acc_train.data import BlockDataset, ResumableSampler, load_blocks
    from acc_train.model import build_model, load_tokenizer

    cfg = job.config
    t_cfg = cfg.training
    out = Path(cfg.output_dir)
    accelerator = Accelerator(
        strategy=job.strategy,
        job=job,
        mixed_precision=t_cfg.mixed_precision,
        gradient_accumulation_steps=t_cfg.gradient_accumulation_steps,
        log_with=t_cfg.report_to or None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        step_scheduler_with_optimizer=False,
    )
    world = accelerator.num_processes
    set_seed(t_cfg.seed)

    tokenizer = load_tokenizer(cfg.model)
    with accelerator.main_process_first():
        train_blocks, eval_blocks = load_blocks(cfg.data, tokenizer)
    model = build_model(cfg)
    fingerprint, model_class = model_fingerprint(model.config), type(model).__name__  # before prepare wraps it
    model_config = json.loads(model.config.to_json_string(use_diff=False))  # before prepare wraps the model
    top = max(int(b.max().item()) for b in (train_blocks, eval_blocks) if b is not None)
    if top >= model.config.vocab_size:
        raise UserError(
            f"the data holds token id {top}, but the model's vocab_size is {model.config.vocab_size}",
            where="model.tokenizer" if cfg.model.tokenizer else "model",
            hint="use the tokenizer that belongs to the model",
        )

    mbs, gas = t_cfg.micro_batch_size, t_cfg.gradient_accumulation_steps
    sampler = ResumableSampler(len(train_blocks), t_cfg.seed, cfg.data.shuffle, group=world * mbs * gas)
    # its own generator: starting an iterator must not draw from the global RNG, or a resumed
    # run would be one draw ahead of the uninterrupted one
    train_dl = DataLoader(BlockDataset(train_blocks), batch_size=mbs, sampler=sampler, drop_last=True, generator=torch.Generator())
    eval_dl = None
    if eval_blocks is not None:
        eval_blocks = eval_blocks[: t_cfg.eval_batches * world * mbs]
        eval_dl = DataLoader(BlockDataset(eval_blocks), batch_size=mbs, shuffle=False, generator=torch.Generator())
    batches_per_epoch = sampler.usable // (world * mbs)
    steps_per_epoch = batches_per_epoch // gas
    max_steps = cfg.max_steps or t_cfg.epochs * steps_per_epoch  # type: ignore[operator]

    optimizer = _optimizer(model, cfg.optimizer)
    if eval_dl is not None:
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    else:
        model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    warmup = cfg.scheduler.warmup_steps
    if warmup is None:
        warmup = math.ceil(cfg.scheduler.warmup_ratio * max_steps)
    scheduler = get_scheduler(cfg.scheduler.name, optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=max_steps)

    fmt = checkpoint_formats().get(job.strategy.checkpoint_format_name())
    manager = CheckpointManager(
        accelerator,
        out,
        fmt,
        cfg.checkpoint.keep_last,
        {
            "strategy": job.config.strategy["name"],
            "strategy_options": job.strategy.options.model_dump(mode="json"),
            "model": fingerprint,
            "model_class": model_class,
            "versions": library_versions(),
        },
        # the data order is a function of these alone: processes, micro-batch size and
        # accumulation may change on resume as long as their product does not
        data_signature={
            "global_batch": world * mbs * gas,
            "seed": t_cfg.seed,
            "shuffle": cfg.data.shuffle,
            "seq_len": cfg.data.seq_len,
            "train_files": cfg.data.train_files,
            "model": cfg.model.name_or_path or "demo",
            "train_blocks": len(train_blocks),
        },
        seed=t_cfg.seed,
        model_config=model_config,
        async_save=cfg.checkpoint.async_save,
    )
    state = TrainerState()
    resumed_from = None
    if cfg.resume:
        path = find_checkpoint(out, cfg.resume)
        if path is not None:
            state = manager.load(path, model, optimizer, scheduler)
            state.batches_in_epoch = state.samples_in_epoch // (world * mbs)  # in this run's micro-batches
            resumed_from = str(path)
            if state.step >= max_steps:
                raise UserError(
                    f"the checkpoint is at step {state.step}, and this run stops at step {max_steps}",
                    where="--resume",
                    hint="raise --max-steps to train further",
                )

    run = RunContext(job=job, accelerator=accelerator, output_dir=out, max_steps=max_steps, step=state.step, model=model, optimizer=optimizer)
    run.extras["model_state_meter"] = job.strategy.model_state_meter(accelerator, model, optimizer)
    reporter = RunReporter(out / "metrics.jsonl", state.step)
    unregister = register_temporarily(reporter, f"reporter-{id(reporter)}")
    try:
        if t_cfg.report_to:
            accelerator.init_trackers("acc-train", config=_flat(job.to_dict()))
        call_lifecycle("acc_train_train_start", run=run)
        summary = _loop(run, job, state, model, optimizer, scheduler, sampler, train_dl, eval_dl, manager, max_steps, batches_per_epoch)
        summary["resumed_from"] = resumed_from
        _save_final(accelerator, model, tokenizer, out)
        if accelerator.is_main_process:
            tmp = out / "run.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2))
            os.replace(tmp, out / "run.json")
        call_lifecycle("acc_train_train_end", run=run, summary=summary)
        if t_cfg.report_to:
            accelerator.end_training()
    finally:
        reporter.close()
        unregister()
    return summary


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float, str, bool)):
            out[f"{prefix}{k}"] = v
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


def _evaluate(accelerator: Any, model: Any, eval_dl: Any) -> float:
    import torch

    model.eval()
    total = torch.zeros((), device=accelerator.device)
    count = 0
    with torch.no_grad():
        for batch in eval_dl:
            total += model(input_ids=batch, labels=batch).loss.float()
            count += 1
    model.train()
    mean = accelerator.reduce(total / max(count, 1), reduction="mean")
    return float(mean.item())


def _loop(
    run: RunContext,
    job: ResolvedJob,
    state: TrainerState,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    sampler: Any,
    train_dl: Any,
    eval_dl: Any,
    manager: CheckpointManager,
    max_steps: int,
    batches_per_epoch: int,
) -> dict[str, Any]:
    import torch

    accelerator = run.accelerator
    cfg = job.config
    t_cfg = cfg.training
    world = accelerator.num_processes
    tokens_per_step = t_cfg.micro_batch_size * cfg.data.seq_len * t_cfg.gradient_accumulation_steps * world
    start_step = state.step
    elapsed_before = state.elapsed_s  # training time of the runs this one resumes
    t_start = time.perf_counter()
    t_prev = t_start
    step_times: list[float] = []
    loss_sum = torch.zeros((), device=accelerator.device)
    grad_norm: Any = None
    meter = run.extras["model_state_meter"]
    last_loss = best_loss = eval_loss = None
    saved: list[str] = []

    def committed(step: int, path: Path) -> None:
        saved.append(str(path))
        call_lifecycle("acc_train_checkpoint_saved", run=run, step=step, path=str(path))

    manager.on_commit = committed
    model.train()

    while state.step < max_steps:
        train_dl.set_epoch(state.epoch)  # Accelerate's loader re-sets the sampler's epoch from its own count
        sampler.set_start(state.batches_in_epoch * world * t_cfg.micro_batch_size)
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
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
            state.tokens += tokens_per_step
            if state.batches_in_epoch >= batches_per_epoch:
                state.epoch += 1
                state.batches_in_epoch = state.samples_in_epoch = 0
            fault_point("train-step", state.step)
            now = time.perf_counter()
            if state.step - start_step > WARMUP_STEPS:
                step_times.append(now - t_prev)
            elapsed = elapsed_before + now - t_start
            metrics: dict[str, Any] = {"step": state.step, "epoch": state.epoch}
            last = state.step >= max_steps
            if state.step % t_cfg.log_every == 0 or last:
                mean_loss = accelerator.reduce(loss_sum / t_cfg.gradient_accumulation_steps, reduction="mean")
                last_loss = float(mean_loss.item())
                best_loss = last_loss if best_loss is None else min(best_loss, last_loss)
                metrics.update(
                    loss=last_loss,
                    lr=lr,
                    grad_norm=float(grad_norm) if grad_norm is not None else None,
                    tokens=state.tokens,
                    tokens_per_s=(state.step - start_step) * tokens_per_step / max(now - t_start, 1e-9),
                    elapsed_s=round(elapsed, 4),
                )
            loss_sum.zero_()
            call_lifecycle("acc_train_step_end", run=run, step=state.step, metrics=metrics)
            if eval_dl is not None and ((t_cfg.eval_every and state.step % t_cfg.eval_every == 0) or last):
                eval_loss = _evaluate(accelerator, model, eval_dl)
                call_lifecycle("acc_train_eval_end", run=run, step=state.step, metrics={"step": state.step, "eval_loss": eval_loss})
            every = cfg.checkpoint.every
            if (every and state.step % every == 0) or last:
                state.elapsed_s = elapsed
                manager.save(model, optimizer, scheduler, state)
            t_prev = time.perf_counter()  # evaluation and saving stay out of the step time
            if last:
                break
    # an asynchronous last save is committed before the run is summed up
    run.extras["checkpoint_final_wait_s"] = manager.finish()
    run.extras["checkpoint_blocked_s"] = manager.blocked_s
    elapsed_run = time.perf_counter() - t_start
    return _summary(run, job, state, model, start_step, elapsed_run, step_times, last_loss, best_loss, eval_loss, saved)


def _summary(
    run: RunContext,
    job: ResolvedJob,
    state: TrainerState,
    model: Any,
    start_step: int,
    elapsed_run: float,
    step_times: list[float],
    last_loss: float | None,
    best_loss: float | None,
    eval_loss: float | None,
    saved: list[str],
) -> dict[str, Any]:
    from accelerate.utils import gather_object

    accelerator = run.accelerator
    machine = accelerator.acc_machine
    local_elements, model_elements = job.strategy.parameter_elements(accelerator, model)
    mine = {
        "rank": accelerator.process_index,
        "param_elements": local_elements,
        "peak_memory_bytes": _peak_memory_bytes(machine.device_type),
        "param_checksum": _param_checksum(model),
        "model_state_bytes": meter.result() if (meter := run.extras["model_state_meter"]) is not None else None,
    }
    per_rank = sorted(gather_object([mine]), key=lambda r: r["rank"])
    tokens_run = (state.step - start_step) * job.config.training.micro_batch_size * job.config.data.seq_len * job.config.training.gradient_accumulation_steps * accelerator.num_processes
    return {
        "strategy": job.config.strategy["name"],
        "strategy_options": job.strategy.options.model_dump(mode="json"),
        "distributed_type": str(accelerator.distributed_type),
        "world_size": accelerator.num_processes,
        "num_machines": machine.num_machines,
        "device": machine.device_type,
        "mixed_precision": accelerator.mixed_precision,
        **job.strategy.summary(accelerator),
        "steps": state.step,
        "start_step": start_step,
        "epoch": state.epoch,
        "final_loss": last_loss,
        "best_loss": best_loss,
        "final_eval_loss": eval_loss,
        "tokens": state.tokens,
        "tokens_per_s": tokens_run / elapsed_run if elapsed_run > 0 else None,
        "elapsed_s": round(state.elapsed_s, 3),
        "step_time_s": statistics.fmean(step_times) if step_times else None,
        "step_time_median_s": statistics.median(step_times) if step_times else None,
        "checkpoint_saves": {
            "mode": "async" if job.config.checkpoint.async_save else "sync",
            "blocked_s": [round(t, 4) for t in run.extras["checkpoint_blocked_s"]],
            "mean_blocked_s": statistics.fmean(run.extras["checkpoint_blocked_s"]) if run.extras["checkpoint_blocked_s"] else None,
            # after the last step: waiting for the last asynchronous save's writes
            "final_wait_s": round(run.extras["checkpoint_final_wait_s"], 4),
        },
        "model_parameters": model_elements,
        "per_rank": per_rank,
        "checkpoints": saved,
    }


def _save_final(accelerator: Any, model: Any, tokenizer: Any, out: Path) -> None:
    """``final/``: the consolidated model as ``save_pretrained`` safetensors, moved in atomically."""
    state_dict = accelerator.acc_strategy.full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        tmp = out / ".final.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        final = out / "final"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
