"""Checkpoints: atomic, pickle-free, with a manifest written last.

Layout::

    checkpoints/
      latest                 text file naming the latest complete checkpoint directory
      step-000010/
        state/               } written by the strategy's checkpoint format; ``state/`` is the
        ...                  } portable state (see below) where the format writes one
        trainer_state.json   step, epoch, data position, scheduler state
        rng-rank00000.json   python/numpy RNG; torch RNG states in rng-rank00000.safetensors
        manifest.json        written last: a directory without it is never resumed from

All ranks write into ``.staging-step-NNNNNN``; once every rank is done, rank 0 writes the
manifest, renames the directory into place and only then moves ``latest``.

Portable state: model weights and optimizer state keyed by parameter name (torch's
``get_state_dict`` convention: ``model.<fqn>``, ``optim.state.<fqn>.exp_avg``...), written
through torch.distributed.checkpoint with its safetensors storage. Every shard is a
safetensors file whose header says where it sits in the whole tensor, so DCP reshards it on
load: a checkpoint written under one strategy and world size is read under another, and
nothing in it needs pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from acc_train.errors import UserError

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

__all__ = [
    "CheckpointFormat",
    "DCPFormat",
    "write_portable_state",
    "read_portable_state",
    "read_portable_full",
    "load_portable_into",
    "verify_checkpoint",
    "check_same_model",
    "model_fingerprint",
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
#: the portable state's directory inside a checkpoint
PORTABLE_DIR = "state"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass
class TrainerState:
    """What the loop needs, beyond model and optimizer, to continue exactly."""

    step: int = 0
    epoch: int = 0
    #: Micro-batches each rank has consumed in ``epoch``.
    batches_in_epoch: int = 0
    #: Samples all ranks together have consumed in ``epoch``: the data position a run under
    #: another world size or micro-batch size continues from.
    samples_in_epoch: int = 0
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
        """Restore model and optimizer state from ``directory``, written by this format."""

    #: Whether ``save`` also writes the portable state (``state/``), which any format that
    #: implements :meth:`load_portable` can resume from.
    writes_portable: ClassVar[bool] = False

    #: Whether :meth:`save_async` is implemented.
    supports_async: ClassVar[bool] = False

    def save_async(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path, process_group: Any) -> Any:
        """Like ``save``, but return once the state is copied aside, with a future that
        completes when it is written (collectives on ``process_group``, not the training one)."""
        raise NotImplementedError

    def load_portable(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        """Restore from the portable state of a checkpoint another format (strategy, world
        size) wrote. Formats that cannot say so."""
        raise UserError(
            f"checkpoint format {self.name!r} cannot resume from another format's checkpoint",
            where=str(directory),
            hint="resume under the strategy that wrote it",
        )

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
# Portable state: torch.distributed.checkpoint over safetensors
# ----------------------------------------------------------------------------------------


def torch_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the torch one


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
    state = {"model": model_state, "optim": {"state": optim_state}}
    with warnings.catch_warnings():  # one process: DCP says it assumes one process, which is right
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if asynchronous:
            return dcp.async_save(state, storage_writer=writer, process_group=process_group)
        dcp.save(state, storage_writer=writer, process_group=process_group)
    return None


def read_portable_state(directory: Path, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
    """Fill the given name-keyed tensors (this run's layout: full, DTensor shards...) in place
    from a checkpoint's portable state, resharding as needed. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory / PORTABLE_DIR))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": model_state, "optim": {"state": optim_state}}, storage_reader=reader)
    except Exception as exc:  # DCP raises CheckpointException with each rank's failure
        raise UserError(
            f"the checkpoint's state does not fit this model: {str(exc).splitlines()[0][:300]}",
            where=str(directory / PORTABLE_DIR),
            hint="resume with the model (and model config) that wrote the checkpoint",
        ) from None


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


class DCPFormat(CheckpointFormat):
    """Model and optimizer state through torch's state-dict API and torch.distributed.checkpoint,
    stored as safetensors: each rank writes what it holds (a replica is written once, FSDP
    shards by every rank), and a load reshards to this run's layout. It is the portable state
    itself, so it resumes from any format that writes one."""

    name = "dcp"
    description = "torch.distributed.checkpoint, safetensors shards keyed by parameter name; reshards on load"
    writes_portable = True

    def save(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, torch_optimizer(optimizer))
        write_portable_state(directory, msd, osd["state"])

    supports_async = True

    def save_async(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path, process_group: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, torch_optimizer(optimizer))
        return write_portable_state(directory, msd, osd["state"], process_group=process_group, asynchronous=True)

    def load(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        load_portable_into(model, optimizer, directory)

    def load_portable(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        load_portable_into(model, optimizer, directory)


def load_portable_into(model: Any, optimizer: Any, directory: Path) -> None:
    """Restore a module torch's state-dict API understands (plain, DDP, FSDP1, FSDP2) and its
    optimizer from a portable state, resharded to this run's layout. Collective."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    optim = torch_optimizer(optimizer)
    msd, osd = get_state_dict(model, optim)  # this run's layout; initialises the optimizer state
    read_portable_state(directory, msd, osd["state"])
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)


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
    if path.name.startswith(STAGING_PREFIX):
        raise UserError(
            f"{resume!r} is the staging directory of a save that did not finish",
            where="--resume",
            hint="resume from a committed checkpoint (checkpoints/step-NNNNNN, or `latest`)",
        )
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


def verify_checkpoint(path: Path, hashes: bool = True) -> dict[str, Any]:
    """Read ``path``'s manifest and check every file against it (size, and sha256 where
    ``hashes``), and that no file was added. Returns the manifest; raises :class:`UserError`
    naming what is wrong. Nothing is loaded before this passes, so a planted or edited file is
    never read. (Workers other than each machine's first check sizes only: one full read of a
    large checkpoint per machine is enough.)"""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise UserError(f"{str(path)!r} is not a directory", where=str(path), hint="pass a checkpoint directory (checkpoints/step-NNNNNN)")
    if not manifest_path.is_file():
        hint = "a save interrupted before its manifest is never resumed from; pick an earlier checkpoint"
        if not any(path.glob("rng-rank*.json")) and not (path / "trainer_state.json").exists():
            hint = "pass a checkpoint directory (OUTPUT_DIR/checkpoints/step-NNNNNN) or an output directory"
        raise UserError(f"{str(path)!r} is not a complete checkpoint (no {MANIFEST})", where=str(path), hint=hint)
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{MANIFEST} is not a valid manifest ({exc})", where=str(manifest_path)) from None
    problems = []
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            problems.append(f"{name}: missing")
        elif f.stat().st_size != want["size"]:
            problems.append(f"{name}: {f.stat().st_size} bytes, the manifest says {want['size']}")
        elif hashes and _sha256(f) != want["sha256"]:
            problems.append(f"{name}: content differs from the manifest (sha256)")
    extra = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != MANIFEST and str(p.relative_to(path)) not in files)
    problems += [f"{name}: not in the manifest" for name in extra]
    if problems:
        shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise UserError(
            "checkpoint files do not match its manifest:\n  " + "\n  ".join(shown),
            where=str(path),
            hint="the checkpoint was changed or damaged after it was written; resume from another one",
        )
    return manifest


def model_fingerprint(config: Any) -> dict[str, Any]:
    """What identifies a model's architecture in a manifest: its type and a hash of its
    transformers config (less the fields that name where it came from)."""
    data = json.loads(config.to_json_string(use_diff=False))
    for key in ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures"):
        data.pop(key, None)
    canonical = json.dumps(data, sort_keys=True)
    return {"model_type": data.get("model_type"), "config_sha256": hashlib.sha256(canonical.encode()).hexdigest()}


def check_same_model(manifest: dict[str, Any], fingerprint: dict[str, Any], path: Path) -> None:
    theirs = manifest.get("model")
    if isinstance(theirs, dict) and theirs != fingerprint:
        raise UserError(
            f"the checkpoint holds a different model ({theirs.get('model_type')}, config {str(theirs.get('config_sha256'))[:12]}) "
            f"than this run ({fingerprint.get('model_type')}, config {str(fingerprint.get('config_sha256'))[:12]})",
            where=f"--resume {path}",
            hint="resume with the model and model config that wrote the checkpoint (its run's config.yaml)",
        )


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("acc-train-core", "torch", "accelerate", "transformers", "deepspeed"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def check_async_save(fmt: CheckpointFormat) -> None:
    if not fmt.supports_async:
        raise UserError(
            f"checkpoint format {fmt.name!r} (this strategy's) saves synchronously only",
            where="checkpoint.async_save",
            hint="drop checkpoint.async_save, or use a strategy whose checkpoints are 'dcp' (ddp; fsdp with state_dict_type: sharded)",
        )


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
        seed: int = 0,
        model_config: dict[str, Any] | None = None,
        async_save: bool = False,
        on_commit: Callable[[int, Path], None] | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.root = output_dir / "checkpoints"
        self.fmt = fmt
        self.keep_last = keep_last
        self.manifest_extra = manifest_extra
        #: what decides which batch comes next: a resume must not change any of it
        self.data_signature = data_signature
        self.seed = seed
        #: written as model_config.json, so ``checkpoint export`` can rebuild the model
        self.model_config = model_config
        if async_save:
            check_async_save(fmt)
        self.async_save = async_save
        #: called on every rank once a checkpoint is committed: (step, path)
        self.on_commit = on_commit
        #: seconds the training loop was blocked by each save
        self.blocked_s: list[float] = []
        self._pending: tuple[Any, TrainerState, Path] | None = None
        self._group: Any = None
        if accelerator.is_main_process and self.root.is_dir():
            for stale in self.root.glob(f"{STAGING_PREFIX}*"):  # left by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)

    def save(self, model: Any, optimizer: Any, scheduler: Any, state: TrainerState) -> None:
        """Write a checkpoint of ``state``. A synchronous save is committed on return; an
        asynchronous one when its writes are done, at the next save or at :meth:`finish`.
        ``on_commit`` is called either way."""
        import copy
        import time

        from safetensors.torch import save_file

        started = time.perf_counter()  # waiting for a previous asynchronous save counts as blocked
        self.finish()  # a previous asynchronous save is committed before the next begins
        acc = self.accelerator
        staging = self.root / f"{STAGING_PREFIX}{step_dir_name(state.step)}"
        if acc.is_main_process:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        acc.wait_for_everyone()
        staging.mkdir(parents=True, exist_ok=True)  # machines without a shared filesystem
        fault_point("save-start", state.step)
        future = None
        if self.async_save:
            future = self.fmt.save_async(acc, model, optimizer, staging, self._async_group())
        else:
            self.fmt.save(acc, model, optimizer, staging)
            fault_point("save-state-written", state.step)
        rank = acc.process_index
        rng_json, rng_tensors = capture_rng()
        _write_json(staging / f"rng-rank{rank:05d}.json", rng_json)
        save_file(rng_tensors, str(staging / f"rng-rank{rank:05d}.safetensors"))
        if acc.is_main_process:
            extra = {"scheduler": scheduler.state_dict()}
            if getattr(acc, "scaler", None) is not None:  # fp16 loss scale
                extra["grad_scaler"] = acc.scaler.state_dict()
            _write_json(staging / "trainer_state.json", {**state.to_json(), **extra})
            if self.model_config is not None:
                _write_json(staging / "model_config.json", self.model_config)
        self.blocked_s.append(time.perf_counter() - started)
        if future is not None:
            self._pending = (future, copy.copy(state), staging)
            return
        self._commit(staging, state)

    def finish(self) -> float:
        """Wait for an asynchronous save still being written, and commit it. Returns the
        seconds spent waiting for its writes."""
        if self._pending is None:
            return 0.0
        import time

        future, state, staging = self._pending
        self._pending = None
        started = time.perf_counter()
        future.result()
        waited = time.perf_counter() - started
        fault_point("save-state-written", state.step)
        self._commit(staging, state)
        return waited

    def _async_group(self) -> Any:
        """A process group of its own for the background writer's collectives, so they never
        interleave with the training loop's on the default group."""
        import torch.distributed as dist

        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _commit(self, staging: Path, state: TrainerState) -> None:
        acc = self.accelerator
        name = step_dir_name(state.step)
        final = self.root / name
        acc.wait_for_everyone()
        if acc.is_main_process:
            files = {
                str(p.relative_to(staging)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(staging.rglob("*"))
                if p.is_file()
            }
            manifest = {
                "format": self.fmt.name,
                "portable": PORTABLE_DIR if self.fmt.writes_portable else None,
                "step": state.step,
                "epoch": state.epoch,
                "samples_in_epoch": state.samples_in_epoch,
                "world_size": acc.num_processes,
                **self.manifest_extra,
                "data": self.data_signature,
                "versions": library_versions(),
                "files": files,
            }
            fault_point("save-before-manifest", state.step)
            _write_json(staging / MANIFEST, manifest)
            fault_point("save-before-rename", state.step)
            replaced = None
            if final.exists():  # a re-save of the same step (a resumed run): set the old one aside first
                replaced = self.root / f"{STAGING_PREFIX}replaced-{name}"
                os.replace(final, replaced)
            os.replace(staging, final)
            fault_point("save-before-pointer", state.step)
            pointer_tmp = self.root / f"{LATEST}.tmp"
            pointer_tmp.write_text(name + "\n")
            os.replace(pointer_tmp, self.root / LATEST)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            self._retain(state.step)
        acc.wait_for_everyone()
        if self.on_commit is not None:
            self.on_commit(state.step, final)

    def _retain(self, step: int) -> None:
        """Delete checkpoints beyond ``keep_last``, and those ahead of ``step``: they belong to
        the timeline a resume from an earlier checkpoint abandoned."""
        complete = sorted(p for p in self.root.glob("step-*") if (p / MANIFEST).is_file())
        ahead = [p for p in complete if int(p.name.removeprefix("step-")) > step]
        current = [p for p in complete if p not in ahead]
        old = current[: -self.keep_last] if self.keep_last is not None else []
        for path in ahead + old:
            shutil.rmtree(path, ignore_errors=True)

    def check(self, path: Path, model: Any) -> dict[str, Any]:
        """Everything that can refuse a resume, before anything is loaded: files against the
        manifest, the model, the data order, the format. Returns the manifest."""
        manifest = verify_checkpoint(path, hashes=self.accelerator.is_local_main_process)
        if isinstance(self.manifest_extra.get("model"), dict):
            check_same_model(manifest, self.manifest_extra["model"], path)
        written = manifest.get("data", {})
        changed = [f"{k}: checkpoint {written.get(k)!r}, this run {v!r}" for k, v in self.data_signature.items() if written.get(k) != v]
        if changed:
            raise UserError(
                "this run would not continue the checkpoint's data order:\n  " + "\n  ".join(changed),
                where=f"--resume {path}",
                hint="keep the global batch (processes x micro-batch x accumulation), seed, data and sequence length of the run that wrote it",
            )
        fmt_name = manifest.get("format")
        if fmt_name != self.fmt.name and not manifest.get("portable"):
            raise UserError(
                f"checkpoint was written in format {fmt_name!r}, which has no portable state; this strategy reads {self.fmt.name!r}",
                where=str(path),
                hint="resume under the strategy that wrote it, or convert it: acc-train checkpoint convert PATH --to dcp OUT",
            )
        return manifest

    def load(self, path: Path, model: Any, optimizer: Any, scheduler: Any) -> TrainerState:
        from safetensors.torch import load_file

        manifest = self.check(path, model)
        acc = self.accelerator
        if manifest.get("format") == self.fmt.name and manifest.get("world_size") == acc.num_processes:
            self.fmt.load(acc, model, optimizer, path)
        elif manifest.get("portable"):  # another strategy or world size: through the portable state
            self.fmt.load_portable(acc, model, optimizer, path)
        else:
            self.fmt.load(acc, model, optimizer, path)  # a format that reshards itself, or says why not
        raw = json.loads((path / "trainer_state.json").read_text())
        # the schedule's position comes from the checkpoint; its base rates and shape from this
        # run (another strategy may group the parameters differently, another max_steps
        # stretches the schedule). The optimizer's next step uses its groups' lr: recompute it.
        saved_schedule = {k: v for k, v in raw.pop("scheduler").items() if k not in ("base_lrs", "_last_lr", "lr_lambdas")}
        scheduler.load_state_dict({**scheduler.state_dict(), **saved_schedule})
        scheduler.last_epoch -= 1
        scheduler.step()
        scaler_state = raw.pop("grad_scaler", None)
        if scaler_state is not None and getattr(acc, "scaler", None) is not None:
            acc.scaler.load_state_dict(scaler_state)
        state = TrainerState(**{k: v for k, v in raw.items() if k in TrainerState.__dataclass_fields__})
        rank = acc.process_index
        rng_json = path / f"rng-rank{rank:05d}.json"
        if rank < manifest.get("world_size", acc.num_processes) and rng_json.is_file():
            restore_rng(json.loads(rng_json.read_text()), load_file(str(path / f"rng-rank{rank:05d}.safetensors")))
        else:  # a rank the writer did not have: a fresh stream, fixed by seed, step and rank
            from accelerate.utils import set_seed

            set_seed(self.seed + 1_000_003 * state.step + rank)
        return state


def fault_point(name: str, step: int) -> None:
    """Die here, as a SIGKILL would, when ``ACC_TRAIN_FAULT`` names this point: for tests of
    crash safety. ``ACC_TRAIN_FAULT=save-before-manifest@10:1`` kills rank 1 while it saves
    step 10; ``@STEP`` and ``:RANK`` are optional. A worker the elastic agent restarted runs on."""
    spec = os.environ.get("ACC_TRAIN_FAULT")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    spec, _, rank = spec.partition(":")
    point, _, at = spec.partition("@")
    if point == name and (not at or int(at) == step) and (not rank or os.environ.get("RANK", "0") == rank):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
