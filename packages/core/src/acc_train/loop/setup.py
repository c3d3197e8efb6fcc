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
from acc_train.contracts.replica_groups import data_part
from acc_train.errors import UserError
from acc_train.plugins import checkpoint_formats, library_versions

if TYPE_CHECKING:
    from acc_train.accelerator import Accelerator
    from acc_train.config import ResolvedJob
    from acc_train.data import PreparedData, ResumableSampler
    from acc_train.data.stream import StreamedData, StreamRows

__all__ = ["TrainData", "BuiltModel", "Prepared", "make_accelerator", "load_data", "build_model", "prepare", "checkpoint_manager", "resume"]


@dataclass
class TrainData:
    """The job's data, ready to be prepared: loaders over rows of token ids and labels."""

    tokenizer: Any
    #: the order of the cached rows (None: streamed, each rank's stream keeps its own position)
    sampler: ResumableSampler | None
    train_dl: Any
    eval_dl: Any | None
    #: rows of training data (part of the data signature a resume must match)
    train_rows: int
    #: micro-batches each rank reads in one epoch (a whole number of optimizer steps)
    batches_per_epoch: int
    max_steps: int
    #: the largest token id in the data, checked against the model's vocabulary
    top_token: int
    #: what was prepared (run.json's ``data`` section)
    prepared: PreparedData | StreamedData
    #: data.streaming: this rank's stream, whose position every checkpoint saves
    stream: StreamRows | None = None


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
    """``acc_train.Accelerator`` for the job's strategy, seeded, compiling as ``training.compile`` says."""
    from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration, set_seed

    from acc_train.accelerate_compat import probe_libraries_once, skip_unused_library_imports
    from acc_train.accelerator import Accelerator
    from acc_train.machine import bound_here
    from acc_train.run import accelerate_log_with
    from acc_train.loop.torch_compile import dynamo_plugin

    skip_unused_library_imports()  # acc-train's own loop: a user's script (acc-train launch) is left as it is
    probe_libraries_once()
    t_cfg = job.config.training
    out = Path(job.config.output_dir)
    job.strategy = bound_here(job.strategy)  # the run reads the same strategy the Accelerator does
    accelerator = Accelerator(
        strategy=job.strategy,
        job=job,
        mixed_precision=t_cfg.mixed_precision,
        # counted in steps, not ended early at a loader's end: the loop reads a step's micro-batches
        # before the first forward (loop/loss.py), and an epoch is cut to whole steps anyway
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=t_cfg.gradient_accumulation_steps, sync_with_dataloader=False),
        log_with=accelerate_log_with(t_cfg.report_to) if t_cfg.report_to else None,  # Accelerate's own; a plugin's are made when they start
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
        step_scheduler_with_optimizer=False,
        dynamo_plugin=dynamo_plugin(t_cfg.compile),  # Accelerate compiles the prepared model (training.compile)
    )
    set_seed(t_cfg.seed)
    return accelerator


def load_data(job: ResolvedJob, accelerator: Accelerator) -> TrainData:
    """Open the prepared data (each machine's main process tokenizes it into the cache first
    when the command has not) and make loaders over its rows."""
    import torch
    from torch.utils.data import DataLoader

    from acc_train.data import Collate, ResumableSampler, TokenRows, demo_data, prepare_data
    from acc_train.model.build import load_tokenizer

    cfg = job.config
    t_cfg = cfg.training
    index, parts = data_part(job.strategy)  # several launches may split each global batch
    world, mbs, gas = accelerator.data_parallel_size * parts, t_cfg.micro_batch_size, t_cfg.gradient_accumulation_steps
    tokenizer = load_tokenizer(cfg.model)
    if cfg.data.streaming:
        return _streamed(job, accelerator, tokenizer)
    if cfg.data.train_files:
        with accelerator.local_main_process_first():
            prepared = prepare_data(cfg.data, tokenizer, since=launch_time())
    else:
        prepared = demo_data(cfg.data)
    train, held_out = prepared.train, prepared.eval
    if held_out is None and cfg.data.eval_fraction > 0 and len(train) > 1:
        n_eval = max(1, int(len(train) * cfg.data.eval_fraction))
        train, held_out = train.subset(0, len(train) - n_eval), train.subset(len(train) - n_eval, len(train))
    pad_id = _pad_id(tokenizer)
    collate = Collate(cfg.data.seq_len, prepared.packing, pad_id)
    sampler = ResumableSampler(len(train), t_cfg.seed, cfg.data.shuffle, group=world * mbs * gas, part=(index, parts, world // parts * mbs))
    # its own generator: starting an iterator must not draw from the global RNG, or a resumed
    # run would be one draw ahead of the uninterrupted one
    train_dl = DataLoader(TokenRows(train), batch_size=mbs, sampler=sampler, drop_last=True, collate_fn=collate, generator=torch.Generator())
    eval_dl = None
    if held_out is not None:
        held_out = held_out.subset(0, t_cfg.eval_batches * accelerator.data_parallel_size * mbs)
        eval_dl = DataLoader(TokenRows(held_out), batch_size=mbs, shuffle=False, collate_fn=collate, generator=torch.Generator())
    batches_per_epoch = sampler.usable // (world * mbs)
    max_steps = cfg.max_steps or t_cfg.epochs * (batches_per_epoch // gas)  # type: ignore[operator]
    return TrainData(tokenizer, sampler, train_dl, eval_dl, len(train), batches_per_epoch, max_steps, prepared.max_token, prepared)


def _streamed(job: ResolvedJob, accelerator: Accelerator, tokenizer: Any) -> TrainData:
    """data.streaming: this rank's share of the training files, read, tokenized and packed as
    training goes; its loader is not prepared (:class:`acc_train.data.stream.DeviceBatches`).
    Eval reads the first eval_batches x processes x micro-batch rows of data.eval_files the same
    way, and they are prepared like the cached path's (data.eval_fraction does not apply)."""
    import sys

    import torch
    from torch.utils.data import DataLoader

    from acc_train.data import Collate, data_kind
    from acc_train.data.stream import DeviceBatches, StreamedData, StreamRows, first_rows

    cfg = job.config
    d, t = cfg.data, cfg.training
    if not d.train_files or cfg.max_steps is None:  # the config's own check says so before launch
        raise UserError("data.streaming needs data.train_files and training.max_steps", where="data.streaming", hint="set both, or data.streaming=false")
    kind = data_kind(d)
    stream = StreamRows(d.train_files, "data.train_files", d, kind, tokenizer, accelerator.process_index // accelerator.batch_replicas, accelerator.data_parallel_size, t.seed, d.shuffle)
    collate = Collate(d.seq_len, stream.packing, _pad_id(tokenizer))
    # its own generator, as the cached loader's: starting the iterator on resume must not draw from the global RNG
    loader = DataLoader(stream, batch_size=t.micro_batch_size, collate_fn=collate, generator=torch.Generator())
    train_dl = DeviceBatches(loader, accelerator.device)
    eval_dl = None
    if d.eval_files:
        rows = first_rows(d.eval_files, "data.eval_files", d, kind, tokenizer, t.eval_batches * accelerator.data_parallel_size * t.micro_batch_size)
        eval_dl = DataLoader(rows, batch_size=t.micro_batch_size, shuffle=False, collate_fn=collate, generator=torch.Generator())
    # no epochs: batches_per_epoch is never reached, and the vocabulary is checked as tokens come
    return TrainData(tokenizer, None, train_dl, eval_dl, 0, sys.maxsize, cfg.max_steps, -1, StreamedData(kind.name, stream.packing, stream), stream)


def launch_time() -> float | None:
    """When the command that started this run began (``ACC_TRAIN_LAUNCH_TIME``), if it says."""
    import os

    raw = os.environ.get("ACC_TRAIN_LAUNCH_TIME")
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def _pad_id(tokenizer: Any) -> int:
    """Padding never counts (labels -100, masked out); any id in the vocabulary serves."""
    if tokenizer is None:
        return 0
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def build_model(job: ResolvedJob, data: TrainData) -> BuiltModel:
    """The job's model (in ``model.dtype``'s precision, a warning for pure low precision),
    refused if the data holds token ids beyond its vocabulary; with
    ``training.gradient_checkpointing``, set to recompute its layers' activations; with
    ``model.lora``, wrapped by PEFT (only the adapters train)."""
    from acc_train.machine import current_machine
    from acc_train.model.build import build_model as build
    from acc_train.model.build import check_attn_implementation, enable_gradient_checkpointing

    cfg = job.config
    if cfg.model.dtype in ("bf16", "fp16"):
        from acc_train.machine import warn_once_per_machine

        warn_once_per_machine(job.strategy.planner().low_precision_warning(cfg.model.dtype))
    check_attn_implementation(cfg.model, current_machine().device_type)
    model = build(cfg)
    if data.stream is not None:  # streamed: checked as the tokens come
        data.stream.vocab_size = model.config.vocab_size
    if data.top_token >= model.config.vocab_size:
        raise UserError(
            f"the data holds token id {data.top_token}, but the model's vocab_size is {model.config.vocab_size}",
            where="model.tokenizer" if cfg.model.tokenizer else "model",
            hint="use the tokenizer that belongs to the model",
        )
    from acc_train.loop.loss import packed_mask_kind

    if packed_mask_kind(model) == "varlen":  # flash attention: the packed boundaries as its varlen keywords
        for loader in (data.train_dl, data.eval_dl):
            inner = getattr(loader, "loader", loader)  # a streamed loader is wrapped (DeviceBatches)
            collate = getattr(inner, "collate_fn", None)
            if collate is not None and hasattr(collate, "varlen"):
                collate.varlen = True
    built = BuiltModel(model, model_fingerprint(model.config), type(model).__name__, json.loads(model.config.to_json_string(use_diff=False)))
    if cfg.training.gradient_checkpointing:  # after the fingerprint: use_cache is a training setting, not the model
        enable_gradient_checkpointing(model)
    if cfg.model.lora is not None:  # the base model's config and class stay the fingerprint
        from acc_train.model.adapters import apply_lora

        built.model = apply_lora(model, cfg)
    return built


def _optimizer(model: Any, job: ResolvedJob, accelerator: Accelerator) -> Any:
    """The optimizer ``optimizer.name`` selects, once it is known to run here under this
    strategy; biases and norm weights get no weight decay."""
    from acc_train.config.optimizer import check_optimizer
    from acc_train.model.optimizer import parameter_groups

    cfg = job.config.optimizer
    kind = check_optimizer(job, accelerator.acc_machine)
    return kind.build(parameter_groups(model, cfg.weight_decay), cfg, accelerator.device)


def prepare(job: ResolvedJob, accelerator: Accelerator, built: BuiltModel, data: TrainData) -> Prepared:
    """Let the strategy wrap model, optimizer and loaders; the scheduler follows the wrapped optimizer."""
    from transformers import get_scheduler

    cfg = job.config
    optimizer = _optimizer(built.model, job, accelerator)
    streamed = data.stream is not None  # a stream's loader is not prepared (see _streamed)
    objects = [built.model, optimizer] + ([] if streamed else [data.train_dl]) + ([data.eval_dl] if data.eval_dl is not None else [])
    stand_in = streamed and data.eval_dl is None
    if stand_in:  # a strategy may take the micro-batch size from a prepared loader ("auto"): an empty one says it
        from torch.utils.data import DataLoader

        objects.append(DataLoader([], batch_size=cfg.training.micro_batch_size))
    model, optimizer, *rest = accelerator.prepare(*objects)
    if stand_in:
        rest.pop()
    train_dl = data.train_dl if streamed else rest.pop(0)
    warmup = cfg.scheduler.warmup_steps
    if warmup is None:
        warmup = math.ceil(cfg.scheduler.warmup_ratio * data.max_steps)
    scheduler = get_scheduler(cfg.scheduler.name, optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=data.max_steps)
    return Prepared(model, optimizer, scheduler, train_dl, rest[0] if rest else None)


def checkpoint_manager(job: ResolvedJob, accelerator: Accelerator, built: BuiltModel, data: TrainData) -> CheckpointManager:
    """The run's checkpoints, in the format the strategy names."""
    from acc_train.model.adapters import adapter_manifest

    cfg = job.config
    t_cfg = cfg.training
    fmt = checkpoint_formats().get(job.strategy.checkpoint_format_name())
    # the data order is a function of these alone: processes, micro-batch size and
    # accumulation may change on resume as long as their product does not
    signature = {
        "global_batch": accelerator.data_parallel_size * data_part(job.strategy)[1] * t_cfg.micro_batch_size * t_cfg.gradient_accumulation_steps,
        "seed": t_cfg.seed,
        "shuffle": cfg.data.shuffle,
        "seq_len": cfg.data.seq_len,
        "train_files": cfg.data.train_files,
        "model": cfg.model.name_or_path or "demo",
        "kind": data.prepared.kind,
        "packing": data.prepared.packing,
    }
    digest = (data.prepared.counts or {}).get("digest") if data.stream is None else None  # type: ignore[union-attr]
    if digest is not None:  # the tokens themselves: the same data resumes wherever its files now are, other data never
        del signature["train_files"]
        signature["train_digest"] = digest
    if data.stream is None:
        signature.update(train_rows=data.train_rows, train_tokens=data.prepared.counts["tokens"])  # type: ignore[union-attr]
    else:  # each rank's position is in its own share of the stream (resume() refuses another world size first)
        signature.update(streaming=True, world_size=accelerator.num_processes)
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
            # LoRA: the checkpoints hold the adapters alone, and the base model they belong to
            "adapters": adapter_manifest(cfg),
            "versions": library_versions(),
            "optimizer": cfg.optimizer.name,  # its state is another optimizer's to no other
        },
        data_signature=signature,
        seed=t_cfg.seed,
        model_config=built.config,
        async_save=cfg.checkpoint.async_save,
    )


def resume(job: ResolvedJob, manager: CheckpointManager, prepared: Prepared, max_steps: int, stream: StreamRows | None = None) -> tuple[TrainerState, str | None]:
    """Restore ``--resume``'s checkpoint, if there is one: (where training stands, its path).

    The command has said which checkpoint ``latest`` stands for when the pointer was not
    followed (:func:`acc_train.checkpoint.find_checkpoint`); the workers find the same one
    without repeating it."""
    cfg = job.config
    path = find_checkpoint(Path(cfg.output_dir), cfg.resume) if cfg.resume else None
    if path is None:
        return TrainerState(), None
    if stream is not None:
        _check_stream_world(path, stream.world_size)
    state = manager.load(path, prepared.model, prepared.optimizer, prepared.scheduler)
    if stream is not None:  # each rank continues its own stream
        if not state.stream or len(state.stream) != stream.world_size:
            raise UserError(f"checkpoint {str(path)!r} holds no stream position for {stream.world_size} processes", where="--resume", hint="a checkpoint of a cached run resumes with data.streaming=false")
        stream.load_state_dict(state.stream[stream.rank])
    per_batch = manager.accelerator.data_parallel_size * data_part(job.strategy)[1] * cfg.training.micro_batch_size
    state.batches_in_epoch = state.samples_in_epoch // per_batch  # in this run's micro-batches
    out = Path(cfg.output_dir)
    if state.step == max_steps and not ((out / "run.json").is_file() and (out / "final").is_dir()):
        return state, str(path)  # trained to the end, then stopped while finishing: finish it (final/, run.json)
    if state.step >= max_steps:
        raise UserError(
            f"the checkpoint is at step {state.step}, and this run stops at step {max_steps}",
            where="--resume",
            hint="raise --max-steps to train further",
        )
    return state, str(path)


def _check_stream_world(path: Path, world_size: int) -> None:
    """A streamed run resumes under the world size that wrote it: each rank's position is in
    its own share of the stream, and another number of processes splits it otherwise."""
    from acc_train.checkpoint.manifest import read_manifest

    manifest = read_manifest(path)
    written = manifest.get("world_size")
    if (manifest.get("data") or {}).get("streaming") and written != world_size:  # (a cached run's: the data signature refuses)
        raise UserError(
            f"checkpoint {str(path)!r} was written by a streamed run (data.streaming) of {written} processes, and this run has {world_size}: "
            "each process's position is in its own share of the stream, which another number of processes splits otherwise",
            where="--num-processes",
            hint=f"resume with {written} processes in all (--num-processes x --num-machines); the cached data (data.streaming=false) resumes under any world size, but not from this checkpoint",
        )
