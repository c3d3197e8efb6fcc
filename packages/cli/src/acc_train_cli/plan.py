"""``acc-train plan``: per-rank memory of the job under every installed strategy and preset.

Each strategy states its own accounting (``StrategyPlanner.plan_memory``); the model is counted on
the meta device, never allocated. Only click is imported at module level.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import click

from acc_train_cli.errors import report_plugin_failures, user_errors
from acc_train_cli.job import merge_parent_params, resolve_job
from acc_train_cli.units import human_bytes

__all__ = ["build_plan", "human_bytes", "plan"]


def _check_model_path(name: str | None) -> None:
    """A local model path must hold a transformers config (its weights are never read)."""
    if not name or not (name.startswith((".", "/", "~")) or Path(name).exists()):
        return
    from acc_train.errors import UserError

    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".json":
        return
    if not path.exists():
        raise UserError(f"{name!r} does not exist", where="model.name_or_path", hint="give a save_pretrained directory or its config.json")
    if not (path / "config.json").is_file():
        raise UserError(
            f"{name!r} has no config.json, so its model cannot be counted",
            where="model.name_or_path",
            hint="point at a directory written by save_pretrained, or at a config.json",
        )


def _precision(requested: str) -> str:
    if requested != "auto":
        return requested  # planning fp16 for a GPU from a CPU machine is fine
    from acc_train.machine import current_machine, resolve_mixed_precision

    return resolve_mixed_precision(requested, current_machine())


#: ``--mesh`` dimension names -> the fsdp strategy's options
MESH_DIMENSIONS = {"replicate": "dp_replicate", "shard": "dp_shard", "cp": "cp", "tp": "tp"}


def parse_mesh(text: str) -> dict[str, int]:
    """``replicate=2,shard=4,cp=2,tp=2`` -> ``{"dp_replicate": 2, "dp_shard": 4, "cp": 2, "tp": 2}`` (UserError naming --mesh)."""
    from acc_train.errors import UserError

    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if name.strip() not in MESH_DIMENSIONS or not sep or not value.strip().isdigit() or int(value) < 1:
            raise UserError(
                f"cannot read mesh dimension {part!r}",
                where="--mesh",
                hint=f"give NAME=SIZE pairs, NAME one of {', '.join(MESH_DIMENSIONS)}, e.g. replicate=2,shard=4,tp=2",
            )
        out[MESH_DIMENSIONS[name.strip()]] = int(value)
    if not out:
        raise UserError("--mesh is empty", where="--mesh", hint="e.g. --mesh replicate=2,shard=4")
    return out


def expected_throughput(shape: Any, seq_len: int, precision: str, world: int, machines: int, mfu: float, device: str | None) -> dict[str, Any]:
    """Tokens per second the job trains at ``mfu`` (:mod:`acc_train.outputs.mfu`): the devices' peak in
    the compute precision times ``mfu`` over the model's FLOPs per token. ``device``: a name
    from the peak table (``H100``, ``A100``...) for ``world`` such GPUs; None: this machine's
    device (its GPUs, or its CPU measured by the probe, one per machine)."""
    from acc_train.errors import UserError
    from acc_train.outputs.device_peaks import device_peak_flops
    from acc_train.outputs.mfu import model_flops_per_token

    per_token = model_flops_per_token(shape.config, seq_len, trainable_params=shape.parameters, total_params=shape.parameters + shape.frozen)
    if device is None:
        from acc_train.machine import current_machine

        kind = current_machine().device_type
        devices = machines if kind == "cpu" else world
    else:
        kind, devices = device, world
    try:
        peak, source = device_peak_flops(kind, precision)
    except ValueError as exc:
        raise UserError(str(exc), where="--device", hint="name a device of the table (e.g. H100, A100, H200, MI300X) or leave --device out for this machine's") from None
    return {
        "mfu": mfu,
        "flops_per_token": per_token,
        "precision": precision,
        "peak_flops_per_device": peak,
        "devices": devices,
        "peak_source": source,
        "tokens_per_s": mfu * peak * devices / per_token,
    }


def build_plan(job: Any, mesh: dict[str, int] | None = None, mfu: float | None = None, device: str | None = None) -> dict[str, Any]:
    """The plan as data: the model, the inputs and one row per strategy variant (and one for
    the FSDP2 ``mesh``, when given); with ``mfu``, the tokens/s the job trains at that MFU
    (:func:`expected_throughput`)."""
    from acc_train.launch.launcher import launch_machine
    from acc_train.memory.plan import ACTIVATION_FORMULA, PlanInput, activation_bytes, attention_score_factor, model_shape
    from acc_train.outputs.mfu import compute_precision
    from acc_train.config import resolve_strategy
    from acc_train.config.optimizer import optimizer_kind
    from acc_train.plugins import strategies

    cfg = job.config
    shape = model_shape(cfg)
    machine = launch_machine(cfg.launch)
    nproc = machine.world_size // machine.num_machines
    precision = _precision(cfg.training.mixed_precision)
    dtype = "fp32" if cfg.model.dtype == "auto" else cfg.model.dtype  # whatever the checkpoint is stored in
    inp = PlanInput(
        shape.parameters, machine.world_size, precision, local_world_size=nproc, dtype=dtype, largest_layer=shape.largest_layer,
        expert_parameters=shape.expert_parameters, gradient_checkpointing=cfg.training.gradient_checkpointing,
    )
    optimizer_bytes = optimizer_kind(cfg.optimizer.name).state_bytes(cfg.optimizer, inp.param_bytes)  # the job's optimizer
    inp = dataclasses.replace(inp, optimizer_bytes_per_param=optimizer_bytes)
    # LoRA's frozen base: the parameter bytes the strategy holds for that many elements, nothing more
    frozen_inp = PlanInput(shape.frozen, inp.world_size, precision, local_world_size=nproc, dtype=dtype) if shape.frozen else None
    mbs, seq = cfg.training.micro_batch_size, cfg.data.seq_len
    rows: list[dict[str, Any]] = []
    job_matched = False

    def add(label: str, strategy: Any, is_job: bool) -> None:
        try:
            planner = strategy.planner()
            mp = planner.plan_memory(inp)
            frozen = planner.plan_memory(frozen_inp).params if frozen_inp is not None else 0
        except Exception as exc:  # noqa: BLE001 - one plugin's broken accounting must not hide the others
            click.echo(f"warning: strategy {strategy.name!r} could not plan {label!r}: {type(exc).__name__}: {exc}", err=True)
            return
        # recomputed: the strategy's own checkpointing (FSDP's), or transformers' under any strategy
        recompute = mp.recompute or cfg.training.gradient_checkpointing
        # the strategy's split of each layer's activations (context parallelism: 1/cp of every row; tensor parallelism)
        act = activation_bytes(shape, mbs, seq // mp.sequence_split, precision if inp.param_bytes == 4 else dtype, recompute=recompute, tp=mp.tensor_split)
        rows.append(
            {
                "label": label,
                "strategy": strategy.name,
                "job": is_job,
                "params": mp.params,
                "grads": mp.grads,
                "optimizer": mp.optimizer,
                "frozen": frozen,
                "model_state": mp.model_state,
                "buffers": mp.buffers,
                "activations": act,
                "activations_recomputed": recompute,
                "device_total": mp.on_device() + frozen * ("params" not in mp.offload) + (act or 0),
                "offloaded": mp.offloaded(),
                "offload": dict(mp.offload),
                "formula": mp.formula,
                "note": mp.note,
            }
        )

    job.strategy.check_model(shape.model)  # what the job's run would refuse of the model (a wrap policy, heads tp does not divide)
    for strategy, _owner in strategies().primary():
        for label, raw in strategy.planner().plan_variants().items():
            variant = resolve_strategy(strategy.name, raw)
            is_job = variant.name == job.strategy.name and variant.options == job.strategy.options
            job_matched |= is_job
            add(label, variant, is_job)
    if not job_matched:  # the job's own options differ from every preset: plan them too
        add(f"{cfg.strategy['name']} (this job)", job.strategy, True)
    if mesh is not None:
        variant = resolve_strategy("fsdp", {"version": 2, **mesh})
        sizes = variant.mesh_sizes(inp.world_size)  # refuses a mesh that does not fit the world
        variant.check_job(cfg)  # what the run would refuse: a sequence length cp cannot cut,
        variant.check_model(shape.model)  # heads tp does not divide
        inner = "".join(f",{n}={sizes[n]}" for n in ("cp", "tp") if n in sizes)
        add(f"fsdp2 mesh replicate={sizes['dp_replicate']},shard={sizes['dp_shard']}{inner}", variant, False)
    return {
        "model": shape.name,
        "parameters": shape.parameters,
        "frozen_parameters": shape.frozen,
        "lora": cfg.model.lora.model_dump(mode="json") if cfg.model.lora is not None else None,
        "num_processes": nproc,
        "num_machines": cfg.launch.num_machines,
        "world_size": inp.world_size,
        "precision": precision,
        "model_dtype": dtype,
        "micro_batch_size": mbs,
        "seq_len": seq,
        "gradient_checkpointing": cfg.training.gradient_checkpointing,
        "optimizer": {"name": cfg.optimizer.name, "state_bytes_per_parameter": optimizer_bytes},
        "attn_implementation": shape.attn_implementation,
        "attention_score_factor": attention_score_factor(
            shape.attn_implementation, shape.attention_dropout, precision if inp.param_bytes == 4 else dtype, shape.attention_softcapping
        ),
        "activation_formula": ACTIVATION_FORMULA,
        "rows": rows,
        "throughput": (
            expected_throughput(shape, seq, compute_precision(precision, dtype), inp.world_size, cfg.launch.num_machines, mfu, device)
            if mfu is not None
            else None
        ),
    }


def _print_table(data: dict[str, Any]) -> None:
    precision = {"no": "fp32", "bf16": "bf16 mixed precision", "fp16": "fp16 mixed precision"}[data["precision"]]
    if data.get("model_dtype", "fp32") != "fp32":
        precision = f"pure {data['model_dtype']} (model.dtype: no fp32 master copy where the optimizer steps the parameters)"
    click.echo(
        f"model: {data['model']}, psi = {data['parameters']:,} parameters; N = {data['world_size']} processes"
        + (f" ({data['num_processes']} on each of {data['num_machines']} machines)" if data["num_machines"] > 1 else "")
        + f"; {precision}; micro-batch {data['micro_batch_size']} x {data['seq_len']} tokens"
        + ("; activations recomputed in backward (training.gradient_checkpointing)" if data["gradient_checkpointing"] else "")
        + f"; optimizer {data['optimizer']['name']} ({data['optimizer']['state_bytes_per_parameter']:g} bytes of state per parameter)"
    )
    lora = data.get("lora")
    if lora:
        click.echo(
            f"LoRA (model.lora: r {lora['r']}, targets {lora['target_modules']}): psi counts the adapters alone; the base model's "
            f"{data['frozen_parameters']:,} parameters are frozen: held as each strategy holds parameters, no gradients, no moments"
        )
    click.echo("per rank; '(cpu)' marks state held in CPU memory (offload), left out of the device total\n")

    def cell(row: dict[str, Any], part: str) -> str:
        where = row["offload"].get(part)
        return human_bytes(row[part]) + (f" ({where})" if where else "")

    frozen = bool(data.get("frozen_parameters"))
    head = ("strategy", "params", "grads", "optimizer", *(("frozen base",) if frozen else ()), "buffers", "activations*", "device total", "offloaded", "model-state formula")
    lines = [head]
    for r in data["rows"]:
        lines.append(
            (
                ("* " if r["job"] else "  ") + r["label"],
                cell(r, "params"),
                cell(r, "grads"),
                cell(r, "optimizer"),
                *((cell({**r, "params": r["frozen"]}, "params"),) if frozen else ()),
                cell(r, "buffers"),
                human_bytes(r["activations"]) if r["activations"] is not None else "n/a",
                human_bytes(r["device_total"]),
                human_bytes(r["offloaded"]) if r["offloaded"] else "-",
                r["formula"],
            )
        )
    lines[0] = ("  " + head[0], *head[1:])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for i, line in enumerate(lines):
        click.echo("  ".join(c.ljust(w) if j in (0, len(head) - 1) else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths))).rstrip())
        if i == 0:
            click.echo("  ".join("-" * w for w in widths))
    click.echo("\n'* ' marks the job's own strategy. Notes:")
    for r in data["rows"]:
        if r["note"]:
            click.echo(f"  {r['label']}: {r['note']}")
    click.echo(f"* {data['activation_formula']}; s = seq_len, b = micro-batch, h = hidden size, a = heads, L = layers, V = vocab.")
    click.echo(f"  This job's attention: {data['attn_implementation']} (c = {data['attention_score_factor']} bytes kept per attention score).")
    click.echo("  buffers: what a strategy allocates beside the model state to compute and communicate (the gathered block")
    click.echo("  and its all-gather and reduce-scatter buffers under FSDP; found by `plan --simulate`, BENCHMARKS.md).")
    click.echo("  The activation figure is an estimate, the same under every data-parallel strategy. The model-state figures")
    click.echo("  are each strategy's own accounting, for parameters held in fp32 (model.dtype auto or fp32: whatever the")
    click.echo("  checkpoint is stored in) or pure bf16/fp16; they match what run.json measures (BENCHMARKS.md).")
    t = data.get("throughput")
    if t:
        click.echo(
            f"\nthroughput at MFU {t['mfu']:.0%}: {t['tokens_per_s']:,.0f} tokens/s over all ranks "
            f"({t['flops_per_token'] / 1e9:.4g} GFLOPs per token; {t['devices']} x {t['peak_flops_per_device'] / 1e12:.4g} TFLOP/s: {t['peak_source']})"
        )


@click.command()
@click.option("--config", "config_file", metavar="FILE", help="YAML job config (defaults < file < flags < --set).")
@click.option("--model", "model", metavar="PATH", help="A save_pretrained directory or config.json (default: the job's model).")
@click.option("--num-processes", type=int, metavar="N", help="Processes per machine (default: the job's, or one per GPU, or 1).")
@click.option("--num-machines", type=int, metavar="N", help="Machines taking part.")
@click.option("--micro-batch-size", type=int, metavar="N", help="Sequences per process per micro-batch (for the activations).")
@click.option("--mixed-precision", type=click.Choice(["auto", "no", "bf16", "fp16"]), help="auto: bf16 where native here, else fp32.")
@click.option("--set", "sets", multiple=True, metavar="KEY.PATH=VALUE", help="Set any config key (repeatable), e.g. data.seq_len=2048.")
@click.option("--mesh", "mesh", metavar="DIMS", help="Also plan FSDP2 over this mesh, e.g. replicate=2,shard=4 (HSDP), shard=4,tp=2 (FSDP x TP) or shard=2,cp=4 (FSDP x CP); product = processes.")
@click.option(
    "--mfu", "mfu", type=click.FloatRange(0, 1, min_open=True), metavar="FRACTION",
    help="Also print the tokens/s the job trains at this model FLOPs utilization, e.g. 0.4 (0 < MFU <= 1).",
)
@click.option("--device", "device", metavar="NAME", help="With --mfu: the GPU to plan for, by name (H100, A100, H200, MI300X...); default: this machine's.")
@click.option(
    "--simulate", is_flag=True,
    help="Also rehearse one step at the target world size on this CPU (fake process group, fake tensors, torch's memory trackers) and set it beside the plan.",
)
@click.option("--strategies", "strategy_names", metavar="NAME,...", help="With --simulate: the strategies and presets to simulate (default: the job's own, plus --mesh).")
@click.option(
    "--device-memory", "device_memory", metavar="SIZE|CARD",
    help="With --simulate: refuse (exit 2) a step whose simulated peak does not fit this much device memory, e.g. 80GiB or H100.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (bytes).")
@click.pass_context
@user_errors
def plan(
    ctx: click.Context, model: str | None, as_json: bool, mesh: str | None, mfu: float | None, device: str | None,
    simulate: bool, strategy_names: str | None, device_memory: str | None, **params: Any,
) -> None:
    """Per-rank memory of the job under every installed strategy and preset, before running it.

    Parameters, gradients, optimizer state (each strategy's own accounting, exact for what
    it holds at rest), an estimate of the activations for the configured micro-batch and
    sequence length, and the total. The model is counted on the meta device: nothing is
    allocated, so any size can be planned on a laptop. The job is resolved as `acc-train`
    resolves it: defaults < the default config file or --config FILE < flags < --set.

    \b
      acc-train plan --num-processes 8 --mixed-precision bf16
      acc-train plan --model ./my-model --set data.seq_len=2048 --micro-batch-size 4
      acc-train plan --num-processes 8 --mesh replicate=2,shard=4
      acc-train plan --num-processes 8 --mixed-precision bf16 --mfu 0.4 --device H100
    """
    merged = merge_parent_params(ctx, params)
    flags = {"model.name_or_path": (model, "--model")} if model is not None else {}
    if (merged.get("num_machines") or 1) > 1 and not merged.get("main_process_ip"):
        # a plan is no rendezvous: machine 0's address matters to the launch alone
        flags["launch.main_process_ip"] = ("127.0.0.1", "plan (no rendezvous)")
    job = resolve_job(merged, flags)
    report_plugin_failures()
    _check_model_path(job.config.model.name_or_path)
    if device is not None and mfu is None:
        raise click.UsageError("--device only says what --mfu is measured against: give --mfu too")
    if (strategy_names is not None or device_memory is not None) and not simulate:
        raise click.UsageError("--strategies and --device-memory choose what --simulate rehearses: give --simulate too")
    mesh_dims = parse_mesh(mesh) if mesh is not None else None
    memory = None
    if device_memory is not None:
        from acc_train_cli.simulate_cmd import device_memory_bytes

        memory = device_memory_bytes(device_memory)
    data = build_plan(job, mesh_dims, mfu, device)
    if simulate:
        from acc_train_cli.simulate_cmd import check_fits, print_simulation, simulate_plan

        entries = simulate_plan(job, data, strategy_names, mesh_dims)
        data["strategies"] = [{k: v for k, v in e.items() if k != "plan"} | {"plan": {"device_total_bytes": e["plan"]["device_total_bytes"]}} for e in entries]
        if memory is not None:
            data["device_memory_bytes"] = memory[0]
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        _print_table(data)
        if simulate:
            print_simulation(entries, memory)
    sys.stdout.flush()
    if simulate and memory is not None:
        check_fits(entries, memory)
