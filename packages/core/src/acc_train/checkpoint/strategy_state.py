"""The state a strategy owns beyond model and optimizer (``Strategy.state_dict``), written per
rank as ``strategy-rankNNNNN.safetensors`` (its tensors) and ``strategy-rankNNNNN.json`` (the
rest, and where each tensor goes), so a checkpoint never needs pickle to hold it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.errors import PluginError

if TYPE_CHECKING:
    import torch

    from acc_train.contracts.protocols import RunView

__all__ = ["strategy_state_files", "split_strategy_state", "join_strategy_state", "write_strategy_state", "read_strategy_state", "hand_back"]

_JSON_LEAVES = (str, int, float, bool, type(None))


def strategy_state_files(rank: int) -> tuple[str, str]:
    """(JSON, safetensors) file names of ``rank``'s strategy state in a checkpoint."""
    return f"strategy-rank{rank:05d}.json", f"strategy-rank{rank:05d}.safetensors"


def split_strategy_state(state: dict[str, Any], owner: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``state`` -> (JSON document, tensors for safetensors). Tensors may sit at any depth of
    nested dicts; everything else must be JSON (strings, finite numbers, booleans, None, lists
    and dicts of them). A value that is neither is a :class:`PluginError` naming ``owner`` (the
    strategy) and the key path, at the save that meets it."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    places: dict[str, list[str]] = {}

    def walk(value: Any, path: list[str]) -> Any:
        where = "/".join(path) or "(the state itself)"
        if isinstance(value, torch.Tensor):
            if not path:
                raise _bad(owner, where, "a tensor", "return a dict, e.g. {'buffer': tensor}")
            name = f"t{len(tensors)}"
            tensors[name] = value.detach().cpu().clone()  # its own memory: safetensors refuses shared storage
            places[name] = path
            return None
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise _bad(owner, f"{where}[{key!r}]", f"a {type(key).__name__} key", "use string keys (str(index) for a number)")
                kept = walk(item, [*path, key])
                if not isinstance(item, torch.Tensor):
                    out[key] = kept
            return out
        if not path:
            raise _bad(owner, where, f"a {type(value).__name__}", "return a dict")
        _check_json(value, owner, where)
        return value

    document = walk(state, [])
    return {"state": document, "tensors": places}, tensors


def join_strategy_state(document: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The inverse of :func:`split_strategy_state`."""
    state = document["state"]
    for name, path in document["tensors"].items():
        node = state
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tensors[name]
    return state


def write_strategy_state(directory: Path, run: RunView) -> None:
    """Write this rank's state of the run's strategy (``Strategy.state_dict``) into a checkpoint
    directory; nothing for an empty state."""
    strategy = run.job.strategy
    state = strategy.state_dict(run)
    if not state:
        return
    from safetensors.torch import save_file

    document, tensors = split_strategy_state(state, strategy.name)
    json_name, tensors_name = strategy_state_files(run.accelerator.process_index)
    save_file(tensors, str(directory / tensors_name))
    (directory / json_name).write_text(json.dumps({"strategy": strategy.name, **document}, allow_nan=False))


def read_strategy_state(directory: Path, rank: int) -> tuple[str, dict[str, Any]] | None:
    """(the strategy that wrote it, the state) of ``rank`` in a checkpoint, or None if it holds none."""
    json_name, tensors_name = strategy_state_files(rank)
    if not (directory / json_name).is_file():
        return None
    from safetensors.torch import load_file

    document = json.loads((directory / json_name).read_text())
    return document["strategy"], join_strategy_state(document, load_file(str(directory / tensors_name)))


def hand_back(run: RunView, resumed: tuple[Path, int] | None) -> None:
    """Give the run's strategy (``Strategy.load_state_dict``) the state its rank saved in the
    resumed checkpoint (``resumed``: its path and world size; None for a fresh run), when a
    strategy of the same name wrote it under as many processes: another strategy's state is not
    its own, and per-rank state does not carry over to another number of ranks. Otherwise the
    strategy's state starts afresh, and the main process says so. Nothing is called for a
    checkpoint that holds no such state."""
    if resumed is None:
        return
    checkpoint, written_world = resumed
    strategy, accelerator = run.job.strategy, run.accelerator
    loaded = read_strategy_state(checkpoint, accelerator.process_index)
    if loaded is None:
        return
    owner, state = loaded
    if owner == strategy.name and written_world == accelerator.num_processes:
        strategy.load_state_dict(run, state)
    elif accelerator.is_main_process:
        why = f'strategy "{owner}" wrote it' if owner != strategy.name else f"{written_world} processes wrote it"
        sys.stderr.write(
            f'warning: the checkpoint\'s per-rank state of strategy "{owner}" is not restored ({why}, and this run has '
            f'strategy "{strategy.name}" on {accelerator.num_processes}): the strategy\'s own state starts afresh\n'
        )


def _check_json(value: Any, owner: str, where: str) -> None:
    """Raise unless ``value`` is JSON all the way down (below a list, tensors are not placed)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _bad(owner, where, f"the number {value}", "JSON holds finite numbers only: keep it as a 0-dim tensor")
    if isinstance(value, _JSON_LEAVES):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, owner, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _bad(owner, f"{where}[{key!r}]", f"a {type(key).__name__} key", "use string keys (str(index) for a number)")
            _check_json(item, owner, f"{where}/{key}")
        return
    hint = "keep tensors (torch.Tensor) in dicts, and JSON values (str, int, float, bool, None, lists, dicts) elsewhere"
    raise _bad(owner, where, f"a {type(value).__name__}", hint)


def _bad(owner: str, where: str, what: str, hint: str) -> PluginError:
    return PluginError(
        f"Strategy.state_dict returned {what} at {where}, which a checkpoint cannot hold without pickle",
        where=f'strategy "{owner}"',
        hint=hint,
    )
