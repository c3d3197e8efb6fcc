"""FSDP's full checkpoint format, on torch.distributed.checkpoint's state-dict API.

Sharded checkpoints (the default, ``state_dict_type: sharded``) use core's ``dcp`` format: every
rank writes its own shards as safetensors, and a load reshards them. ``fsdp-full`` gathers the
whole model and optimizer state to rank 0 and writes it as safetensors + JSON, with parameter
names as keys. It writes no portable state, but its files are keyed by name, so
``checkpoint convert`` and ``export`` read them through :meth:`FullFormat.read_full_state`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from acc_train.api import CheckpointFormat, flatten_optimizer_state, load_portable_into, state_dict_options, unflatten_optimizer_state

__all__ = ["FullFormat"]


def gather_full(state: dict[str, Any], keep: bool) -> dict[str, Any]:
    """Every sharded tensor (DTensor, ShardedTensor) of a state dict gathered whole, on CPU.
    Collective: all ranks call it; only where ``keep`` is the result filled. For CPU runs
    (gloo, one process group); GPU runs use torch's own full-state-dict path."""
    import torch
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            gathered = gather_full(value, keep)
        elif hasattr(value, "full_tensor"):  # DTensor
            gathered = value.full_tensor().detach().cpu()
        elif isinstance(value, ShardedTensor):
            full = torch.empty(value.size(), dtype=value.dtype) if keep else None
            value.gather(dst=0, out=full)
            gathered = full
        elif isinstance(value, torch.Tensor):
            gathered = value.detach().cpu()
        else:
            gathered = value
        if keep:
            out[key] = gathered
    return out


def _torch_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the torch one


class FullFormat(CheckpointFormat):
    name = "fsdp-full"
    description = "whole model + optimizer gathered to rank 0, as safetensors + JSON"

    def save(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import get_state_dict

        keep = accelerator.is_main_process
        if accelerator.acc_machine.device_type == "cpu":
            # gathered from the sharded state: FSDP1's full-state-dict path crashes on CPU (torch 2.13)
            sharded_model, sharded_optim = get_state_dict(model, _torch_optimizer(optimizer), options=state_dict_options())
            msd, osd = gather_full(sharded_model, keep), gather_full(sharded_optim, keep)
        else:
            opts = state_dict_options(full_state_dict=True, cpu_offload=True)
            msd, osd = get_state_dict(model, _torch_optimizer(optimizer), options=opts)
        if keep:
            save_file({k: v.detach().contiguous().clone() for k, v in msd.items()}, str(directory / "model.safetensors"))
            tensors, meta = flatten_optimizer_state(osd)
            save_file(tensors, str(directory / "optimizer.safetensors"))
            (directory / "optimizer.json").write_text(json.dumps(meta))

    def load(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import set_state_dict

        msd = load_file(str(directory / "model.safetensors"))
        osd = unflatten_optimizer_state(load_file(str(directory / "optimizer.safetensors")), json.loads((directory / "optimizer.json").read_text()))
        set_state_dict(model, _torch_optimizer(optimizer), model_state_dict=msd, optim_state_dict=osd, options=state_dict_options(full_state_dict=True))

    def load_portable(self, accelerator: Any, model: Any, optimizer: Any, directory: Path) -> None:
        """From another strategy's portable state (its own checkpoints are not portable)."""
        load_portable_into(model, optimizer, directory)

    def read_full_state(self, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """The gathered files, keyed as the portable state is (``model.<fqn>``,
        ``optim.state.<fqn>.<name>``), in this process alone."""
        from safetensors.torch import load_file

        flat = {f"model.{k}": v for k, v in load_file(str(directory / "model.safetensors")).items()}
        for key, tensor in load_file(str(directory / "optimizer.safetensors")).items():
            _, fqn, name = key.split("/")  # state/<fqn>/<name>, as flatten_optimizer_state writes it
            flat[f"optim.state.{fqn}.{name}"] = tensor
        return flat
