"""Every rank's random state (python, numpy, torch, CUDA), captured as JSON plus tensors for
safetensors and restored, so a resumed run draws the same numbers. No pickle."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This process's RNG states: (python and numpy as JSON, torch's as tensors)."""
    import numpy as np
    import torch

    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    as_json = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    return as_json, tensors


def restore_rng(as_json: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Set this process's RNG states from what :func:`capture_rng` returned."""
    import numpy as np
    import torch

    version, state, gauss = as_json["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = as_json["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
