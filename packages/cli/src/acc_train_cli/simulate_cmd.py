"""``acc-train plan --simulate``: the plan's strategies rehearsed at the target world size on
this CPU (:mod:`acc_train.simulate`), set beside the plan's own figures.

What would fail on the cluster is refused here first (exit 2): each strategy's own checks of
the target machine (GPUs, the world size, the number of machines), of the job and of the model
(built on the meta device), then the simulated peak against ``--device-memory``.
"""

from __future__ import annotations

import re
from typing import Any

import click

__all__ = ["simulate_plan", "print_simulation", "device_memory_bytes", "DEVICE_MEMORY_GIB"]

#: nominal memory of the cards ``--device-memory`` knows by name (datasheets), GiB; CUDA
#: reports a little less (an H100 80GB: about 79.2 GiB): give a size for an exact figure
DEVICE_MEMORY_GIB: list[tuple[tuple[str, ...], float]] = [
    (("h200", "nvl"), 141), (("h200",), 141), (("h100", "nvl"), 94), (("h100",), 80), (("b200",), 180),
    (("a100", "40"), 40), (("a100",), 80), (("l40s",), 48), (("a10g",), 24), (("mi300x",), 192),
]  # fmt: skip

_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3, "t": 1024**4, "tib": 1024**4,
          "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4}  # fmt: skip


def device_memory_bytes(text: str) -> tuple[int, str]:
    """``80GiB``, ``80GB``, ``85e9`` or a card's name (``H100``) -> (bytes, what it is)."""
    from acc_train.errors import UserError

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if match and match.group(2).lower() in _UNITS:
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()]), text.strip()
    words = text.lower().replace("-", " ").split()
    for keys, gib in DEVICE_MEMORY_GIB:
        if all(any(k in w for w in words) for k in keys):
            return int(gib * 1024**3), f"{text.strip()} ({gib:g} GiB, nominal)"
    names = ", ".join(sorted({k[0].upper() for k, _ in DEVICE_MEMORY_GIB}))
    raise UserError(f"cannot read device memory {text!r}", where="--device-memory", hint=f"give a size (80GiB, 141GB) or a card: {names}")


def _strategy_list(job: Any, names: str | None, mesh: dict[str, int] | None) -> list[tuple[str, Any]]:
    """(label, configured strategy) to simulate: ``--strategies``' names and presets (the job's
    own options where a name is the job's), or the job's own strategy; plus the ``--mesh``."""
    from acc_train.config import resolve_strategy

    out: list[tuple[str, Any]] = []
    if names is None:
        out.append((str(job.config.strategy["name"]), job.strategy))
    else:
        for name in filter(None, (n.strip() for n in names.split(","))):
            if name == job.config.strategy["name"]:
                out.append((name, job.strategy))
            else:
                out.append((name, resolve_strategy(name, {})))
    if mesh is not None:  # labelled as the plan's row for it (build_plan)
        variant = resolve_strategy("fsdp", {"version": 2, **mesh})
        sizes = variant.mesh_sizes((job.config.launch.num_processes or 1) * job.config.launch.num_machines)
        inner = "".join(f",{n}={sizes[n]}" for n in ("cp", "tp") if n in sizes)
        out.append((f"fsdp2 mesh replicate={sizes['dp_replicate']},shard={sizes['dp_shard']}{inner}", variant))
    return out


def _check_for_the_cluster(job: Any, strategy: Any, model: Any) -> None:
    """What a run's own checks refuse on the cluster (GPUs: the device the job is planned for)."""
    from acc_train.strategy import Machine

    cfg = job.config
    world = (cfg.launch.num_processes or 1) * cfg.launch.num_machines
    strategy.bind(Machine("cuda", world, cfg.launch.num_machines)).check_environment()
    strategy.check_job(cfg)
    strategy.check_model(model)


def _how(result: dict[str, Any], world: int) -> str:
    ranks = result["ranks"]
    kinds = "; ".join(f"rank{'s' if len(r['ranks']) > 1 else ''} {' and '.join(map(str, r['ranks']))}" for r in ranks)
    return (
        f"simulated: one step of the job's shape at world size {world} on torch's fake process group with fake tensors, "
        f"the strategy applied by the Accelerator a run builds, measured by {ranks[0]['tracker']} ({kinds})"
    )


def simulate_plan(job: Any, data: dict[str, Any], names: str | None, mesh: dict[str, int] | None) -> list[dict[str, Any]]:
    """Simulate each strategy and set it beside its row of the plan (``data``: build_plan's)."""
    from acc_train.memory.plan import model_shape
    from acc_train.simulate import SimulationFailed, job_under, simulate_strategy

    cfg = job.config
    world, local = data["world_size"], data["num_processes"]
    model = model_shape(cfg).model
    chosen = _strategy_list(job, names, mesh)
    for label, strategy in chosen:  # every refusal before the first simulation
        _check_for_the_cluster(job_under(job, strategy), strategy, model)
    out: list[dict[str, Any]] = []
    for label, strategy in chosen:
        row = next((r for r in data["rows"] if r["label"] == label), None) or next((r for r in data["rows"] if r["job"] and label == cfg.strategy["name"]), None)
        entry: dict[str, Any] = {"name": label, "plan": {"device_total_bytes": row["device_total"] if row else None, "row": row}}
        click.echo(f"simulating {label} at world size {world}...", err=True)
        try:
            result = simulate_strategy(job_under(job, strategy), world, local)
        except SimulationFailed as exc:
            entry.update(simulated=None, collectives=None, how=f"not simulated: {exc}; the plan's formula stands for it")
            out.append(entry)
            continue
        if "user_error" in result:  # the cluster's checks passed above: this CPU is what the strategy refuses (offload)
            err = result["user_error"]
            entry.update(simulated=None, collectives=None, how=f"not simulated: on this CPU the strategy refuses it ({err['where']}: {err['message']}); the plan's formula stands for it")
            out.append(entry)
            continue
        largest = max(result["ranks"], key=lambda r: r["peak_bytes"])
        parts = ("peak", "parameters", "gradients", "optimizer", "activations", "other")
        how = _how(result, world)
        entry["simulated"] = {**{f"{p}_bytes": largest[f"{p}_bytes"] for p in parts}, "how": how, "at": largest["at"], "tracked": largest["tracked"]}
        entry["collectives"] = largest["collectives"]
        entry["ranks"] = result["ranks"]
        out.append(entry)
    return out


def _pct(simulated: float, planned: float | None) -> str:
    if not planned:
        return "n/a"
    return f"{(simulated - planned) / planned * 100:+.0f}%"


def print_simulation(entries: list[dict[str, Any]], device: tuple[int, str] | None) -> None:
    from acc_train_cli.units import human_bytes

    click.echo("\nsimulated (per rank, the largest rank kind) beside the plan; diff = (simulated - plan) / plan")
    head = ("strategy", "part", "simulated", "plan", "diff")
    lines = [head]
    for e in entries:
        sim, row = e["simulated"], e["plan"]["row"] or {}
        if sim is None:
            lines.append((e["name"], "-", "not simulated", human_bytes(e["plan"]["device_total_bytes"] or 0), ""))
            continue
        planned = {
            "parameters": row.get("params", 0) + row.get("frozen", 0),
            "gradients": row.get("grads"),
            "optimizer": row.get("optimizer"),
            "activations": row.get("activations"),
            "other": row.get("buffers"),
            "peak": row.get("device_total"),
        }
        for i, part in enumerate(("parameters", "gradients", "optimizer", "activations", "other", "peak")):
            p = planned[part]
            lines.append((e["name"] if i == 0 else "", part, human_bytes(sim[f"{part}_bytes"]), human_bytes(p) if p is not None else "-", _pct(sim[f"{part}_bytes"], p)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for i, line in enumerate(lines):
        click.echo("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths))).rstrip())
        if i == 0:
            click.echo("  ".join("-" * w for w in widths))
    click.echo("  other: all-gathered parameters and their buffers, reduce-scatter buffers, temporaries (the plan counts")
    click.echo("  them in no column); plan's device total = its model state on the device + its activation estimate.")
    for e in entries:
        click.echo(f"\n{e['name']}: {e['how'] if e['simulated'] is None else e['simulated']['how']}")
        if e["simulated"] is None:
            continue
        at = e["simulated"]["at"]
        click.echo(f"  peak {human_bytes(e['simulated']['peak_bytes'])} in {at['phase']}" + (f", inside {at['module']}" if at["module"] else ""))
        coll = ", ".join(f"{k} x{v['count']} ({human_bytes(v['bytes'])})" for k, v in (e["collectives"] or {}).items()) or "none"
        click.echo(f"  collectives of one step: {coll}")
        for r in e["ranks"]:
            click.echo(f"  rank{'s' if len(r['ranks']) > 1 else ''} {', '.join(map(str, r['ranks']))}: peak {human_bytes(r['peak_bytes'])}; simulated in {r['seconds']:.0f} s, {human_bytes(r['rss_bytes'])} RSS")
    if device is not None:
        click.echo(f"\ndevice memory: {device[1]} = {human_bytes(device[0])}: every simulated peak fits")


def check_fits(entries: list[dict[str, Any]], device: tuple[int, str]) -> None:
    """A simulated peak above the device's memory is the run's out-of-memory, refused here."""
    from acc_train.errors import UserError
    from acc_train_cli.units import human_bytes

    over = [e for e in entries if e["simulated"] is not None and e["simulated"]["peak_bytes"] > device[0]]
    if over:
        worst = ", ".join(f"{e['name']} peaks at {human_bytes(e['simulated']['peak_bytes'])}" for e in over)
        raise UserError(
            f"the step does not fit {device[1]} ({human_bytes(device[0])} per device): {worst}",
            where="--device-memory",
            hint="turn on training.gradient_checkpointing, lower --micro-batch-size or data.seq_len, shard over more processes, or use a strategy that shards more (fsdp, zero3)",
        )
