"""``acc-train env``, ``strategies`` and ``plugins``: what is installed here, for users and bug reports.

Only click is imported at module level; ``strategies`` and ``plugins`` load the plugins but never
torch or accelerate. ``env`` asks torch about the devices, so it imports it.
"""

from __future__ import annotations

import json
import os
import sys

import click

from acc_train_cli.errors import report_plugin_failures, user_errors

__all__ = ["env", "plugins", "strategies"]


@click.command()
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
    report_plugin_failures()


@click.command()
@user_errors
def plugins() -> None:
    """Print loaded plugins, their hooks and what they registered, as JSON."""
    from acc_train.plugins import checkpoint_formats, commands, data_kinds, evaluators, optimizers, plugin_failures, plugin_infos, strategies as s_reg, trackers, wrap_policies

    registered: dict[str, dict[str, list[str]]] = {}
    registries = (
        ("strategies", s_reg()), ("wrap_policies", wrap_policies()), ("checkpoint_formats", checkpoint_formats()),
        ("data_kinds", data_kinds()), ("optimizers", optimizers()), ("trackers", trackers()), ("evaluators", evaluators()),
        ("commands", commands()),  # a plugin's acc-train subcommands (acc-train --help lists the built-in ones)
    )  # fmt: skip
    for kind, reg in registries:
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


@click.command()
def env() -> None:
    """Print versions, devices and the cluster detected (Slurm, torchrun's variables), for bug reports."""
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
    from acc_train.plugins import library_versions

    for dist, reported in library_versions().items():  # what each installed plugin depends on
        lines.setdefault(dist, reported)
    for dist in ("datasets", "pluggy"):
        lines.setdefault(dist, version(dist))
    import torch

    lines["cuda available"] = str(torch.cuda.is_available())
    if torch.cuda.is_available():
        lines["cuda devices"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines["cuda version"] = str(torch.version.cuda)
        lines["bf16 supported"] = str(torch.cuda.is_bf16_supported())
    else:
        from acc_train.machine import cpu_has_native_bf16

        lines["cpu native bf16"] = str(cpu_has_native_bf16())
    lines["distributed backends"] = ", ".join(
        b for b, ok in (("gloo", torch.distributed.is_gloo_available()), ("nccl", torch.distributed.is_nccl_available()), ("mpi", torch.distributed.is_mpi_available())) if ok
    )
    lines.update(_cluster_lines())
    width = max(len(k) for k in lines)
    for k, v in lines.items():
        click.echo(f"{k.ljust(width)}  {v}")


def _cluster_lines() -> dict[str, str]:
    """What ``acc_train.launch.cluster`` detects here: the launch keys the environment would fill
    (a job's config and flags still win over it)."""
    from acc_train.launch.cluster import detect_cluster
    from acc_train.errors import UserError

    try:
        found = detect_cluster(os.environ)
    except UserError as exc:
        return {"cluster": "error: " + str(exc).replace("\n", " ")}
    if found is None:
        return {"cluster": "none (no Slurm job, no torchrun variables)"}
    lines = {"cluster": found.kind}
    for key, value in found.values.items():
        lines[f"launch.{key}"] = f"{value}  ({found.origins[key]})"
    return lines
