"""One run's checkpoints: saved atomically (staging directory, manifest last, then renamed),
retained, checked and restored.

Layout::

    checkpoints/
      latest                 text file naming the latest complete checkpoint directory
      step-000010/
        state/               } written by the strategy's checkpoint format; ``state/`` is the
        ...                  } portable state where the format writes one
        trainer_state.json   step, epoch, data position, scheduler state
        rng-rank00000.json   python/numpy RNG; torch RNG states in rng-rank00000.safetensors
        strategy-rank00000.json  the strategy's own state, if any (tensors in strategy-rank00000.safetensors)
        manifest.json        written last: a directory without it is never resumed from

All ranks write into ``.staging-step-NNNNNN``, and each hashes its share of the files (those
named by its rank right after its own writes, while they are in the page cache; an even share of
the rest once every rank is done); rank 0 merges the ranks' tables into the manifest, renames the
directory into place and only then moves ``latest``. On resume each rank hashes its share again,
and every rank refuses if any rank found a problem.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.model.adapters import check_adapters_match
from acc_train.checkpoint.faults import fault_point
from acc_train.checkpoint.format import CheckpointFormat
from acc_train.checkpoint.hashing import (
    MANIFEST,
    EarlyHashes,
    StreamHashes,
    assign_files,
    from_every_rank,
    from_rank0,
    hash_files,
    hash_rank_files,
    list_files,
    merge_tables,
    unchanged,
)
from acc_train.checkpoint.layout import (
    LATEST,
    STAGING_PREFIX,
    complete_steps,
    step_dir_name,
)
from acc_train.checkpoint.manifest import (
    check_same_model,
    find_problems,
    raise_problems,
    read_manifest,
    write_json,
)
from acc_train.checkpoint.portable import PORTABLE_DIR
from acc_train.checkpoint.rng import capture_rng, restore_rng
from acc_train.checkpoint.strategy_state import hand_back, write_strategy_state
from acc_train.files.disk_full import raise_if_disk_full
from acc_train.errors import UserError
from acc_train.files.output_paths import readable, replace_file

if TYPE_CHECKING:
    from accelerate import Accelerator

    from acc_train.contracts.protocols import RunView

__all__ = ["TrainerState", "CheckpointManager", "check_async_save"]


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
    #: data.streaming: each rank's position in its stream, by rank (``StreamRows.state_dict``)
    stream: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_async_save(fmt: CheckpointFormat) -> None:
    """Refuse ``checkpoint.async_save`` for a format that saves synchronously only."""
    if not fmt.supports_async:
        raise UserError(
            f"checkpoint format {fmt.name!r} (this strategy's) saves synchronously only",
            where="checkpoint.async_save",
            hint="drop checkpoint.async_save, or use a strategy whose checkpoint format saves asynchronously (core's 'dcp' does)",
        )


class CheckpointManager:
    """Saves and restores checkpoints for one run, atomically."""

    def __init__(
        self,
        accelerator: Accelerator,
        output_dir: Path,
        fmt: CheckpointFormat,
        keep_last: int | None,
        manifest_extra: dict[str, Any],  # strategy, options, model, library versions
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
        #: per asynchronous save: seconds its writes ran on after the format handed control back
        #: to the loop, until they were done or the loop waited for them (measured, not assumed)
        self.overlap_s: list[float] = []
        self._handed_back = 0.0
        self._writes_done: list[float] = []  # when the pending asynchronous save's writes finished
        #: how :meth:`load` restored: "native" (the format's own files) or "portable" (another format's portable state)
        self.loaded_via: str | None = None
        self._pending: tuple[Any, TrainerState, Path, StreamHashes] | None = None
        self._group: Any = None
        self._run: RunView | None = None  # whose strategy's own state each save writes (attach)
        self._resumed: tuple[Path, int] | None = None  # the checkpoint load() restored, and its world size

    def attach(self, run: RunView) -> None:
        """Bind the run before ``acc_train_train_start``: its strategy's own state comes back now, and each save writes it."""
        self._run = run
        hand_back(run, self._resumed)

    def discard_unfinished_saves(self) -> None:
        """Remove the staging directories of saves that were killed (main process). Called once
        the run has passed every check: a refused run changes nothing under its output dir."""
        if self.accelerator.is_main_process and self.root.is_dir():
            for stale in self.root.glob(f"{STAGING_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)

    def save(self, model: Any, optimizer: Any, scheduler: Any, state: TrainerState) -> None:
        """Write a checkpoint of ``state``. A synchronous save is committed on return; an
        asynchronous one when its writes are done, at the next save or at :meth:`finish`.
        ``on_commit`` is called either way. A full disk removes the partial checkpoint and
        raises :class:`~acc_train.files.disk_full.DiskFullError`; the previous checkpoints stay."""
        import time

        started = time.perf_counter()  # waiting for a previous asynchronous save counts as blocked
        self.finish()  # a previous asynchronous save is committed before the next begins
        staging = self.root / f"{STAGING_PREFIX}{step_dir_name(state.step)}"
        try:
            self._save(model, optimizer, scheduler, state, staging, started)
        except BaseException as exc:
            raise_if_disk_full(exc, staging, state.step, lambda: [p.name for _, p in complete_steps(self.root)])
            raise

    def _save(self, model: Any, optimizer: Any, scheduler: Any, state: TrainerState, staging: Path, started: float) -> None:
        import copy
        import time

        from safetensors.torch import save_file

        acc = self.accelerator
        if acc.is_main_process:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        acc.wait_for_everyone()
        staging.mkdir(parents=True, exist_ok=True)  # machines without a shared filesystem
        fault_point("save-start", state.step)
        future = None
        with StreamHashes.recording(staging) as streamed:  # the portable state is hashed as it is written
            if self.async_save:
                future = self.fmt.save_async(acc, model, optimizer, staging, self._async_group())
                self._handed_back, self._writes_done = time.perf_counter(), []
                if hasattr(future, "add_done_callback"):
                    future.add_done_callback(lambda _f, done=self._writes_done: done.append(time.perf_counter()))
            else:
                self.fmt.save(acc, model, optimizer, staging)
                fault_point("save-state-written", state.step)
        rank = acc.process_index
        rng_json, rng_tensors = capture_rng()
        write_json(staging / f"rng-rank{rank:05d}.json", rng_json)
        save_file(rng_tensors, str(staging / f"rng-rank{rank:05d}.safetensors"))
        if self._run is not None:  # taken now, with the step's RNG: an asynchronous save's state is this step's too
            write_strategy_state(staging, self._run)
        if acc.is_main_process:
            extra = {"scheduler": scheduler.state_dict()}
            if getattr(acc, "scaler", None) is not None:  # fp16 loss scale
                extra["grad_scaler"] = acc.scaler.state_dict()
            write_json(staging / "trainer_state.json", {**state.to_json(), **extra})
            if self.model_config is not None:
                write_json(staging / "model_config.json", self.model_config)
        self.blocked_s.append(time.perf_counter() - started)
        if future is not None:  # the background writer's files are taken once it is done
            self._pending = (future, copy.copy(state), staging, streamed)
            return
        self._commit(staging, state, {**streamed.entries, **hash_rank_files(staging, acc.process_index, skip=streamed.entries)})

    def finish(self) -> float:
        """Wait for an asynchronous save still being written, and commit it. Returns the
        seconds spent waiting for its writes."""
        if self._pending is None:
            return 0.0
        import time

        future, state, staging, streamed = self._pending
        self._pending = None
        try:
            return self._finish(future, state, staging, streamed)
        except BaseException as exc:
            raise_if_disk_full(exc, staging, state.step, lambda: [p.name for _, p in complete_steps(self.root)])
            raise

    def _finish(self, future: Any, state: TrainerState, staging: Path, streamed: StreamHashes) -> float:
        import time

        started = time.perf_counter()
        still_writing = hasattr(future, "done") and not future.done()
        future.result()
        if self._writes_done:  # when the writes ended, from the future's callback
            ended = min(self._writes_done[0], started)
        else:  # no callback (yet): they overlapped up to here, or, unknown, not at all
            ended = started if still_writing else self._handed_back
        self.overlap_s.append(max(0.0, ended - self._handed_back))
        waited = time.perf_counter() - started
        fault_point("save-state-written", state.step)
        self._commit(staging, state, streamed.entries)
        return waited

    def _async_group(self) -> Any:
        """A process group of its own for the background writer's collectives, so they never
        interleave with the training loop's on the default group."""
        import torch.distributed as dist

        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _commit(self, staging: Path, state: TrainerState, early: EarlyHashes) -> None:
        acc = self.accelerator
        name = step_dir_name(state.step)
        final = self.root / name
        readable(staging)  # this rank's files as the umask says (safetensors writes 0600)
        acc.wait_for_everyone()  # every rank's files are written: rank 0's listing is the checkpoint's
        listing = from_rank0(list_files(staging) if acc.is_main_process else None)
        mine = unchanged(staging, early, listing)  # hashed while or right after this rank wrote them
        held = {name for names in from_every_rank(sorted(mine)) for name in names}
        rest = {name: size for name, size in listing.items() if name not in held}
        tables = from_every_rank({**mine, **hash_files(staging, assign_files(rest, acc.num_processes)[acc.process_index])})
        if acc.is_main_process:
            files = merge_tables(tables, listing)
            manifest = {
                "format": self.fmt.name,
                "portable": PORTABLE_DIR if self.fmt.writes_portable else None,
                "step": state.step,
                "epoch": state.epoch,
                "samples_in_epoch": state.samples_in_epoch,
                "world_size": acc.num_processes,
                **self.manifest_extra,
                "data": self.data_signature,
                "files": files,
            }
            fault_point("save-before-manifest", state.step)
            write_json(staging / MANIFEST, manifest)
            fault_point("save-before-rename", state.step)
            replaced = None
            if final.exists():  # a re-save of the same step (a resumed run): set the old one aside first
                replaced = self.root / f"{STAGING_PREFIX}replaced-{name}"
                os.replace(final, replaced)
            os.replace(staging, final)
            fault_point("save-before-pointer", state.step)
            replace_file(self.root / LATEST, (name + "\n").encode())
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            self._retain(state.step)
        acc.wait_for_everyone()
        if self.on_commit is not None:
            self.on_commit(state.step, final)

    def _retain(self, step: int) -> None:
        """Delete checkpoints beyond ``keep_last``, and those ahead of ``step``: they belong to
        the timeline a resume from an earlier checkpoint abandoned."""
        complete = complete_steps(self.root)
        ahead = [p for s, p in complete if s > step]
        current = [p for s, p in complete if s <= step]
        old = current[: -self.keep_last] if self.keep_last is not None else []
        for path in ahead + old:
            shutil.rmtree(path, ignore_errors=True)

    def check(self, path: Path, model: Any) -> dict[str, Any]:
        """Everything that can refuse a resume, before anything is loaded: files against the
        manifest, the model, the data order, the format. Returns the manifest. Collective:
        every rank checks sizes and hashes its share of the files, and every rank refuses
        if any found a problem."""
        acc = self.accelerator
        manifest = read_manifest(path)
        sizes = {name: entry["size"] for name, entry in manifest["files"].items()}
        share = set(assign_files(sizes, acc.num_processes)[acc.process_index])
        problems = from_every_rank(find_problems(path, manifest, hashes=share))
        raise_problems(path, list(dict.fromkeys(p for found in problems for p in found)))
        if isinstance(self.manifest_extra.get("model"), dict):
            check_same_model(manifest, self.manifest_extra["model"], path)
        check_adapters_match(manifest.get("adapters"), self.manifest_extra.get("adapters"), f"--resume {path}")
        written = dict(manifest.get("data") or {})
        if "train_digest" in self.data_signature and "train_digest" not in written:  # written before digests
            if acc.is_main_process:
                sys.stderr.write(
                    f"warning: checkpoint {path} was written before acc-train recorded a digest of the training data, so this "
                    "resume cannot check that the data files hold the same tokens (only their counts)\n"
                )
            written["train_digest"] = self.data_signature["train_digest"]
            written.pop("train_files", None)
        elif "train_digest" in written:
            written.pop("train_files", None)  # the content decides, not where the files are
        changed = [
            f"train_digest: the training data holds other tokens than the checkpoint's run trained on (digest {written.get(k)!r}, now {v!r})"
            if k == "train_digest"
            else f"{k}: checkpoint {written.get(k)!r}, this run {v!r}"
            for k, v in self.data_signature.items()
            if written.get(k) != v
        ]
        if changed:
            raise UserError(
                "this run would not continue the checkpoint's data order:\n  " + "\n  ".join(changed),
                where=f"--resume {path}",
                hint="keep the global batch (processes x micro-batch x accumulation), seed, data and sequence length of the run that wrote it",
            )
        wrote, runs = manifest.get("optimizer"), self.manifest_extra.get("optimizer")
        if wrote is not None and runs is not None and wrote != runs:  # checkpoints before optimizer names had adamw's state
            raise UserError(f"checkpoint was written with optimizer {wrote!r}, whose state is not {runs!r}'s", where=f"--resume {path}", hint=f"resume with optimizer.name: {wrote}")
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
            self.loaded_via = "native"
        elif manifest.get("portable"):  # another strategy or world size: through the portable state
            self.fmt.load_portable(acc, model, optimizer, path)
            self.loaded_via = "portable"
        else:
            self.fmt.load(acc, model, optimizer, path)  # a format that reshards itself, or says why not
            self.loaded_via = "native"
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
        self._resumed = (path, manifest.get("world_size", acc.num_processes))  # the strategy's own state: attach(run)
        rng_json = path / f"rng-rank{rank:05d}.json"
        if rank < manifest.get("world_size", acc.num_processes) and rng_json.is_file():
            restore_rng(json.loads(rng_json.read_text()), load_file(str(path / f"rng-rank{rank:05d}.safetensors")))
        else:  # a rank the writer did not have: a fresh stream, fixed by seed, step and rank
            from accelerate.utils import set_seed

            set_seed(self.seed + 1_000_003 * state.step + rank)
        return state
