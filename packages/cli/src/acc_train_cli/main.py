"""``acc-train``: train a job under any installed strategy.

Only click is imported at module level: ``--help``, ``strategies`` and ``plugins`` never load
torch or accelerate.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import click

from acc_train_cli.errors import EXIT_USER_ERROR, user_errors

from acc_train_cli.config_cmd import config_group

__all__ = ["cli", "main"]


#: flag -> (click param name, dotted config key)
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


def _options(f: Callable[..., Any]) -> Callable[..., Any]:
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




def _resolve(params: dict[str, Any]) -> Any:
    from acc_train.config import load_job

    flags = {}
    for name, dotted in FLAG_KEYS.items():
        value = params.get(name)
        if value is None or value == ():
            continue
        flag = "--" + name.replace("_", "-")
        flags[dotted] = (list(value) if isinstance(value, tuple) else value, flag)
    job = load_job(params.get("config_file"), flags, params.get("sets") or (), use_default_file=True)
    if job.default_file is not None:
        click.echo(f"using the default config file {job.default_file} (from `acc-train config`; --config FILE reads another)", err=True)
    return job


def _report_plugin_failures() -> None:
    from acc_train.plugins import plugin_failures

    for failure in plugin_failures():
        click.echo(f"warning: {failure}", err=True)


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@_options
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
    ctx.obj = params
    if ctx.invoked_subcommand is not None:
        return
    _train(params, print_config)


@user_errors
def _train(params: dict[str, Any], print_config: bool) -> None:
    job = _resolve(params)
    if print_config:
        click.echo(job.to_yaml(), nl=False)
        return
    _report_plugin_failures()
    from acc_train.data import check_data_files
    from acc_train.model import check_model_path
    from acc_train.trainer import prepare_output_dir

    cfg = job.config
    check_model_path(cfg.model)
    check_data_files(cfg.data)
    if cfg.launch.machine_rank == 0:
        out = prepare_output_dir(job)
        config_path = str(out / "config.yaml")
    else:  # other machines: the run's files belong to machine 0
        fd, config_path = tempfile.mkstemp(prefix="acc-train-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(job.to_yaml())
    _run_workers(cfg.launch, ["-m", "acc_train.worker", config_path], {"ACC_TRAIN_MIXED_PRECISION": cfg.training.mixed_precision})
    if cfg.launch.machine_rank == 0:
        summary_path = os.path.join(cfg.output_dir, "run.json")
        if os.path.isfile(summary_path):
            with open(summary_path) as f:
                s = json.load(f)
            loss = s.get("final_loss")
            click.echo(
                f"done: {s['steps']} steps under {s['strategy']} ({s['distributed_type']}, world size {s['world_size']}), "
                f"final loss {loss:.4f}, {s['tokens_per_s'] or 0:.0f} tokens/s -> {cfg.output_dir}"
            )
            from acc_train.report import format_summary, read_run

            click.echo(format_summary(read_run(cfg.output_dir)))


def _run_workers(section: Any, args: list[str], env: dict[str, str]) -> None:
    from acc_train.launcher import LaunchFailed, launch

    try:
        launch(section, args, env)
    except LaunchFailed as exc:
        prefix = "error: " if exc.exit_code == EXIT_USER_ERROR else "error: training failed\n"
        click.echo(prefix + exc.report, err=True)
        sys.exit(exc.exit_code)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_options
@click.argument("script", type=click.Path(dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
@user_errors
def launch(ctx: click.Context, script: str, script_args: tuple[str, ...], **params: Any) -> None:
    """Run your own Accelerate script under the chosen strategy.

    In the script, `from acc_train import Accelerator` (a drop-in for `accelerate.Accelerator`)
    applies the strategy. Job options may stand before or after `launch`.
    """
    from acc_train.errors import UserError

    merged = {k: (v if v not in (None, ()) else (ctx.obj or {}).get(k)) for k, v in params.items()}
    for name in LOOP_ONLY:
        if merged.get(name) not in (None, ()):
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{flag} applies to acc-train's own training loop; `launch` runs your script, which sets it itself",
                where=flag,
                hint="pass it to your script after SCRIPT instead",
            )
    if not os.path.isfile(script):
        raise UserError(f"script {script!r} does not exist", where="launch SCRIPT")
    job = _resolve(merged)
    _report_plugin_failures()
    strategy = {"name": job.config.strategy["name"], **job.options.model_dump(mode="json")}
    env = {
        "ACC_TRAIN_STRATEGY": json.dumps(strategy),
        "ACC_TRAIN_MIXED_PRECISION": job.config.training.mixed_precision,
    }
    _run_workers(job.config.launch, ["-m", "acc_train.script_worker", script, *script_args], env)


@cli.command()
@user_errors
def strategies() -> None:
    """List installed strategies with their presets and packages."""
    from acc_train.plugins import plugin_infos, strategies as registry

    infos = {i.name: i for i in plugin_infos()}
    rows = [("NAME", "ALIASES / PRESETS", "PACKAGE", "VERSION", "DESCRIPTION")]
    for strategy, owner in registry().primary():
        info = infos.get(owner)
        extra = ", ".join([*strategy.aliases, *strategy.presets]) or "-"
        rows.append((strategy.name, extra, (info.distribution if info else None) or owner, (info.version if info else None) or "-", strategy.description))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
    if len(rows) == 1:
        click.echo("(no strategies installed: pip install acc-train-strategy-ddp)")
    _report_plugin_failures()


@cli.command()
@user_errors
def plugins() -> None:
    """Print loaded plugins, their hooks and what they registered, as JSON."""
    from acc_train.plugins import checkpoint_formats, plugin_failures, plugin_infos, strategies as s_reg, wrap_policies

    registered: dict[str, dict[str, list[str]]] = {}
    for kind, reg in (("strategies", s_reg()), ("wrap_policies", wrap_policies()), ("checkpoint_formats", checkpoint_formats())):
        for obj, owner in reg.primary():
            registered.setdefault(owner, {}).setdefault(kind, []).append(obj.name)
    out = {
        "plugins": [
            {
                "name": i.name,
                "distribution": i.distribution,
                "version": i.version,
                "module": i.module,
                "hooks": i.hooks,
                "registered": registered.get(i.name, {}),
            }
            for i in plugin_infos()
        ],
        "failures": [{"name": f.name, "distribution": f.distribution, "reason": f.reason} for f in plugin_failures()],
    }
    click.echo(json.dumps(out, indent=2))


@cli.group()
def checkpoint() -> None:
    """Inspect, convert and export checkpoints (PATH: a checkpoint or a run's output directory)."""


@checkpoint.command("inspect")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@user_errors
def checkpoint_inspect(path: str, as_json: bool) -> None:
    """What a checkpoint's manifest says, and whether its files match it (exit 2 if not)."""
    from acc_train.checkpoint.tools import inspect_checkpoint

    info = inspect_checkpoint(path)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    model = info.get("model") or {}
    options = ", ".join(f"{k}={v}" for k, v in (info.get("strategy_options") or {}).items() if v is not None)
    rows = [
        ("checkpoint", info["path"]),
        ("format", f"{info['format']}" + (" (portable state: resumes under any strategy and world size)" if info["portable"] else "")),
        ("strategy", f"{info['strategy']}" + (f" ({options})" if options else "")),
        ("world size", str(info["world_size"])),
        ("step", f"{info['step']} (epoch {info['epoch']}, {info['samples_in_epoch']} samples into it)"),
        ("model", f"{info.get('model_class') or model.get('model_type')} (config sha256 {str(model.get('config_sha256'))[:16]})"),
        ("data", ", ".join(f"{k}={v}" for k, v in (info.get("data") or {}).items())),
        ("versions", ", ".join(f"{k} {v}" for k, v in (info.get("versions") or {}).items())),
        ("files", f"{info['files']} files, {info['bytes'] / 2**20:.2f} MiB, all match the manifest (size and sha256)"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key.ljust(width)}  {value}")


@checkpoint.command("convert")
@click.argument("path")
@click.option("--to", "to", required=True, metavar="FORMAT", help="Target format: dcp or deepspeed.")
@click.option("--world-size", type=int, metavar="N", help="World size the converted checkpoint is for (default: the writer's).")
@click.argument("out")
@user_errors
def checkpoint_convert(path: str, to: str, world_size: int | None, out: str) -> None:
    """Write PATH's state as a checkpoint in another format, at OUT (a new directory)."""
    from acc_train.checkpoint.tools import convert_checkpoint

    target = convert_checkpoint(path, to, out, world_size)
    click.echo(f"converted -> {target} (format {to}; resume it with --resume {target})")


@checkpoint.command("export")
@click.argument("path")
@click.option("--to", "to", required=True, metavar="FORMAT", help="Export format: hf (a save_pretrained directory).")
@click.argument("out")
@user_errors
def checkpoint_export(path: str, to: str, out: str) -> None:
    """Write PATH's model as a transformers save_pretrained directory (safetensors) at OUT."""
    from acc_train.checkpoint.tools import export_checkpoint

    target = export_checkpoint(path, to, out)
    click.echo(f"exported -> {target} (AutoModelForCausalLM.from_pretrained loads it)")


@cli.command()
def env() -> None:
    """Print versions and devices, for bug reports."""
    import platform
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    lines = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu count": str(os.cpu_count()),
    }
    acc_dists = sorted({d.metadata["Name"] for d in metadata.distributions() if (d.metadata["Name"] or "").startswith("acc-train")})
    for dist in acc_dists:
        lines[dist] = version(dist)
    for dist in ("torch", "accelerate", "transformers", "datasets", "safetensors", "deepspeed", "pluggy"):
        lines[dist] = version(dist)
    import torch

    lines["cuda available"] = str(torch.cuda.is_available())
    if torch.cuda.is_available():
        lines["cuda devices"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines["cuda version"] = str(torch.version.cuda)
        lines["bf16 supported"] = str(torch.cuda.is_bf16_supported())
    else:
        from acc_train.accelerator import cpu_has_native_bf16

        lines["cpu native bf16"] = str(cpu_has_native_bf16())
    lines["distributed backends"] = ", ".join(
        b for b, ok in (("gloo", torch.distributed.is_gloo_available()), ("nccl", torch.distributed.is_nccl_available()), ("mpi", torch.distributed.is_mpi_available())) if ok
    )
    width = max(len(k) for k in lines)
    for k, v in lines.items():
        click.echo(f"{k.ljust(width)}  {v}")


cli.add_command(config_group)
from acc_train_cli.plan import plan  # noqa: E402 - commands in their own modules, registered here
from acc_train_cli.report import report  # noqa: E402

cli.add_command(plan)
cli.add_command(report)


def main() -> None:
    cli(prog_name="acc-train")


if __name__ == "__main__":
    main()
