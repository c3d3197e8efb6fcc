"""Tensor parallelism of the fsdp strategy's mesh (``strategy.tp``): transformers' ``tp_plan``.

The model is built as every strategy builds it (the same weights on every rank: the same files,
or the same seed), then each of its planned parameters is cut to this rank's part of the mesh's
``tp`` dimension by transformers' own tensor-parallel styles (``apply_tensor_parallelism``, what
``from_pretrained(..., tp_plan="auto")`` applies while loading); Accelerate then finds the size it
checks (``model.tp_size``) as after such a load.
"""

from __future__ import annotations

from typing import Any

from acc_train.api import UserError

__all__ = ["check_tp_fits", "apply_tp", "replicate_rest", "let_accelerate_import_replicate_parallel"]

#: the model config fields a tensor-parallel plan splits: attention heads over the tp ranks
HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads")


def check_tp_fits(model_config: Any, tp: int) -> None:
    """Refuse a ``tp`` that does not divide the model's attention heads (query and key/value)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    for field in HEAD_FIELDS:
        heads = getattr(text, field, None)
        if isinstance(heads, int) and heads % tp:
            raise UserError(
                f"tp: {tp} does not divide the model's {field} ({heads}); tensor parallelism gives each tp rank whole heads",
                where="strategy.tp",
                hint=f"choose a tp that divides {heads}",
            )


def apply_tp(model: Any, tp_mesh: Any) -> None:
    """Shard ``model`` over ``tp_mesh`` with its class's ``tp_plan``, in place."""
    try:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError:
        import transformers

        raise UserError(
            f"strategy.tp needs transformers' DTensor tensor parallelism (transformers.distributed, 5.x); this is transformers {transformers.__version__}",
            where="strategy.tp",
            hint="pip install -U transformers (tested with 5.24), or drop strategy.tp",
        ) from None
    from transformers.distributed import DistributedConfig

    tp = tp_mesh.size()
    check_tp_fits(model.config, tp)
    if not getattr(model, "supports_tp_plan", False):
        raise UserError(
            f"{type(model).__name__} has no tensor-parallel plan (tp_plan) in transformers",
            where="strategy.tp",
            hint="use a model whose transformers class has one (Llama, Qwen2, Mistral...), or drop strategy.tp",
        )
    distributed = DistributedConfig(tp_size=tp)
    # transformers' plan for this model, '*' expanded to its layers (what from_pretrained applies)
    plan, _, _ = model._resolve_parallel_plans(distributed)
    apply_tensor_parallelism(model, tp_mesh, plan)
    # the size Accelerate checks (``model.tp_size``, which transformers reads from ``_tp_size``);
    # not config.distributed_config, with which save_pretrained would gather collectively and
    # config.json would ask whoever loads final/ for tensor parallelism
    model._tp_size = tp


def replicate_rest(model: Any, tp_mesh: Any) -> None:
    """Make the parameters the plan leaves whole (norms) DTensors replicated over ``tp_mesh``,
    their modules taking and giving plain tensors (torch's ``distribute_module``), as Accelerate
    does under FSDP2: every gradient is then a DTensor of one mesh (torch's gradient clipping
    cannot mix them with plain tensors, and FSDP2 shards them over the same mesh)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(module: Any, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) if _plain(x) else x for x in inputs)

    def to_local(module: Any, output: Any, mesh: Any) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)


def _plain(x: Any) -> bool:
    import torch
    from torch.distributed.tensor import DTensor

    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


class _NoReplicateParallel:
    """Stands in for transformers' ``ReplicateParallel``, which Accelerate 1.16 imports to make
    a tensor-parallel model's whole parameters DTensors before FSDP2 and transformers 5 no longer
    has: :func:`replicate_rest` has made them DTensors already, so Accelerate never uses it."""

    def __init__(self) -> None:
        raise RuntimeError("acc-train replicates a tensor-parallel model's whole parameters itself; Accelerate found one left plain")


def let_accelerate_import_replicate_parallel() -> None:
    """Accelerate's FSDP2 x TP preparation imports ``ReplicateParallel`` from
    ``transformers.integrations.tensor_parallel`` before looking for parameters that need it;
    without it there (transformers 5), the import fails even when none does."""
    from transformers.integrations import tensor_parallel

    if not hasattr(tensor_parallel, "ReplicateParallel"):
        tensor_parallel.ReplicateParallel = _NoReplicateParallel  # type: ignore[attr-defined]
