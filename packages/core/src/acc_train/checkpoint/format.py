"""The checkpoint format contract (how model and optimizer state go to disk), and core's own
``dcp`` format, which is the portable state itself."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from acc_train.checkpoint.portable import (
    load_portable_into,
    read_portable_full,
    state_dict_options,
    torch_optimizer,
    write_portable_state,
)
from acc_train.errors import UserError

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

__all__ = ["CheckpointFormat", "DCPFormat", "read_portable_state_or_refuse"]


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

    #: Whether a checkpoint made of the portable state alone (no files of the format's own) is
    #: one this format's ``load`` resumes from, under any world size: ``acc-train checkpoint
    #: convert --to NAME`` writes such checkpoints for the formats that say so.
    convert_target: ClassVar[bool] = False

    #: The per-parameter optimizer state (``state_dict`` names) ``save`` writes and ``load``
    #: restores; None: whatever the torch optimizer holds. An optimizer keeping other state is
    #: refused before launch under this format (``OptimizerKind.state_keys``).
    optimizer_state_keys: ClassVar[tuple[str, ...] | None] = None

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

    def read_full_state(self, directory: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The whole model and optimizer state of a checkpoint this format wrote, in this
        process alone (no process group), keyed as the portable state is (``model.<fqn>``,
        ``optim.state.<fqn>.<name>``): what ``checkpoint convert`` and ``export`` read.
        The default reads the portable state; a format that writes none but keeps its state by
        parameter name in files of its own overrides this."""
        return read_portable_state_or_refuse(directory, manifest)

    def all_names(self) -> list[str]:
        return [self.name]


class DCPFormat(CheckpointFormat):
    """Model and optimizer state through torch's state-dict API and torch.distributed.checkpoint,
    stored as safetensors: each rank writes what it holds (a replica is written once, FSDP
    shards by every rank), and a load reshards to this run's layout. It is the portable state
    itself, so it resumes from any format that writes one."""

    name = "dcp"
    description = "torch.distributed.checkpoint, safetensors shards keyed by parameter name; reshards on load"
    writes_portable = True
    convert_target = True
    supports_async = True

    def save(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, torch_optimizer(optimizer), options=state_dict_options())
        write_portable_state(directory, msd, osd["state"])

    def save_async(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path, process_group: Any) -> Any:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, torch_optimizer(optimizer), options=state_dict_options())
        return write_portable_state(directory, msd, osd["state"], process_group=process_group, asynchronous=True)

    def load(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        load_portable_into(model, optimizer, directory)

    def load_portable(self, accelerator: Accelerator, model: Any, optimizer: Any, directory: Path) -> None:
        load_portable_into(model, optimizer, directory)


def read_portable_state_or_refuse(directory: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A checkpoint's portable state, whole; a checkpoint without one is refused with a hint."""
    if manifest.get("portable"):
        return read_portable_full(directory)
    raise UserError(
        f"checkpoint format {manifest.get('format')!r} has no portable state to convert",
        where=str(directory),
        hint="resume it under the strategy that wrote it, and save again with this version of acc-train",
    )
