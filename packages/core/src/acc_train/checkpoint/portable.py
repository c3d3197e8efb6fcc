"""The portable state: model and optimizer tensors keyed by parameter name, on disk as
torch.distributed.checkpoint's safetensors shards.

Keys follow torch's ``get_state_dict`` convention (``model.<fqn>``,
``optim.state.<fqn>.exp_avg``...). Every shard is a safetensors file whose header says where it
sits in the whole tensor, so DCP reshards it on load: a checkpoint written under one strategy
and world size is read under another, and nothing in it needs pickle. Also here: the
pickle-free split of an optimizer ``state_dict`` into tensors and JSON, for formats that write
their own files.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.checkpoint.hashing import StreamHashes
from acc_train.errors import UserError

if TYPE_CHECKING:
    import torch

__all__ = [
    "PORTABLE_DIR",
    "flatten_optimizer_state",
    "unflatten_optimizer_state",
    "torch_optimizer",
    "write_portable_state",
    "read_portable_state",
    "read_portable_full",
    "write_portable_full",
    "load_portable_into",
    "state_dict_options",
]

#: the portable state's directory inside a checkpoint
PORTABLE_DIR = "state"


def flatten_optimizer_state(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer ``state_dict`` -> (tensors for safetensors, the rest as JSON)."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, pstate in state_dict["state"].items():  # pid: an index, or a parameter name
        for key, value in pstate.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{pid}/{key}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    meta = {"param_groups": state_dict["param_groups"], "scalars": scalars, "param_ids": [str(p) for p in state_dict["state"]]}
    return tensors, meta


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flatten_optimizer_state`."""

    def key_of(pid: str) -> int | str:
        return int(pid) if pid.isdigit() else pid

    state: dict[int | str, dict[str, Any]] = {key_of(pid): dict(meta["scalars"].get(pid, {})) for pid in meta["param_ids"]}
    for name, tensor in tensors.items():
        _, pid, key = name.split("/")
        state[key_of(pid)][key] = tensor
    # JSON has no tuples; optimizers keep e.g. ``betas`` as one
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def state_dict_options(**options: Any) -> Any:
    """torch's ``StateDictOptions`` for every state acc-train saves and loads: frozen parameters
    are left out (LoRA's base weights come from the base model, not from checkpoints), so a
    load fills the trainable parameters alone (``strict=False`` for the frozen ones; a missing
    trainable tensor is still an error, raised by DCP when it reads). ``options``: more of them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False, **options)


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def write_portable_state(
    directory: Path, model_state: dict[str, Any], optim_state: dict[str, Any], process_group: Any = None, asynchronous: bool = False
) -> Any:
    """Write name-keyed model and optimizer tensors as DCP safetensors shards. Collective:
    every rank calls it with its own (possibly sharded) tensors; replicated tensors are
    written once. Only tensors go in: param groups come from the job's config on resume.
    ``asynchronous``: return once the tensors are staged, with a future for the writes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(str(directory / PORTABLE_DIR), save_distributed=_distributed())
    writer.fs = StreamHashes.wrap_active(writer.fs)  # a save in progress hashes the files as they are written
    state = {"model": model_state, "optim": {"state": _numbers_as_tensors(optim_state)}}
    with warnings.catch_warnings():  # one process: DCP says it assumes one process, which is right
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if asynchronous:
            return dcp.async_save(state, storage_writer=writer, process_group=process_group)
        dcp.save(state, storage_writer=writer, process_group=process_group)
    return None


def write_portable_full(directory: Path, flat: dict[str, torch.Tensor]) -> None:
    """Write flat keys to full tensors (as :func:`read_portable_full` returns them) as a
    portable state, in this process alone (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(directory / PORTABLE_DIR)), no_dist=True)


def read_portable_state(directory: Path, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
    """Fill the given name-keyed tensors (this run's layout: full, DTensor shards...) in place
    from a checkpoint's portable state, resharding as needed. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory / PORTABLE_DIR))
    optim_tensors = _numbers_as_tensors(optim_state)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": model_state, "optim": {"state": optim_tensors}}, storage_reader=reader)
    except Exception as exc:  # DCP raises CheckpointException with each rank's failure
        raise UserError(
            f"the checkpoint's state does not fit this model: {str(exc).splitlines()[0][:300]}",
            where=str(directory / PORTABLE_DIR),
            hint="resume with the model (and model config) that wrote the checkpoint",
        ) from None
    _tensors_back_to_numbers(optim_state, optim_tensors)


def _numbers_as_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of a name-keyed optimizer state with each plain number (a Python ``int`` step,
    as transformers' Adafactor keeps) as a 0-dim tensor: the safetensors shards hold tensors only."""
    import torch

    def convert(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64)
        return value

    return convert(state)


def _tensors_back_to_numbers(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Write the numbers :func:`_numbers_as_tensors` turned into tensors back into ``state``."""
    for key, value in state.items():
        if isinstance(value, dict):
            _tensors_back_to_numbers(value, loaded[key])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            state[key] = type(value)(loaded[key].item())


def read_portable_full(directory: Path) -> dict[str, torch.Tensor]:
    """The whole portable state, in this process alone (no process group): flat keys
    (``model.<fqn>``, ``optim.state.<fqn>.<name>``) to full tensors, assembled from every
    rank's shards. For inspecting, converting and exporting checkpoints."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory / PORTABLE_DIR))
    metadata = reader.read_metadata()
    flat = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(directory / PORTABLE_DIR)), no_dist=True)
    return flat


def load_portable_into(model: Any, optimizer: Any, directory: Path) -> None:
    """Restore a module torch's state-dict API understands (plain, DDP, FSDP1, FSDP2) and its
    optimizer from a portable state, resharded to this run's layout. Collective."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    optim = torch_optimizer(optimizer)
    options = state_dict_options()
    msd, osd = get_state_dict(model, optim, options=options)  # this run's layout; initialises the optimizer state
    read_portable_state(directory, msd, osd["state"])
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd, options=options)
