"""The end of a run: ``run.json``'s summary (gathered from every rank) and the ``final/`` model."""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

from acc_train.checkpoint import TrainerState
from acc_train.config.optimizer import optimizer_summary
from acc_train.evaluation.kinds import evaluation_summary
from acc_train.loop.loop import LoopResult
from acc_train.outputs.mfu import mfu
from acc_train.memory.state import ModelStateMeter
from acc_train.files.output_paths import fresh_directory, readable, replace_directory, replace_file
from acc_train.run import RunContext
from acc_train.loop.torch_compile import compile_summary

__all__ = ["summarize", "write_run_json", "save_final", "peak_memory_bytes"]


def peak_memory_bytes(device_type: str) -> int:
    """This process's peak: allocated CUDA memory on GPU, resident set size (RSS) on CPU. On
    Linux the RSS peak is the process image's own (``VmHWM``): ``ru_maxrss`` carries over
    through fork and exec, so a worker would report the command's peak (tokenizing a corpus)."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _param_checksum(model: Any) -> float:
    import torch

    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def _dtypes(run: RunContext) -> dict[str, str | None]:
    """This rank's ``param_dtype`` and ``master_dtype``, measured by the strategy's meter; without
    one, the trainable parameters' dtype, and the master dtype unknown."""
    from acc_train.memory.state import dtype_name

    measured = run.model_state_meter.dtypes() if run.model_state_meter is not None else {}
    if measured.get("param_dtype") is None:
        measured = {**measured, "param_dtype": dtype_name(p for p in run.model.parameters() if p.requires_grad)}
    return {"param_dtype": measured["param_dtype"], "master_dtype": measured.get("master_dtype")}


def _per_rank(run: RunContext) -> tuple[list[dict[str, Any]], int]:
    """(each rank's parameters, peak memory, model state and its dtypes, gathered on every rank; the model's parameters)."""
    from accelerate.utils import gather_object

    accelerator, model = run.accelerator, run.model
    local_elements, model_elements = run.job.strategy.parameter_elements(accelerator, model)
    meter = run.model_state_meter
    mine = {
        "rank": accelerator.process_index,
        "param_elements": local_elements,
        "peak_memory_bytes": peak_memory_bytes(accelerator.acc_machine.device_type),
        "param_checksum": _param_checksum(model),
        "model_state_bytes": meter.result() if meter is not None else None,
        "frozen_param_bytes": (meter or ModelStateMeter()).frozen_param_bytes(model),
        **_dtypes(run),
    }
    return sorted(gather_object([mine]), key=lambda r: r["rank"]), model_elements


def _model_compute(model: Any) -> dict[str, Any]:
    """How the model computes, as it ran: the attention kernel transformers chose, and how many
    layers recompute their activations in backward, by transformers' gradient checkpointing or
    by torch's checkpoint wrapper (FSDP's ``activation_checkpointing``)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper  # FSDP2 subclasses it

    try:
        from transformers.modeling_layers import GradientCheckpointingLayer as Layer
    except ImportError:  # transformers before 4.52: every module with the flag
        Layer = object
    modules = list(model.modules())
    return {
        "attn_implementation": getattr(getattr(model, "config", None), "_attn_implementation", None),
        "activation_checkpointing": {
            "transformers_layers": sum(1 for m in modules if isinstance(m, Layer) and getattr(m, "gradient_checkpointing", False) is True),
            "checkpoint_wrappers": sum(1 for m in modules if isinstance(m, CheckpointWrapper)),
        },
    }


def summarize(run: RunContext, state: TrainerState, result: LoopResult, resumed_from: str | None, data: dict[str, Any], started_at: float) -> dict[str, Any]:
    """``run.json``'s content (every rank computes it; the main process writes it). ``data``:
    what was prepared; ``started_at``: when the launch began (``time.time()``)."""
    job, accelerator = run.job, run.accelerator
    machine = accelerator.acc_machine
    t_cfg = job.config.training
    per_rank, model_elements = _per_rank(run)  # first: the peak memory of training, before anything else is loaded
    tokens_per_s = result.tokens / result.elapsed_s if result.elapsed_s > 0 else None
    basis = run.mfu_basis or {}
    times, blocked, overlap = result.step_times, result.checkpoint_blocked_s, result.checkpoint_overlap_s
    summary = {
        "strategy": job.config.strategy["name"],
        "strategy_options": job.strategy.options.model_dump(mode="json"),
        "distributed_type": str(accelerator.distributed_type),
        "world_size": accelerator.num_processes,
        "num_machines": machine.num_machines,
        "device": machine.device_type,
        "mixed_precision": accelerator.mixed_precision,
        "optimizer": optimizer_summary(job, run.optimizer),
        **job.strategy.summary(accelerator),
        **_model_compute(accelerator.unwrap_model(run.model)),
        "compile": compile_summary(run.model, t_cfg.compile),
        "steps": state.step,
        "start_step": result.start_step,
        "epoch": state.epoch,
        "final_loss": result.last_loss,
        "best_loss": result.best_loss,
        "tokens": state.tokens,
        # real tokens (padding left out) of this run's steps over its loop's wall time
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, basis["flops_per_token"], basis["peak_flops"]) if tokens_per_s is not None and "peak_flops" in basis else None,
        "mfu_basis": run.mfu_basis,
        "elapsed_s": round(state.elapsed_s, 3),
        "step_time_s": statistics.fmean(times) if times else None,
        "step_time_median_s": statistics.median(times) if times else None,
        "checkpoint_saves": {
            # measured: "async" when some save's writes went on while the loop did not wait for them
            # (by more than a millisecond: a future already done reports its callback at once)
            "mode": "async" if any(t > 1e-3 for t in overlap) else "sync",
            "blocked_s": [round(t, 4) for t in blocked],
            "overlap_s": [round(t, 4) for t in overlap],
            "mean_blocked_s": statistics.fmean(blocked) if blocked else None,
            # after the last step: waiting for the last asynchronous save's writes
            "final_wait_s": round(result.checkpoint_final_wait_s, 4),
        },
        "model_parameters": model_elements,
        "trackers": run.trackers,
        "per_rank": per_rank,
        "checkpoints": result.saved,
        "resumed_from": resumed_from,
        "resumed_via": result.resumed_via,
        # setup: from the launch (the command's start) to the first training batch in hand
        "data": {**data, "setup_s": round(result.first_batch_at - started_at, 3) if result.first_batch_at else None},
    }
    # each evaluator's last metrics and their step ({name: {"step": N, "metrics": {...}}}), and the keys of
    # its own (the built-ins': final_eval_loss, samples, harness, harness_step)
    return {**summary, **evaluation_summary(run, result.evaluations, taken=summary)}


def write_run_json(run: RunContext, summary: dict[str, Any]) -> None:
    """``run.json``, replaced atomically (main process)."""
    if run.accelerator.is_main_process:
        replace_file(run.output_dir / "run.json", json.dumps(summary, indent=2).encode())


def _save_in_dtype(model: Any, state_dict: dict[str, Any], dtype: Any, directory: Path) -> None:
    """``save_pretrained`` into ``directory`` (a fresh one, moved in afterwards) with the
    floating-point weights cast to ``dtype`` (one at a time, each fp32 copy freed as it goes) and
    config.json saying so."""
    for name, value in state_dict.items():
        if value.is_floating_point() and value.dtype != dtype:
            state_dict[name] = value.to(dtype)
    model.save_pretrained(directory, state_dict=state_dict)
    config = directory / "config.json"  # save_pretrained writes the live parameters' dtype there
    written = json.loads(config.read_text())
    written["dtype"] = str(dtype).removeprefix("torch.")
    config.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def _write_card(run: RunContext, summary: dict[str, Any], directory: Path, adapter: bool) -> None:
    """``README.md``, the model card, into ``directory``; best effort: a card that cannot be
    made is a warning, never the loss of the trained model."""
    from acc_train.outputs.model_card import model_card

    try:
        card = model_card(run.job.to_yaml(), run.job.config, summary, adapter=adapter)
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's metadata, a config it cannot render: said, and final/ is written without it
        import sys

        print(f"warning: final/README.md (the model card) not written: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    (directory / "README.md").write_text(card)


def save_final(run: RunContext, tokenizer: Any, summary: dict[str, Any] | None = None) -> None:
    """``final/``: the consolidated model as ``save_pretrained`` safetensors in
    :func:`~acc_train.model.build.final_dtype` (a bf16-stored model is written back in bf16), moved in
    atomically; under ``model.lora``, the adapter directory PEFT loads onto the base model.
    With the run's ``summary``, a model card (``README.md``, :mod:`acc_train.outputs.model_card`)."""
    from acc_train.model.adapters import is_adapter_model, save_adapter
    from acc_train.model.build import final_dtype

    accelerator, model, out = run.accelerator, run.model, run.output_dir
    dtype = final_dtype(run.job.config)  # on every rank: a config that cannot be read fails them all, none waits
    state_dict = accelerator.acc_strategy.full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        for stale in out.glob(".final-*"):  # staged by a run killed while writing final/ (the run lock holds others off)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = fresh_directory(out, ".final-")
        try:
            unwrapped = accelerator.unwrap_model(model)
            if is_adapter_model(unwrapped):
                save_adapter(unwrapped, state_dict, tmp)
            else:
                _save_in_dtype(unwrapped, state_dict, dtype, tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if summary is not None:
                _write_card(run, summary, tmp, adapter=is_adapter_model(unwrapped))
        except BaseException as exc:  # a full disk, say: no partial final/ left behind
            from acc_train.files.disk_full import disk_full_error

            full = disk_full_error(exc, tmp, what="while writing the final model into", done="the partial final/ was removed; the checkpoints are intact")
            shutil.rmtree(tmp, ignore_errors=True)
            if full is not None:
                raise full from None
            raise
        readable(tmp)  # safetensors writes model.safetensors 0600 whatever the umask
        replace_directory(tmp, out / "final")  # a crash leaves the old final/ or the new one, whole
    accelerator.wait_for_everyone()
