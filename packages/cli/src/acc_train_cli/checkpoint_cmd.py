"""``acc-train checkpoint inspect|convert|export``: read a checkpoint's manifest, rewrite its
state in another format, export its model for transformers.

The work is core's; this module only words the results. Only click is imported at module
level: core's checkpoint tools load torch, so they are imported when a command runs.
"""

from __future__ import annotations

import json
from types import ModuleType

import click

from acc_train_cli.errors import user_errors

__all__ = ["checkpoint"]


def _warn(message: str) -> None:
    """A run's ``latest`` pointer that was not followed: which checkpoint was used instead, and why."""
    click.echo(f"warning: {message}", err=True)


def _tools() -> ModuleType:
    """Core's checkpoint tools (``inspect_checkpoint``, ``convert_checkpoint``)."""
    import acc_train.checkpoint_tools as tools  # the CLI's one import of them

    return tools


@click.group()
def checkpoint() -> None:
    """Inspect, convert and export checkpoints (PATH: a checkpoint or a run's output directory)."""


@checkpoint.command("inspect")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@user_errors
def checkpoint_inspect(path: str, as_json: bool) -> None:
    """What a checkpoint's manifest says, and whether its files match it (exit 2 if not)."""
    info = _tools().inspect_checkpoint(path, warn=_warn)
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
@click.option("--to", "to", required=True, metavar="FORMAT", help="Target format: a registered format that can be written from the portable state (see `acc-train plugins`).")
@click.option("--world-size", type=int, metavar="N", help="World size the converted checkpoint is for (default: the writer's).")
@click.argument("out")
@user_errors
def checkpoint_convert(path: str, to: str, world_size: int | None, out: str) -> None:
    """Write PATH's state as a checkpoint in another format, at OUT (a new directory)."""
    target = _tools().convert_checkpoint(path, to, out, world_size, warn=_warn)
    click.echo(f"converted -> {target} (format {to}; resume it with --resume {target})")


@checkpoint.command("export")
@click.argument("path")
@click.option("--to", "to", required=True, metavar="FORMAT", help="Export format: hf (a save_pretrained directory).")
@click.option("--merge", is_flag=True, help="LoRA checkpoints: merge the adapters into the base model (a full model) instead of writing an adapter directory.")
@click.argument("out")
@user_errors
def checkpoint_export(path: str, to: str, merge: bool, out: str) -> None:
    """Write PATH's model as a transformers save_pretrained directory (safetensors) at OUT.

    A LoRA checkpoint (model.lora) is written as the adapter directory PEFT loads onto its base
    model (PeftModel.from_pretrained), or with --merge as the base model with the adapters
    merged into its weights, which transformers loads alone."""
    from acc_train.evaluation.export import export_checkpoint

    target, adapter = export_checkpoint(path, to, out, warn=_warn, merge=merge)
    if adapter:
        click.echo(f"exported -> {target} (LoRA adapters: PeftModel.from_pretrained(base_model, {str(target)!r}) loads them)")
    else:
        click.echo(f"exported -> {target} (AutoModelForCausalLM.from_pretrained loads it)")
