"""Training a job: ``train()`` reads as the steps it takes (data, model, prepare, resume, loop,
finish), each a function of :mod:`acc_train.loop`; and the output directory it writes into.

The steps know nothing strategy-specific: the strategy shapes the Accelerator, names the
checkpoint format and may supply a model-state meter, and that is all. Importing it imports no
torch (nor do the loop modules): the CLI uses :func:`prepare_output_dir` before workers start.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.checkpoint import check_async_save, check_same_model, find_checkpoint, model_fingerprint, verify_checkpoint
from acc_train.errors import UserError
from acc_train.loop import LoopInputs, finish, run_loop, setup
from acc_train.metrics import METRICS_FILE
from acc_train.plugins import call_lifecycle, checkpoint_formats
from acc_train.run import RunContext, reporting

if TYPE_CHECKING:
    from acc_train.config import ResolvedJob

__all__ = ["train", "prepare_output_dir", "RUN_FILES"]

#: What a run writes into its output directory (an existing one is never silently replaced).
RUN_FILES = ("config.yaml", METRICS_FILE, "run.json", "checkpoints", "final", "logs")


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


def train(job: ResolvedJob) -> dict[str, Any]:
    """Run the job on this process (one rank of the launched workers). Returns run.json's content."""
    accelerator = setup.make_accelerator(job)
    data = setup.load_data(job, accelerator)
    built = setup.build_model(job, data)
    prepared = setup.prepare(job, accelerator, built, data)
    manager = setup.checkpoint_manager(job, accelerator, built, data)
    state, resumed_from = setup.resume(job, manager, prepared, data.max_steps)

    run = RunContext(
        job=job,
        accelerator=accelerator,
        output_dir=Path(job.config.output_dir),
        max_steps=data.max_steps,
        step=state.step,
        model=prepared.model,
        optimizer=prepared.optimizer,
        model_state_meter=job.strategy.model_state_meter(accelerator, prepared.model, prepared.optimizer),
    )
    with reporting(run):
        call_lifecycle("acc_train_train_start", run=run)
        result = run_loop(LoopInputs(run, state, prepared.scheduler, prepared.train_dl, prepared.eval_dl, data.sampler, data.batches_per_epoch, manager))
        summary = finish.summarize(run, state, result, resumed_from)
        finish.save_final(run, data.tokenizer)
        finish.write_run_json(run, summary)
        call_lifecycle("acc_train_train_end", run=run, summary=summary)
    return summary
