"""Checkpoints: atomic, pickle-free, with a manifest written last.

Layout::

    checkpoints/
      latest                 text file naming the latest complete checkpoint directory
      step-000010/
        model.safetensors    }  written by the strategy's checkpoint format
        optimizer.*          }
        trainer_state.json   step, epoch, data position, scheduler state
        rng-rank00000.json   python/numpy RNG; torch RNG states in rng-rank00000.safetensors
        manifest.json        written last: a directory without it is never resumed from

All ranks write into ``.staging-step-NNNNNN``; once every rank is done, rank 0 writes the
manifest, renames the directory into place and only then moves ``latest``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from acc_train.errors import UserError

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

__all__ = [
    "CheckpointFormat",
    "FullStateFormat",
    "CheckpointManager",
    "TrainerState",
    "find_checkpoint",
    "step_dir_name",
    "MANIFEST",
    "LATEST",
]

MANIFEST = "manifest.json"
LATEST = "latest"
STAGING_PREFIX = ".staging-"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass
class TrainerState:
    """What the loop needs, beyond model and optimizer, to continue exactly."""

    step: int = 0
    epoch: int = 0
    #: Micro-batches each rank has consumed in ``epoch``.
    batches_in_epoch: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class CheckpointFormat(ABC):
    """How model and optimizer state go to disk, registered by name through
    ``acc_train_register_checkpoint_formats``. Every rank calls ``save``/``load``."""

    name: ClassVar[str]
    description: ClassVar[str] = ""

    @abstractmethod
    def save(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        """Write model and optimizer state into ``directory`` (exists on every rank)."""

    @abstractmethod
    def load(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        """Restore model and optimizer state from ``directory``."""

    def all_names(self) -> list[str]:
        return [self.name]


# ----------------------------------------------------------------------------------------
# Pickle-free (de)serialisation of optimizer and RNG state
# ----------------------------------------------------------------------------------------


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
    def key_of(pid: str) -> int | str:
        return int(pid) if pid.isdigit() else pid

    state: dict[int | str, dict[str, Any]] = {key_of(pid): dict(meta["scalars"].get(pid, {})) for pid in meta["param_ids"]}
    for name, tensor in tensors.items():
        _, pid, key = name.split("/")
        state[key_of(pid)][key] = tensor
    # JSON has no tuples; optimizers keep e.g. ``betas`` as one
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
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
    import numpy as np
    import torch

    version, state, gauss = as_json["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = as_json["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------
# Core's own format: full (unsharded) state, for strategies whose ranks hold whole replicas
# ----------------------------------------------------------------------------------------


class FullStateFormat(CheckpointFormat):
    """The whole model and optimizer state, written once by rank 0 as safetensors + JSON.

    Suits data-parallel strategies (every rank holds the same replica)."""

    name = "full-state"
    description = "whole model + optimizer state as safetensors, written by rank 0"

    def save(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        from safetensors.torch import save_file, save_model

        if accelerator.is_main_process:
            save_model(accelerator.unwrap_model(model), str(directory / "model.safetensors"))
            tensors, meta = flatten_optimizer_state(optimizer.state_dict())
            save_file(tensors, str(directory / "optimizer.safetensors"))
            _write_json(directory / "optimizer.json", meta)

    def load(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        from safetensors.torch import load_file, load_model

        missing, unexpected = load_model(accelerator.unwrap_model(model), str(directory / "model.safetensors"), strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise UserError(
                f"checkpoint model does not match this model (missing {missing[:3]}, unexpected {unexpected[:3]})",
                where=str(directory),
                hint="resume with the same model config that wrote the checkpoint",
            )
        meta = json.loads((directory / "optimizer.json").read_text())
        tensors = load_file(str(directory / "optimizer.safetensors"))
        optimizer.load_state_dict(unflatten_optimizer_state(tensors, meta))


# ----------------------------------------------------------------------------------------
# Manager
# ----------------------------------------------------------------------------------------


def find_checkpoint(output_dir: Path, resume: str) -> Path | None:
    """Resolve ``--resume``: ``latest`` (must exist), ``auto`` (latest or None), or a path."""
    ckpt_root = output_dir / "checkpoints"
    if resume in ("latest", "auto"):
        pointer = ckpt_root / LATEST
        if pointer.is_file():
            path = ckpt_root / pointer.read_text().strip()
            if (path / MANIFEST).is_file():
                return path
        if resume == "auto":
            return None
        raise UserError(
            f"--resume latest: no complete checkpoint under {ckpt_root}",
            where="--resume",
            hint="start without --resume, or pass a checkpoint directory",
        )
    path = Path(resume)
    if path.is_dir() and (path / "checkpoints" / LATEST).is_file():  # an output dir
        return find_checkpoint(path, "latest")
    if not path.is_dir():
        raise UserError(f"checkpoint {resume!r} does not exist", where="--resume", hint="pass a checkpoint directory, `latest` or `auto`")
    if not (path / MANIFEST).is_file():
        raise UserError(
            f"{resume!r} is not a complete checkpoint (no {MANIFEST})",
            where="--resume",
            hint="a save interrupted before its manifest is never resumed from; pick an earlier checkpoint",
        )
    return path


class CheckpointManager:
    """Saves and restores checkpoints for one run, atomically."""

    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: Path,
        fmt: CheckpointFormat,
        keep_last: int | None,
        manifest_extra: dict[str, Any],
        data_signature: dict[str, Any],
    ) -> None:
        self.accelerator = accelerator
        self.root = output_dir / "checkpoints"
        self.fmt = fmt
        self.keep_last = keep_last
        self.manifest_extra = manifest_extra
        #: what decides which batch comes next: a resume must not change any of it
        self.data_signature = data_signature
        if accelerator.is_main_process and self.root.is_dir():
            for stale in self.root.glob(f"{STAGING_PREFIX}*"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)

    def save(self, model: Any, optimizer: Any, scheduler: Any, state: TrainerState) -> Path:
        from safetensors.torch import save_file

        acc = self.accelerator
        name = step_dir_name(state.step)
        staging = self.root / f"{STAGING_PREFIX}{name}"
        final = self.root / name
        if acc.is_main_process:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        acc.wait_for_everyone()
        staging.mkdir(parents=True, exist_ok=True)  # machines without a shared filesystem
        self.fmt.save(acc, model, optimizer, staging)
        rank = acc.process_index
        rng_json, rng_tensors = capture_rng()
        _write_json(staging / f"rng-rank{rank:05d}.json", rng_json)
        save_file(rng_tensors, str(staging / f"rng-rank{rank:05d}.safetensors"))
        if acc.is_main_process:
            extra = {"scheduler": scheduler.state_dict()}
            if getattr(acc, "scaler", None) is not None:  # fp16 loss scale
                extra["grad_scaler"] = acc.scaler.state_dict()
            _write_json(staging / "trainer_state.json", {**state.to_json(), **extra})
        acc.wait_for_everyone()
        if acc.is_main_process:
            files = {
                str(p.relative_to(staging)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(staging.rglob("*"))
                if p.is_file()
            }
            manifest = {
                "format": self.fmt.name,
                "step": state.step,
                "epoch": state.epoch,
                "batches_in_epoch": state.batches_in_epoch,
                "world_size": acc.num_processes,
                **self.manifest_extra,
                "data": self.data_signature,
                "files": files,
            }
            _write_json(staging / MANIFEST, manifest)
            replaced = None
            if final.exists():  # a re-save of the same step (a resumed run): set the old one aside first
                replaced = self.root / f"{STAGING_PREFIX}replaced-{name}"
                os.replace(final, replaced)
            os.replace(staging, final)
            pointer_tmp = self.root / f"{LATEST}.tmp"
            pointer_tmp.write_text(name + "\n")
            os.replace(pointer_tmp, self.root / LATEST)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            self._retain(state.step)
        acc.wait_for_everyone()
        return final

    def _retain(self, step: int) -> None:
        """Delete checkpoints beyond ``keep_last``, and those ahead of ``step``: they belong to
        the timeline a resume from an earlier checkpoint abandoned."""
        complete = sorted(p for p in self.root.glob("step-*") if (p / MANIFEST).is_file())
        ahead = [p for p in complete if int(p.name.removeprefix("step-")) > step]
        current = [p for p in complete if p not in ahead]
        old = current[: -self.keep_last] if self.keep_last is not None else []
        for path in ahead + old:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: Path, model: Any, optimizer: Any, scheduler: Any) -> TrainerState:
        from safetensors.torch import load_file

        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("format") != self.fmt.name:
            raise UserError(
                f"checkpoint was written in format {manifest.get('format')!r}, this strategy reads {self.fmt.name!r}",
                where=str(path),
                hint="resume under the strategy that wrote it",
            )
        acc = self.accelerator
        written = manifest.get("data", {})
        changed = [f"{k}: checkpoint {written.get(k)!r}, this run {v!r}" for k, v in self.data_signature.items() if written.get(k) != v]
        if changed:
            raise UserError(
                "this run would not continue the checkpoint's data order:\n  " + "\n  ".join(changed),
                where=f"--resume {path}",
                hint="resume with the settings the checkpoint was written with (its run's config.yaml)",
            )
        self.fmt.load(acc, model, optimizer, path)
        raw = json.loads((path / "trainer_state.json").read_text())
        scheduler.load_state_dict(raw.pop("scheduler"))
        scaler_state = raw.pop("grad_scaler", None)
        if scaler_state is not None and getattr(acc, "scaler", None) is not None:
            acc.scaler.load_state_dict(scaler_state)
        state = TrainerState(**raw)
        rank = acc.process_index
        restore_rng(
            json.loads((path / f"rng-rank{rank:05d}.json").read_text()),
            load_file(str(path / f"rng-rank{rank:05d}.safetensors")),
        )
        return state
