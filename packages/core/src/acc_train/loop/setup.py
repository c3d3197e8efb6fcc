"""Building what the loop runs on, one step each: the Accelerator, the data, the model, the
prepared objects and the point a resumed run continues from.

The strategy is reached here twice: it shapes the Accelerator (inside ``acc_train.Accelerator``)
and names the checkpoint format (:func:`checkpoint_manager`). ``train()`` asks it for its
model-state meter; ``finish`` for its parameter counts and summary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.checkpoint import CheckpointManager, TrainerState, find_checkpoint, model_fingerprint
from acc_train.errors import UserError
from acc_train.plugins import checkpoint_formats, library_versions

if TYPE_CHECKING:
    from acc_train.accelerator import Accelerator
    from acc_train.config import ResolvedJob
    from acc_train.data import ResumableSampler

__all__ = ["TrainData", "BuiltModel", "Prepared", "make_accelerator", "load_data", "build_model", "prepare", "checkpoint_manager", "resume"]


@dataclass
class TrainData:
    """The job's data, ready to be prepared: loaders over fixed-length blocks of token ids."""

    tokenizer: Any
    sampler: ResumableSampler
    train_dl: Any
    eval_dl: Any | None
    #: blocks of training data (part of the data signature a resume must match)
    train_blocks: int
    #: micro-batches each rank reads in one epoch (a whole number of optimizer steps)
    batches_per_epoch: int
    max_steps: int
    #: the largest token id in the data, checked against the model's vocabulary
    top_token: int


@dataclass
class BuiltModel:
    """The model before ``prepare`` wraps it, and what is read from it while it is still plain."""

    model: Any
    fingerprint: dict[str, Any]
    class_name: str
    #: the full transformers config, written into checkpoints for ``checkpoint export``
    config: dict[str, Any]


@dataclass
class Prepared:
    """The objects the loop steps, as the strategy wrapped them."""

    model: Any
    optimizer: Any
    scheduler: Any
    train_dl: Any
    eval_dl: Any | None


def make_accelerator(job: ResolvedJob) -> Accelerator:
    """``acc_train.Accelerator`` for the job's strategy, seeded."""
    from accelerate.utils import ProjectConfiguration, set_seed

    from acc_train.accelerate_compat import skip_unused_library_imports
    from acc_train.accelerator import Accelerator

    skip_unused_library_imports()  # acc-train's own loop: a user's script (acc-train launch) is left as it is
    t_cfg = job.config.training
    out = Path(job.config.output_dir)
    accelerator = Accelerator(
        strategy=job.strategy,
        job=job,
        mixed_precision=t_cfg.mixed_precision,
        gradient_accumulation_steps=t_cfg.gradient_accumulation_steps,
        log_with=t_cfg.report_to or None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        step_scheduler_with_optimizer=False,
    )
    set_seed(t_cfg.seed)
    return accelerator


def load_data(job: ResolvedJob, accelerator: Accelerator) -> TrainData:
    """Tokenize the data into blocks (main process first, so a cache is built once) and make loaders."""
    import torch
    from torch.utils.data import DataLoader

    from acc_train.data import BlockDataset, ResumableSampler, load_blocks
    from acc_train.model import load_tokenizer

    cfg = job.config
    t_cfg = cfg.training
    world, mbs, gas = accelerator.num_processes, t_cfg.micro_batch_size, t_cfg.gradient_accumulation_steps
    tokenizer = load_tokenizer(cfg.model)
    with accelerator.main_process_first():
        train_blocks, eval_blocks = load_blocks(cfg.data, tokenizer)
    top = max(int(b.max().item()) for b in (train_blocks, eval_blocks) if b is not None)
    sampler = ResumableSampler(len(train_blocks), t_cfg.seed, cfg.data.shuffle, group=world * mbs * gas)
    # its own generator: starting an iterator must not draw from the global RNG, or a resumed
    # run would be one draw ahead of the uninterrupted one
    train_dl = DataLoader(BlockDataset(train_blocks), batch_size=mbs, sampler=sampler, drop_last=True, generator=torch.Generator())
    eval_dl = None
    if eval_blocks is not None:
        eval_blocks = eval_blocks[: t_cfg.eval_batches * world * mbs]
        eval_dl = DataLoader(BlockDataset(eval_blocks), batch_size=mbs, shuffle=False, generator=torch.Generator())
    batches_per_epoch = sampler.usable // (world * mbs)
    max_steps = cfg.max_steps or t_cfg.epochs * (batches_per_epoch // gas)  # type: ignore[operator]
    return TrainData(tokenizer, sampler, train_dl, eval_dl, len(train_blocks), batches_per_epoch, max_steps, top)


def build_model(job: ResolvedJob, data: TrainData) -> BuiltModel:
    """The job's model, refused if the data holds token ids beyond its vocabulary; with
    ``training.gradient_checkpointing``, set to recompute its layers' activations."""
    from acc_train.machine import current_machine
    from acc_train.model import build_model as build
    from acc_train.model import check_attn_implementation, enable_gradient_checkpointing

    cfg = job.config
    check_attn_implementation(cfg.model, current_machine().device_type)
    model = build(cfg)
    if data.top_token >= model.config.vocab_size:
        raise UserError(
            f"the data holds token id {data.top_token}, but the model's vocab_size is {model.config.vocab_size}",
            where="model.tokenizer" if cfg.model.tokenizer else "model",
            hint="use the tokenizer that belongs to the model",
        )
    built = BuiltModel(model, model_fingerprint(model.config), type(model).__name__, json.loads(model.config.to_json_string(use_diff=False)))
    if cfg.training.gradient_checkpointing:  # after the fingerprint: use_cache is a training setting, not the model
        enable_gradient_checkpointing(model)
    return built


def _optimizer(model: Any, cfg: Any) -> Any:
    """AdamW; biases and norm weights get no weight decay."""
    import torch

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def prepare(job: ResolvedJob, accelerator: Accelerator, built: BuiltModel, data: TrainData) -> Prepared:
    """Let the strategy wrap model, optimizer and loaders; the scheduler follows the wrapped optimizer."""
    from transformers import get_scheduler

    cfg = job.config
    optimizer = _optimizer(built.model, cfg.optimizer)
    objects = [built.model, optimizer, data.train_dl] + ([data.eval_dl] if data.eval_dl is not None else [])
    model, optimizer, train_dl, *rest = accelerator.prepare(*objects)
    warmup = cfg.scheduler.warmup_steps
    if warmup is None:
        warmup = math.ceil(cfg.scheduler.warmup_ratio * data.max_steps)
    scheduler = get_scheduler(cfg.scheduler.name, optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=data.max_steps)
    return Prepared(model, optimizer, scheduler, train_dl, rest[0] if rest else None)


def checkpoint_manager(job: ResolvedJob, accelerator: Accelerator, built: BuiltModel, data: TrainData) -> CheckpointManager:
    """The run's checkpoints, in the format the strategy names."""
    cfg = job.config
    t_cfg = cfg.training
    fmt = checkpoint_formats().get(job.strategy.checkpoint_format_name())
    return CheckpointManager(
        accelerator,
        Path(cfg.output_dir),
        fmt,
        cfg.checkpoint.keep_last,
        {
            "strategy": cfg.strategy["name"],
            "strategy_options": job.strategy.options.model_dump(mode="json"),
            "model": built.fingerprint,
            "model_class": built.class_name,
            "versions": library_versions(),
        },
        # the data order is a function of these alone: processes, micro-batch size and
        # accumulation may change on resume as long as their product does not
        data_signature={
            "global_batch": accelerator.num_processes * t_cfg.micro_batch_size * t_cfg.gradient_accumulation_steps,
            "seed": t_cfg.seed,
            "shuffle": cfg.data.shuffle,
            "seq_len": cfg.data.seq_len,
            "train_files": cfg.data.train_files,
            "model": cfg.model.name_or_path or "demo",
            "train_blocks": data.train_blocks,
        },
        seed=t_cfg.seed,
        model_config=built.config,
        async_save=cfg.checkpoint.async_save,
    )


def resume(job: ResolvedJob, manager: CheckpointManager, prepared: Prepared, max_steps: int) -> tuple[TrainerState, str | None]:
    """Restore ``--resume``'s checkpoint, if there is one: (where training stands, its path).

    The command has said which checkpoint ``latest`` stands for when the pointer was not
    followed (:func:`acc_train.checkpoint.find_checkpoint`); the workers find the same one
    without repeating it."""
    cfg = job.config
    path = find_checkpoint(Path(cfg.output_dir), cfg.resume) if cfg.resume else None
    if path is None:
        return TrainerState(), None
    state = manager.load(path, prepared.model, prepared.optimizer, prepared.scheduler)
    per_batch = manager.accelerator.num_processes * cfg.training.micro_batch_size
    state.batches_in_epoch = state.samples_in_epoch // per_batch  # in this run's micro-batches
    if state.step >= max_steps:
        raise UserError(
            f"the checkpoint is at step {state.step}, and this run stops at step {max_steps}",
            where="--resume",
            hint="raise --max-steps to train further",
        )
    return state, str(path)
