"""The ``deepspeed`` checkpoint format: DeepSpeed's own per-rank files plus the portable state,
and the gather/scatter between ZeRO's partitions and parameters keyed by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from acc_train.api import CheckpointFormat, UserError

__all__ = ["DeepSpeedCheckpointFormat"]


class DeepSpeedCheckpointFormat(CheckpointFormat):
    """DeepSpeed's own per-rank files (``engine.save_checkpoint``), plus the portable state.

    DeepSpeed writes its files with ``torch.save`` and reads them with ``torch.load``: they are
    pickles, read only by DeepSpeed's own loader, only after the manifest's sha256 of every file
    has been checked. They serve a resume under the same ZeRO stage and world size. Beside
    them, ``state/`` holds the portable state (the fp32 weights and Adam moments gathered per
    parameter, keyed by name, as safetensors): any other strategy or world size resumes from
    that, and this format resumes from any other strategy's portable state."""

    name = "deepspeed"
    description = "DeepSpeed's own per-rank files, plus the portable state (safetensors) for other strategies"
    writes_portable = True
    #: ``load`` resumes from the portable state alone (a converted checkpoint has no ``deepspeed/``)
    convert_target = True
    #: the gather and scatter below know Adam's state only (see MOMENTS)
    optimizer_state_keys = ("step", "exp_avg", "exp_avg_sq")

    def save(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        from acc_train.api import write_portable_state

        # frozen parameters (LoRA's base weights) come from the base model, not from checkpoints
        model.save_checkpoint(str(directory / "deepspeed"), tag="state", save_latest=False, exclude_frozen_parameters=True)
        weights, moments = _gather_portable(model)
        write_portable_state(directory, weights, moments)

    def load(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        if not (directory / "deepspeed").is_dir():  # e.g. converted to the portable state alone
            self.load_portable(accelerator, model, optimizer, directory)
            return
        frozen = any(not p.requires_grad for p in model.module.parameters())
        path, _ = model.load_checkpoint(
            str(directory / "deepspeed"), tag="state", load_optimizer_states=True, load_lr_scheduler_states=False, load_module_strict=not frozen
        )
        if path is None:
            raise UserError(f"DeepSpeed found no checkpoint in {directory / 'deepspeed'}", where="--resume")

    def load_portable(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        _scatter_portable(model, directory)


#: Adam's per-parameter state, as torch's AdamW names it
MOMENTS = ("exp_avg", "exp_avg_sq")


def _full_shape(p: Any) -> Any:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def _names_by_param(module: Any) -> list[tuple[str, list[str], Any]]:
    """(first name, every name, parameter): tied parameters appear once, under all their names."""
    seen: dict[int, tuple[str, list[str], Any]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            seen[id(p)][1].append(name)
        else:
            seen[id(p)] = (name, [name], p)
    return list(seen.values())


def _ensure_adam_state(engine: Any) -> None:
    """Before the first step the torch optimizer has no state for ZeRO's flat partitions:
    create AdamW's (step, exp_avg, exp_avg_sq), as its first step would, to be filled."""
    import torch

    zero = engine.optimizer
    flats = zero.fp32_partitioned_groups_flat if engine.zero_optimization_stage() == 3 else zero.single_partition_of_fp32_groups
    for flat in flats:
        state = zero.optimizer.state[flat]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=flat.device)  # fused AdamW (CUDA) keeps it there
            state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)


def _link_optimizer_state(engine: Any) -> None:
    """Stages 1-2: point every parameter's fragment at its group's optimizer state. DeepSpeed
    links them once, after the first group's first step, so the later groups' fragments (here
    the norms' no-decay group) stay empty and ``safe_get_full_optimizer_state`` fails on them
    (DeepSpeed 0.19.8)."""
    if engine.zero_optimization_stage() == 3:
        return
    from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

    zero = engine.optimizer
    for i, flat in enumerate(zero.single_partition_of_fp32_groups):
        if flat in zero.optimizer.state:
            lazy_init_hp_params_optimizer_state(zero.bit16_groups[i], flat, zero.optimizer.state)


def _adam_step(zero: Any) -> float:
    steps = [float(s["step"]) for s in zero.optimizer.state.values() if "step" in s]
    return max(steps) if steps else 0.0


def _gather_portable(engine: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every trainable parameter's fp32 weight and Adam moments, whole, keyed by name
    (collective: DeepSpeed all-gathers each from the ranks' partitions). Frozen parameters
    (LoRA's base weights) are not state: they come from the base model."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _link_optimizer_state(engine)
    step = torch.tensor(_adam_step(engine.optimizer), dtype=torch.float32)
    weights: dict[str, Any] = {}
    moments: dict[str, Any] = {}
    for first, names, p in _names_by_param(engine.module):
        if not p.requires_grad:
            continue
        full = safe_get_full_fp32_param(p).detach().cpu().float().reshape(_full_shape(p))
        for name in names:
            weights[name] = full
        moments[first] = {"step": step.clone(), **{k: safe_get_full_optimizer_state(p, k).detach().cpu().reshape(_full_shape(p)) for k in MOMENTS}}
    return weights, moments


def _set_partition(zero: Any, p: Any, value: Any, key: str | None) -> None:
    """Stage 3: this rank's slice of ``value`` into its fp32 partition (of the weight, or of an
    optimizer state), padding included, which DeepSpeed's public setter does not allow."""
    part, _ = zero._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
    flat = value.flatten().to(part.dtype)
    start = part.numel() * zero._get_param_partition_rank(p)
    n = max(0, min(part.numel(), flat.numel() - start))
    part.data.zero_()
    part.data[:n].copy_(flat[start : start + n])


def _scatter_portable(engine: Any, directory: Path) -> None:
    """Set the trainable parameters' weights, fp32 master partitions and Adam moments from a
    portable state written under any strategy and world size (frozen ones are the base model's)."""
    import torch
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from acc_train.api import read_portable_state

    zero = engine.optimizer
    stage = engine.zero_optimization_stage()
    params = [entry for entry in _names_by_param(engine.module) if entry[2].requires_grad]
    weights = {name: torch.empty(_full_shape(p), dtype=torch.float32) for _, names, p in params for name in names}
    moments = {
        first: {"step": torch.zeros((), dtype=torch.float32), **{k: torch.empty(_full_shape(p), dtype=torch.float32) for k in MOMENTS}}
        for first, _, p in params
    }
    read_portable_state(directory, weights, moments)
    _ensure_adam_state(engine)
    _link_optimizer_state(engine)
    with torch.no_grad():
        for first, _, p in params:
            w = weights[first]
            if stage == 3:
                _set_partition(zero, p, w, None)
                for k in MOMENTS:
                    _set_partition(zero, p, moments[first][k], k)
                continue
            p.data.copy_(w.to(p.dtype))  # below stage 3 every rank holds the module's weights whole
            safe_set_full_fp32_param(p, w)
            for k in MOMENTS:
                safe_set_full_optimizer_state(p, moments[first][k], k)
        if stage == 3:  # the module's partitions follow the fp32 masters, as after a step
            for lp, hp in zip(zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat):
                lp.data.copy_(hp.data)
        step = max((float(m["step"]) for m in moments.values()), default=0.0)
        for state in zero.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32, device=state["step"].device) if torch.is_tensor(state["step"]) else int(step)
