"""``acc-train``: the root command, which trains a job, and ``launch``, which runs a user's script;
every other command lives in a module of its own and is registered here.

Only click is imported at module level: ``--help``, ``strategies`` and ``plugins`` never load
torch or accelerate.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from acc_train_cli.checkpoint_cmd import checkpoint
from acc_train_cli.config_cmd import config_group
from acc_train_cli.data_cmd import data_group
from acc_train_cli.errors import report_plugin_failures, user_errors
from acc_train_cli.eval_cmd import eval_command
from acc_train_cli.generate_cmd import generate
from acc_train_cli.info import env, plugins, strategies
from acc_train_cli.job import LOOP_ONLY, flag_name, given, job_options, merge_parent_params, resolve_job
from acc_train_cli.plan import plan
from acc_train_cli.plugin_commands import PluginCommandGroup
from acc_train_cli.report import report

__all__ = ["cli", "main"]


@click.group(cls=PluginCommandGroup, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@job_options
@click.option("--print-config", is_flag=True, help="Print the resolved config as YAML and exit.")
@click.version_option(package_name="acc-train-cli", prog_name="acc-train")
@click.pass_context
def cli(ctx: click.Context, print_config: bool, **params: Any) -> None:
    """Train a job under any installed strategy: DDP, FSDP, DeepSpeed ZeRO or a third-party one.

    With no model or data named, trains the built-in demo job (a small Llama on the Python
    standard library's source, offline). Examples:

    \b
      acc-train --strategy ddp --num-processes 2
      acc-train --config job.yaml --set training.max_steps=50
      acc-train --output-dir runs/demo --resume latest --max-steps 400
      acc-train --strategy ddp --num-processes 2 launch my_script.py --its-args
    """
    ctx.obj = params  # job options given before a subcommand: `launch` and `plan` read them
    if ctx.invoked_subcommand is not None:
        return
    _train(params, print_config)


@user_errors
def _train(params: dict[str, Any], print_config: bool) -> None:
    job = resolve_job(params)
    if print_config:
        click.echo(job.to_yaml(), nl=False)
        return
    report_plugin_failures()
    from acc_train.api import packs_rows
    from acc_train.checkpoint.faults import check_fault_env
    from acc_train.config.optimizer import check_optimizer
    from acc_train.launch.launcher import check_launch_support
    from acc_train.data import check_data_files, data_kind
    from acc_train.evaluation.kinds import job_evaluators
    from acc_train.machine import current_machine
    from acc_train.model.build import check_attn_implementation, check_model_builds, check_model_path
    from acc_train.model.prompt_text import check_prompts
    from acc_train.trainer import check_output_dir

    cfg = job.config
    check_fault_env()
    check_launch_support(cfg.launch)
    check_model_path(cfg.model)
    check_data_files(cfg.data)  # needs no torch: a missing or broken file is refused in a second, before torch loads
    check_attn_implementation(cfg.model, current_machine().device_type)
    _check_strategy_fits(job)
    for evaluator in job_evaluators(cfg):  # (eval.harness_tasks: lm-eval installed, every task known and loadable)
        evaluator.check(cfg)  # exit 2 now, not at the first evaluation
    tokenizer = check_model_builds(cfg, job.strategy, packs=packs_rows(cfg.data))
    data_kind(cfg.data).check_tokenizer(tokenizer, cfg.data)
    check_prompts(cfg.eval.samples, tokenizer)
    check_optimizer(job, job.strategy.machine)
    if cfg.launch.machine_rank == 0:  # the run's files belong to machine 0
        check_output_dir(job)
    if cfg.launch.max_restarts:
        _say_elastic(cfg)
    if cfg.launch.requeue:
        from acc_train.launch.cluster import check_requeue

        warning = check_requeue(cfg.resume, os.environ)
        if warning:
            click.echo(f"warning: {warning}", err=True)
    from acc_train.outputs.run_lock import run_lock

    # one run per output directory, for the run's life (the files belong to machine 0)
    with run_lock(cfg.output_dir) if cfg.launch.machine_rank == 0 else contextlib.nullcontext():
        try:
            _launch_and_report(job)
        finally:
            if cfg.launch.machine_rank == 0:  # every worker here has ended: what a failed save left goes (a full disk's, say)
                from acc_train.files.disk_full import remove_unfinished_writes

                remove_unfinished_writes(cfg.output_dir)


def _launch_and_report(job: Any) -> None:
    from acc_train.launch.scratch import launch_folder
    from acc_train.launch.launcher import worker_command
    from acc_train.launch.stop_signals import read_stop_marker

    cfg = job.config
    started = time.time()
    if cfg.data.train_files and not cfg.data.streaming:
        _prepare_data(cfg)  # once per machine, here, with progress bars: the workers read it from the cache
    # the workers read the resolved config from a file of their own: the output directory is
    # left as it is until every worker's checks have passed (rank 0 then writes config.yaml)
    # (and its markers: claimed, stopped) in this launch's own folder, removed when it ends
    with launch_folder() as folder:
        config_path = str(folder / "config.yaml")
        Path(config_path).write_text(job.to_yaml())
        received = _run_workers(
            cfg.launch,
            worker_command("acc_train.worker", config_path),
            {"ACC_TRAIN_MIXED_PRECISION": cfg.training.mixed_precision, "ACC_TRAIN_LAUNCH_TIME": repr(started), **_peak_env(cfg)},
            output_dir=cfg.output_dir,
        )
        stopped = read_stop_marker(config_path)
    if received is not None or stopped is not None:
        _say_stopped(cfg, received, stopped)
    if cfg.launch.machine_rank == 0:
        summary_path = os.path.join(cfg.output_dir, "run.json")
        if os.path.isfile(summary_path):
            with open(summary_path) as f:
                s = json.load(f)
            loss = s.get("final_loss")
            if s.get("restarts"):
                click.echo(f"elastic: the workers were restarted {s['restarts']} time(s); the last attempt resumed from {s.get('resumed_from') or 'no checkpoint (step 0)'}")
            click.echo(
                f"done: {s['steps']} steps under {s['strategy']} ({s['distributed_type']}, world size {s['world_size']}), "
                f"final loss {'-' if loss is None else f'{loss:.4f}'}, {s['tokens_per_s'] or 0:.0f} tokens/s -> {cfg.output_dir}"
            )
            from acc_train.outputs.report import format_summary, read_run

            click.echo(format_summary(read_run(cfg.output_dir)))


def _peak_env(cfg: Any) -> dict[str, str]:
    """This machine's CPU peak FLOP/s in the run's compute precision, measured here once before
    the workers start (a short probe the first time, then cached) and handed to them, so no rank
    probes the cores the others train on. GPU workers look their own GPU up (the peak table, or
    a probe of that GPU alone): asking CUDA for a name here would hold a CUDA context in this
    process for the whole run."""
    from acc_train.machine import current_machine, resolve_mixed_precision
    from acc_train.outputs.device_peaks import peak_for_workers
    from acc_train.outputs.mfu import compute_precision

    machine = current_machine()
    if machine.device_type != "cpu":
        return {}
    precision = compute_precision(resolve_mixed_precision(cfg.training.mixed_precision, machine), cfg.model.dtype)
    return peak_for_workers(machine.device_type, precision)


def _say_elastic(cfg: Any) -> None:
    """The launch log's line on what a restart will do (``--max-restarts``)."""
    every, launch = cfg.checkpoint.every, cfg.launch
    where = f"{launch.rdzv_backend} rendezvous of {launch.num_machines} machines" if launch.num_machines > 1 else "one machine"
    saves = f"checkpoints every {every} steps" if every else "checkpoint.every is 0: a restart trains from step 0"
    click.echo(
        f"elastic: up to {launch.max_restarts} restart(s) ({where}); "
        f"restarted workers resume from the latest checkpoint in {cfg.output_dir} ({saves})",
        err=True,
    )


def _check_strategy_fits(job: Any) -> None:
    """The strategy's own checks against the machines the launch section describes (mesh sizes
    against the world size, options that need an accelerator), before any worker starts: each
    worker makes them again."""
    from acc_train.launch.launcher import launch_machine

    job.strategy = job.strategy.bind(launch_machine(job.config.launch))
    job.strategy.check_environment()
    job.strategy.check_job(job.config)


def _prepare_data(cfg: Any) -> Any:
    """Tokenize the job's data files into the cache, unless they are there already."""
    from acc_train.data import prepare_data
    from acc_train.model.build import load_tokenizer

    return prepare_data(cfg.data, load_tokenizer(cfg.model))


def _run_workers(section: Any, args: list[str], env: dict[str, str], output_dir: str | None = None) -> int | None:
    """Start the workers; a failed run exits with the workers' code (a user error's included).
    Returns the signal the launcher got and passed on to the workers, if one stopped it.
    ``output_dir``: a training run's, for what a lost peer leaves (:func:`_lost_peer_advice`)."""
    from acc_train.errors import EXIT_USER_ERROR
    from acc_train.launch.launcher import LaunchFailed, LaunchStopped, launch

    try:
        launch(section, args, env)
    except LaunchFailed as exc:
        if exc.lost_peer:
            click.echo(f"error: {exc.report}\n{_lost_peer_advice(section, output_dir)}", err=True)
            sys.exit(exc.exit_code)
        prefix = "error: " if exc.exit_code == EXIT_USER_ERROR else "error: training failed\n"
        click.echo(prefix + exc.report, err=True)
        sys.exit(exc.exit_code)
    except LaunchStopped as exc:
        return exc.signum
    return None


def _again_with_resume_auto(argv: list[str]) -> str:
    """This command as it was typed, with ``--resume auto`` in place of any ``--resume``."""
    import shlex

    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return shlex.join(["acc-train", *kept, "--resume", "auto"])


def _lost_peer_advice(section: Any, output_dir: str | None) -> str:
    """What a run that lost a peer leaves, and how to go on: the last complete checkpoint (a
    training run's) and the command to start again on every machine."""
    machines = f"on each of the {section.num_machines} machines (each with its own --machine-rank)" if section.num_machines > 1 else "again"
    if output_dir is None:  # a program launched unchanged: its own checkpoints are its business
        return f"  restart: the same acc-train launch command {machines}"
    from acc_train.checkpoint import find_checkpoint

    latest = find_checkpoint(Path(output_dir), "auto") if os.path.isdir(output_dir) else None
    if latest:
        since = f"last complete checkpoint: {latest}"
    elif section.machine_rank != 0:  # machine 0 writes the checkpoints; this one may not see them
        since = f"the checkpoints are machine 0's, in its {output_dir}"
    else:
        since = "no checkpoint was complete yet: the restart trains from step 0"
    return f"  {since}\n  restart {machines}: {_again_with_resume_auto(sys.argv[1:])}"


def _say_stopped(cfg: Any, received: int | None, stopped: dict | None) -> None:
    """One line for a run stopped by a signal, and exit 128 + its number."""
    import signal

    signum = stopped["signum"] if stopped else received
    name = signal.Signals(signum).name if signum else "a signal"
    again = f"acc-train ... --output-dir {cfg.output_dir} --resume auto"
    if stopped and stopped.get("checkpoint"):
        click.echo(f"stopped by {name} at step {stopped['step']}: checkpoint {stopped['checkpoint']} saved; continue with `{again}`", err=True)
    else:
        from acc_train.checkpoint import find_checkpoint

        latest = find_checkpoint(Path(cfg.output_dir), "auto") if os.path.isdir(cfg.output_dir) else None
        since = f"the latest checkpoint is {latest}" if latest else "no checkpoint was written yet"
        click.echo(f"stopped by {name} before a checkpoint of the last step was saved: {since}; continue with `{again}`", err=True)
    if cfg.launch.requeue and cfg.launch.machine_rank == 0:  # one requeue per job: machine 0's command asks
        from acc_train.launch.cluster import requeue_job

        click.echo(requeue_job(os.environ), err=True)
    sys.exit(128 + (signum or 15))


#: ``accelerate launch`` flags, and what says the same to ``acc-train`` (a flag placed where
#: PROGRAM goes is one of these, or a mistake)
ACCELERATE_LAUNCH_FLAGS = {
    "--use_fsdp": "--strategy fsdp (presets: fsdp1, fsdp2, fsdp-offload)",
    "--use_deepspeed": "--strategy deepspeed, or a preset: zero1, zero2, zero3, zero2-offload, zero3-offload",
    "--zero_stage": "--strategy zero1 / zero2 / zero3 (or --set strategy.stage=N)",
    "--deepspeed_config_file": "--set strategy.config_file=FILE (with --strategy deepspeed)",
    "--offload_optimizer_device": "--set strategy.offload_optimizer=cpu (with --strategy deepspeed)",
    "--offload_param_device": "--set strategy.offload_param=cpu (with --strategy deepspeed)",
    "--zero3_init_flag": "--set strategy.zero3_init_flag=true",
    "--zero3_save_16bit_model": "--set strategy.zero3_save_16bit_model=true",
    "--mixed_precision": "--mixed-precision",
    "--num_processes": "--num-processes",
    "--num_machines": "--num-machines",
    "--machine_rank": "--machine-rank",
    "--main_process_ip": "--main-process-ip",
    "--main_process_port": "--main-process-port",
    "--rdzv_backend": "--rdzv-backend",
    "--max_restarts": "--max-restarts",
    "--config_file": "--config FILE (acc-train reads accelerate config files too)",
    "--multi_gpu": "nothing: acc-train starts one process per GPU by default (--num-processes N)",
    "--cpu": "nothing: a machine without a GPU runs on its CPU (ACCELERATE_USE_CPU=1 forces it)",
    "--dynamo_backend": "--set training.compile.backend=NAME",
    "--gpu_ids": "CUDA_VISIBLE_DEVICES=...",
    "--num_cpu_threads_per_process": "OMP_NUM_THREADS=N",
    "--gradient_accumulation_steps": "your program's own setting (Accelerator(gradient_accumulation_steps=...) or TrainingArguments)",
    "--gradient_clipping": "your program's own setting (TrainingArguments.max_grad_norm, or a DeepSpeed JSON: --set strategy.config_file=FILE)",
}
#: prefixes of ``accelerate launch`` flag families
ACCELERATE_FLAG_FAMILIES = {
    "--fsdp_": "--strategy fsdp with --set strategy.OPTION=VALUE (acc-train strategies lists the options)",
    "--parallelism_config_": "--strategy fsdp with --set strategy.dp_replicate / dp_shard (in a job config)",
    "--dynamo_": "--set training.compile.OPTION=VALUE",
    "--deepspeed_": "--strategy deepspeed with --set strategy.OPTION=VALUE",
}


def _refuse_flag_as_program(program: str) -> None:
    from acc_train.errors import UserError

    flag = program.split("=", 1)[0]
    dashed = flag.replace("-", "_").replace("__", "--", 1) if flag.startswith("--") else flag
    equivalent = ACCELERATE_LAUNCH_FLAGS.get(dashed) or next((v for p, v in ACCELERATE_FLAG_FAMILIES.items() if dashed.startswith(p)), None)
    if equivalent is not None:
        raise UserError(
            f"{flag} is an `accelerate launch` flag, which acc-train does not take",
            where="acc-train launch",
            hint=f"use {equivalent}, before PROGRAM; arguments after PROGRAM go to your program",
        )
    raise UserError(
        f"no such option: {flag}",
        where="acc-train launch",
        hint="job options (acc-train launch --help) go before PROGRAM, your program's own arguments after it",
    )


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@job_options
@click.option("-m", "--module", "as_module", is_flag=True, help="Run PROGRAM as a module, as `python -m` does.")
@click.argument("program", metavar="PROGRAM")
@click.argument("program_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
@user_errors
def launch(ctx: click.Context, program: str, program_args: tuple[str, ...], as_module: bool, **params: Any) -> None:
    """Run your own program, unchanged, under the chosen strategy.

    PROGRAM is a script, or a module with -m: an Accelerate script (`from accelerate import
    Accelerator`), an HF Trainer or TRL script. Every worker gets the variables `accelerate
    launch` would give it for the strategy, so its Accelerator runs FSDP or DeepSpeed as on GPUs
    (on CPU too, where Accelerate alone would fall back to DDP). Job options may stand before
    or after `launch`; your program's own arguments follow PROGRAM.
    """
    from acc_train.errors import UserError

    merged = merge_parent_params(ctx, params)
    for name in LOOP_ONLY:
        if given(merged.get(name)):
            raise UserError(
                f"{flag_name(name)} applies to acc-train's own training loop; `launch` runs your program, which sets it itself",
                where=flag_name(name),
                hint="pass it to your program after PROGRAM instead",
            )
    if program.startswith("-"):
        _refuse_flag_as_program(program)
    _check_program_exists(program, as_module)
    job = resolve_job(merged)
    report_plugin_failures()
    from acc_train.launch.protocol import leftovers_warning, protocol_env, protocol_variables, shell_leftovers
    from acc_train.launch.launcher import check_launch_support, launch_machine, worker_command
    from acc_train.machine import resolve_mixed_precision

    cfg = job.config
    check_launch_support(cfg.launch)
    job.strategy = job.strategy.bind(launch_machine(cfg.launch))
    job.strategy.check_environment()
    mixed_precision = resolve_mixed_precision(cfg.training.mixed_precision, job.strategy.machine)
    strategy = {"name": cfg.strategy["name"], **job.strategy.options.model_dump(mode="json")}
    env = {
        "ACC_TRAIN_STRATEGY": json.dumps(strategy),
        "ACC_TRAIN_MIXED_PRECISION": cfg.training.mixed_precision,
        "ACC_TRAIN_TIMEOUT": str(cfg.launch.timeout),
    }
    from acc_train.launch.scratch import launch_folder

    with launch_folder() as scratch:  # a strategy's files for the launch (a DeepSpeed JSON), removed when it ends
        env.update(protocol_env(job.strategy, mixed_precision, scratch))
        leftovers = shell_leftovers(env, os.environ, protocol_variables())
        if leftovers:
            click.echo(f"warning: {leftovers_warning(leftovers)}", err=True)
            for name in leftovers:
                os.environ.pop(name)
        _compile_env(cfg.training.compile, env)
        worker = worker_command("acc_train.script_worker", *(["-m"] if as_module else []), program, *program_args)
        received = _run_workers(cfg.launch, worker, env)
    if received is not None:  # passed on to the program: saving on it is the program's business (Trainer's)
        import signal

        click.echo(f"stopped by {signal.Signals(received).name}: passed on to the program, which had {cfg.launch.shutdown_timeout} s to stop", err=True)
        sys.exit(128 + received)


def _check_program_exists(program: str, as_module: bool) -> None:
    """A script that is not a file, or a module that cannot be found (from the working
    directory, as ``python -m`` looks), is refused before any worker starts."""
    from acc_train.errors import UserError

    if not as_module:
        if not os.path.isfile(program):
            hint = "to run a module, use acc-train launch -m MODULE" if "/" not in program and not program.endswith(".py") else None
            raise UserError(f"script {program!r} does not exist", where="launch PROGRAM", hint=hint)
        return
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(program) is not None
    except (ImportError, ValueError):  # a parent package that does not exist, or an empty name
        found = False
    finally:
        sys.path.pop(0)
    if not found:
        raise UserError(f"no module named {program!r} (looked from {os.getcwd()} and the installed packages)", where="launch -m MODULE")


def _compile_env(compile_cfg: Any, env: dict[str, str]) -> None:
    """``training.compile`` for a script's ``Accelerator``, as ``accelerate launch`` passes a
    ``dynamo_config``: the shell's ``ACCELERATE_DYNAMO_*`` give way to it, with a warning."""
    from acc_train.config.compile import DYNAMO_ENV_VARS, dynamo_env, ignored_env_warning

    warning = ignored_env_warning(compile_cfg)
    if warning:
        click.echo(f"warning: {warning}", err=True)
    for name in DYNAMO_ENV_VARS:  # one the config leaves unset (USE_DYNAMIC) must not come from the shell
        os.environ.pop(name, None)
    env.update(dynamo_env(compile_cfg))


cli.add_command(strategies)
cli.add_command(plugins)
cli.add_command(env)
cli.add_command(checkpoint)
cli.add_command(config_group)
cli.add_command(plan)
cli.add_command(data_group)
cli.add_command(report)
cli.add_command(generate)
cli.add_command(eval_command)


def main() -> None:
    cli(prog_name="acc-train")


if __name__ == "__main__":
    main()
