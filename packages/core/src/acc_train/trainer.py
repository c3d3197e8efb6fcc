"""Training a job: ``train()`` reads as the steps it takes (data, model, prepare, resume, loop,
finish), each a function of :mod:`acc_train.loop`; and the output directory it writes into.

The steps know nothing strategy-specific: the strategy shapes the Accelerator, names the
checkpoint format and may supply a model-state meter, and that is all. Importing it imports no
torch (nor do the loop modules): the CLI uses :func:`check_output_dir` before workers start.

Nothing under the output directory changes until every check that can refuse the run has
passed: the CLI's (:func:`check_output_dir`) before launch, then every rank's (data, model,
``--resume``) inside ``train()``; only then does rank 0 delete the run ``--overwrite``
replaces and put ``config.yaml`` in place (:func:`claim_output_dir`), and ``metrics.jsonl``
is rewritten after that, when training starts.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.checkpoint import (
    check_async_save,
    check_same_model,
    find_checkpoint,
    model_fingerprint,
    verify_checkpoint,
)
from acc_train.contracts.replica_groups import replica_groups_of
from acc_train.errors import UserError
from acc_train.loop import LoopInputs, finish, run_loop, setup
from acc_train.outputs.metrics import METRICS_FILE
from acc_train.files.output_paths import check_creatable, fresh_directory, replace_file
from acc_train.model.prompt_text import check_prompts
from acc_train.plugins import call_lifecycle, checkpoint_formats
from acc_train.run import RunContext, reporting

if TYPE_CHECKING:
    from acc_train.accelerator import Accelerator
    from acc_train.config import ResolvedJob
    from acc_train.launch.stop_signals import StopRequest

__all__ = ["train", "check_output_dir", "claim_output_dir", "restart_resumes", "restart_count", "claimed_marker", "runs_again", "RUN_FILES"]

#: What a run writes into its output directory (an existing one is never silently replaced).
RUN_FILES = ("config.yaml", METRICS_FILE, "run.json", "checkpoints", "final", "logs")


def _warn(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")


def _previous_run(out: Path) -> list[str]:
    """The files of a run in ``out`` (a config.yaml alone is a launch that never trained)."""
    return [name for name in RUN_FILES if name != "config.yaml" and (out / name).exists()]


def check_output_dir(job: ResolvedJob) -> Path:
    """Refuse, before workers start, an output directory the run cannot write or must not
    replace, and a ``--resume`` that cannot succeed. Writes nothing.

    Called once, by the command on machine 0. A resume's checkpoint is checked whole here (its
    files against the manifest, the model); the workers check it again against what they
    build.
    """
    cfg = job.config
    if cfg.resume and cfg.overwrite:
        raise UserError(
            f"--resume {cfg.resume} continues the run in {cfg.output_dir!r}, and --overwrite would replace it",
            where="--overwrite",
            hint="drop --overwrite to continue the run, or --resume to start it over",
        )
    out = check_creatable(cfg.output_dir, "--output-dir")
    existing = _previous_run(out)
    groups = replica_groups_of(job.strategy)
    if existing and not cfg.resume and not cfg.overwrite and groups is not None and groups.rejoins_run:
        # the same command again (a relaunched replica group): its run is taken over, from its
        # latest checkpoint or from the start, and the strategy brings it up to its peers
        if find_checkpoint(out, "auto") is not None:
            cfg.resume = "auto"
        else:
            cfg.overwrite = True
    if existing and not cfg.resume and not cfg.overwrite:
        raise UserError(
            f"{str(out)!r} already holds a run ({', '.join(existing)})",
            where="--output-dir",
            hint="pass --resume latest to continue it, --overwrite to replace it, or another --output-dir",
        )
    if cfg.checkpoint.async_save:
        check_async_save(checkpoint_formats().get(job.strategy.checkpoint_format_name()))
    if cfg.resume:  # fail before launch on a bad --resume
        path = find_checkpoint(out, cfg.resume, warn=_warn)
        if path is None and existing:  # auto, and nothing to resume: starting over would replace the run
            raise UserError(
                f"--resume {cfg.resume}: {str(out)!r} holds a run ({', '.join(existing)}) but no complete checkpoint to continue from",
                where="--resume",
                hint="pass --overwrite (without --resume) to start it over, or another --output-dir",
            )
        if path is not None:
            from acc_train.model.build import model_config

            # sizes, structure and unlisted files here; the workers hash the content, each its share
            check_same_model(verify_checkpoint(path, hashes=False), model_fingerprint(model_config(cfg)), path)
    return out


def claim_output_dir(job: ResolvedJob, accelerator: Accelerator, config_file: str | None = None) -> None:
    """Once every rank has passed its checks: replace the previous run if ``--overwrite`` says
    so, and write ``config.yaml`` (``config_file``'s text, the resolved config the command
    handed the workers; the job's own YAML without one). Rank 0 writes; every rank waits."""
    accelerator.wait_for_everyone()  # every rank's checks have passed
    cfg = job.config
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        try:
            aside = None
            if cfg.overwrite and not cfg.resume and _previous_run(out):  # (a restarted worker resumes: it never deletes)
                # moved aside whole first (renames: a failure leaves the old run in place), deleted last
                aside = fresh_directory(out, ".replaced-run-")
                for name in _previous_run(out):
                    os.rename(out / name, aside / name)
            out.mkdir(parents=True, exist_ok=True)
            text = Path(config_file).read_bytes() if config_file else job.to_yaml().encode()
            replace_file(out / "config.yaml", text)
        except OSError as exc:
            if aside is not None:  # put back what was moved
                for moved in aside.iterdir():
                    os.rename(moved, out / moved.name)
                aside.rmdir()
            from acc_train.files.disk_full import disk_full_error

            full = disk_full_error(exc, out, what="while writing the run's files into", done="nothing of the run was changed")
            raise full or UserError(f"cannot write the run's files into {str(out)!r}: {exc}", where="--output-dir") from None
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    accelerator.wait_for_everyone()


def restart_count() -> int:
    """How many times this machine's elastic agent has restarted its workers (0 on the first
    attempt, and on a machine whose ``acc-train`` was started again to rejoin the run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def claimed_marker(config_file: str) -> Path:
    """The file a machine's workers leave next to the launch's resolved config once they have
    claimed the output directory: a later attempt of the same launch (a restart, or a
    re-rendezvous after a machine left and came back) continues that run instead of claiming
    it again. The command removes it with the config file."""
    return Path(f"{config_file}.claimed")


def runs_again(config_file: str | None) -> bool:
    """Whether this machine's workers are a later attempt of their launch: restarted after a
    failure, or started again after a machine left and rejoined (the launch had claimed the run)."""
    return restart_count() > 0 or (config_file is not None and claimed_marker(config_file).exists())


def restart_resumes(job: ResolvedJob, config_file: str) -> bool:
    """Whether workers restarted after a failure (``--max-restarts``) continue from the latest
    checkpoint: yes, unless ``--resume`` already says where from, or the run ``--overwrite``
    replaces is still there because the failed attempt never got past its checks (no claim
    marker of this launch, and its ``config.yaml`` is older than ``config_file``, which the
    command wrote at launch)."""
    if job.config.resume:
        return False
    if not job.config.overwrite or claimed_marker(config_file).exists():
        return True
    written = Path(job.config.output_dir) / "config.yaml"
    return written.is_file() and written.stat().st_mtime_ns >= Path(config_file).stat().st_mtime_ns


def _agree_on_resume(resume: str | None, restarts: int, again: bool) -> tuple[str | None, int, bool]:
    """Every rank's ``--resume``, restart count and whether its machine's workers run again ->
    the run's: the first rank's resume that has one (a user's ``--resume`` is the same on
    every rank; ``auto`` where some machine's workers were restarted or had claimed the run: a
    machine that rejoins runs a fresh agent, restart count 0, and may even hold rank 0), the
    most restarts, and whether any machine's workers run again."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return resume, restarts, again
    votes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(votes, (resume, restarts, again))
    return next((r for r, _, _ in votes if r), None), max(n for _, n, _ in votes), any(a for _, _, a in votes)


def _say_restart(restarts: int, resumed_from: str | None, output_dir: str) -> None:
    """The launch log's line for workers started again in a launch that had trained (main
    process): after a failure, or in a new rendezvous round after a machine rejoined."""
    why = f"workers restarted ({restarts} restart{'s' if restarts != 1 else ''} so far)" if restarts else "workers started again (a machine rejoined)"
    where = f"resuming from {resumed_from}" if resumed_from else f"no complete checkpoint in {output_dir!r} yet: starting from step 0"
    sys.stderr.write(f"acc-train: {why}: {where}\n")
    sys.stderr.flush()


def _losses_from_metrics(output_dir: Path, step: int, result: Any) -> None:
    """A run resumed at its last step trains nothing: its final and best losses are those its
    earlier launches logged in metrics.jsonl (kept up to the checkpoint's step)."""
    from acc_train.outputs.metrics import read_metrics

    try:
        steps = read_metrics(output_dir).steps
    except UserError:
        return
    losses = [row.loss for s, row in steps.items() if s <= step and row.loss is not None]
    if losses:
        result.last_loss, result.best_loss = steps[max(s for s in steps if s <= step)].loss, min(losses)


def _mfu_basis(job: ResolvedJob, accelerator: Accelerator, model: Any) -> dict[str, Any]:
    """FLOPs per token of the built model (counted before a strategy shards it) and the peak of
    the devices training it: each GPU's, or each machine's CPU (its ranks share its cores)."""
    from acc_train.outputs.mfu import compute_precision, run_basis

    machine = accelerator.acc_machine
    devices = accelerator.num_processes if machine.device_type != "cpu" else machine.num_machines
    precision = compute_precision(accelerator.mixed_precision, job.config.model.dtype)
    return run_basis(model, job.config.data.seq_len, machine.device_type, precision, devices)


def train(job: ResolvedJob, config_file: str | None = None, stop: StopRequest | None = None) -> dict[str, Any]:
    """Run the job on this process (one rank of the launched workers). Returns run.json's content,
    or, for a run the ranks stopped on a signal (``stop``, set by the worker's handlers),
    ``{"stopped_by": SIGNUM, "step": N, "checkpoint": PATH}`` (no ``final/``, no ``run.json``).

    ``config_file`` is the resolved config the workers were started with; it becomes the run's
    ``config.yaml`` once every check has passed (:func:`claim_output_dir`)."""
    started_at = setup.launch_time() or time.time()
    accelerator = setup.make_accelerator(job)
    # one decision for all (a restarted worker's resume is decided per rank, from files and
    # restart counts that machines see differently): every rank takes the same path into the collectives
    job.config.resume, restarts, again = _agree_on_resume(job.config.resume, restart_count(), runs_again(config_file))
    data = setup.load_data(job, accelerator)
    check_prompts(job.config.eval.samples, data.tokenizer)  # (the command checked them before the launch too)
    built = setup.build_model(job, data)
    # counted before prepare: FSDP1 flattens and shards the built model's parameters in place
    mfu_basis = _mfu_basis(job, accelerator, built.model)
    prepared = setup.prepare(job, accelerator, built, data)
    manager = setup.checkpoint_manager(job, accelerator, built, data)
    state, resumed_from = setup.resume(job, manager, prepared, data.max_steps, data.stream)
    if again and accelerator.is_main_process:
        _say_restart(restarts, resumed_from, job.config.output_dir)
    claim_output_dir(job, accelerator, config_file)
    if config_file and accelerator.is_local_main_process:  # this launch now owns the run (see claimed_marker)
        claimed_marker(config_file).touch()
    manager.discard_unfinished_saves()

    run = RunContext(
        job=job,
        accelerator=accelerator,
        output_dir=Path(job.config.output_dir),
        max_steps=data.max_steps,
        step=state.step,
        model=prepared.model,
        optimizer=prepared.optimizer,
        scheduler=prepared.scheduler,
        state=state,
        model_state_meter=job.strategy.model_state_meter(accelerator, prepared.model, prepared.optimizer),
        mfu_basis=mfu_basis,
    )
    manager.attach(run)  # the strategy's own state: restored now, saved with every checkpoint
    with reporting(run):
        call_lifecycle("acc_train_train_start", run=run)
        result = run_loop(
            LoopInputs(run, state, prepared.scheduler, prepared.train_dl, prepared.eval_dl, data.sampler, data.batches_per_epoch, manager, data.stream, stop)
        )
        if result.stopped_by is not None:  # saved at this step; the run goes on with --resume auto
            return {"stopped_by": result.stopped_by, "step": state.step, "checkpoint": result.saved[-1] if result.saved else None}
        if result.start_step >= run.max_steps:  # resumed only to finish: the losses are the logged ones
            _losses_from_metrics(run.output_dir, state.step, result)
        summary = finish.summarize(run, state, result, resumed_from, data.prepared.summary(), started_at)
        summary["restarts"] = restarts  # the elastic agents' restarts of the workers (the most any machine's made)
        finish.save_final(run, data.tokenizer, summary)
        finish.write_run_json(run, summary)
        call_lifecycle("acc_train_train_end", run=run, summary=summary)
    return summary
