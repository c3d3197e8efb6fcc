"""Turns the command line (flags, ``--set`` and the default config file) into a resolved job.

Training, ``launch`` and ``plan`` all resolve their job here, so the three read the same sources
in the same order: defaults < the default config file or ``--config FILE`` < flags < ``--set``.
Only click is imported at module level.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from acc_train.config import ResolvedJob

__all__ = ["FLAG_KEYS", "LOOP_ONLY", "flag_name", "given", "job_options", "merge_parent_params", "resolve_job"]


#: click parameter name -> dotted config key it sets
FLAG_KEYS: dict[str, str] = {
    "strategy": "strategy.name",
    "num_processes": "launch.num_processes",
    "num_machines": "launch.num_machines",
    "machine_rank": "launch.machine_rank",
    "main_process_ip": "launch.main_process_ip",
    "main_process_port": "launch.main_process_port",
    "rdzv_backend": "launch.rdzv_backend",
    "max_restarts": "launch.max_restarts",
    "max_steps": "training.max_steps",
    "epochs": "training.epochs",
    "micro_batch_size": "training.micro_batch_size",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "mixed_precision": "training.mixed_precision",
    "seed": "training.seed",
    "report_to": "training.report_to",
    "lr": "optimizer.lr",
    "output_dir": "output_dir",
    "resume": "resume",
    "overwrite": "overwrite",
}

#: options that only mean something to acc-train's own loop, not to a launched script
LOOP_ONLY = (
    "max_steps", "epochs", "micro_batch_size", "gradient_accumulation_steps", "lr", "seed",
    "output_dir", "report_to", "resume", "overwrite",
)  # fmt: skip


def job_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The job options, shared by training and ``launch``."""
    opts = [
        click.option("--config", "config_file", metavar="FILE", help="YAML job config (defaults < file < flags < --set)."),
        click.option("--strategy", metavar="NAME", help="Strategy or preset name (`acc-train strategies` lists them)."),
        click.option("--num-processes", type=int, metavar="N", help="Processes per machine (default: one per GPU, or 1)."),
        click.option("--num-machines", type=int, metavar="N", help="Machines taking part (multi-node)."),
        click.option("--machine-rank", type=int, metavar="R", help="This machine's rank, 0 on the main machine."),
        click.option("--main-process-ip", metavar="ADDR", help="Address of machine 0 for the rendezvous."),
        click.option("--main-process-port", type=int, metavar="PORT", help="Port of the rendezvous on machine 0."),
        click.option("--rdzv-backend", type=click.Choice(["static", "c10d"]), help="Multi-node rendezvous: static ranks or c10d."),
        click.option("--max-restarts", type=int, metavar="N", help="Restart the workers up to N times after a failure."),
        click.option("--max-steps", type=int, metavar="N", help="Optimizer steps to train."),
        click.option("--epochs", type=int, metavar="N", help="Epochs to train (instead of --max-steps)."),
        click.option("--micro-batch-size", type=int, metavar="N", help="Sequences per process per micro-batch."),
        click.option("--gradient-accumulation-steps", type=int, metavar="N", help="Micro-batches per optimizer step."),
        click.option("--lr", type=float, metavar="LR", help="Peak learning rate."),
        click.option("--mixed-precision", type=click.Choice(["auto", "no", "bf16", "fp16"]), help="auto: bf16 where native, else fp32."),
        click.option("--seed", type=int, metavar="N", help="Random seed."),
        click.option("--output-dir", metavar="DIR", help="Where the run writes its outputs."),
        click.option("--report-to", multiple=True, metavar="TRACKER", help="Accelerate tracker, e.g. tensorboard (repeatable)."),
        click.option("--resume", metavar="latest|auto|PATH", help="Continue from a checkpoint."),
        click.option("--overwrite", is_flag=True, default=None, help="Replace a previous run in --output-dir."),
        click.option("--set", "sets", multiple=True, metavar="KEY.PATH=VALUE", help="Set any config key (repeatable)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def given(value: Any) -> bool:
    """Whether a click parameter was given (click leaves a missing option None, a missing
    repeatable one an empty tuple)."""
    return value is not None and value != ()


def flag_name(param: str) -> str:
    """``num_processes`` -> ``--num-processes``, as the user typed it."""
    return "--" + param.replace("_", "-")


def merge_parent_params(ctx: click.Context, params: Mapping[str, Any]) -> dict[str, Any]:
    """A subcommand's options, with the job options given before it (``acc-train --strategy
    zero3 plan``) filling in those it was not given."""
    merged = dict(ctx.obj or {})
    merged.update({name: value for name, value in params.items() if given(value) or name not in merged})
    return merged


def resolve_job(params: Mapping[str, Any], extra_flags: Mapping[str, tuple[Any, str]] | None = None) -> ResolvedJob:
    """The job the command line describes, with the launch keys it leaves open taken from the
    cluster (Slurm, torchrun's variables: ``acc_train.launch.cluster``); says on stderr when the default
    config file is read and which launch settings came from the cluster.

    ``params`` are click's (``FLAG_KEYS`` names, ``config_file``, ``sets``); ``extra_flags``
    maps dotted keys to ``(value, flag)`` for a command's own flags (``plan --model``).
    """
    from acc_train.launch.cluster import resolve_on_cluster
    from acc_train.config import load_job

    flags: dict[str, tuple[Any, str]] = {}
    for name, dotted in FLAG_KEYS.items():
        value = params.get(name)
        if given(value):
            flags[dotted] = (list(value) if isinstance(value, tuple) else value, flag_name(name))
    flags.update(extra_flags or {})
    job, found = resolve_on_cluster(
        lambda base: load_job(params.get("config_file"), flags, params.get("sets") or (), base=base, use_default_file=True), os.environ
    )
    if found is not None and found.origins:  # the launch log says where the launch settings came from
        settings = ", ".join(f"{key}={found.values[key]} ({origin})" for key, origin in found.origins.items())
        click.echo(f"launch settings from {found.kind}: {settings}", err=True)
    if job.default_file is not None:
        click.echo(f"using the default config file {job.default_file} (from `acc-train config`; --config FILE reads another)", err=True)
    return job
