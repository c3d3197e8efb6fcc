"""The trackers ``training.report_to`` can name, registered by plugins through
``acc_train_register_trackers``: Accelerate's nine (registered by core's own plugin) and any
``accelerate.tracking.GeneralTracker`` subclass a plugin brings.

A tracker is Accelerate's ``GeneralTracker``, nothing else: acc-train makes it as Accelerate
makes its own (``Tracker(project, logging_dir, **init_kwargs)`` when it
``requires_logging_directory``, else ``Tracker(project, **init_kwargs)``), starts it, and every
row of ``metrics.jsonl`` reaches its ``log`` and the job's config its
``store_init_configuration``. What a :class:`TrackerKind` adds is how a later launch of the
same run logs to the same tracker run (:meth:`TrackerKind.continue_run`,
:meth:`TrackerKind.identify`), which W&B, MLflow and TensorBoard do here. Nothing here imports a
tracker library, or Accelerate, at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TrackerKind", "ACCELERATE_TRACKERS", "TRACKER_MODULES", "builtin_tracker_kinds", "new_wandb_id"]


def new_wandb_id() -> str:
    """A W&B run id as W&B makes them: 8 characters of lowercase letters and digits."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


@dataclass(frozen=True)
class TrackerKind:
    """A tracker ``training.report_to`` can name.

    ``tracker``: the ``GeneralTracker`` subclass, or ``"module:Class"`` (imported only when a
    run starts it, so registering costs no import); None for one of Accelerate's own, which
    Accelerate makes by ``name``. ``requires``: modules any one of which must import for it to
    run (the first is what ``pip install`` names). ``owned_keys``: ``init_kwargs`` acc-train
    passes itself, each with the setting that says it instead.
    """

    name: str
    tracker: type | str | None = None
    requires: tuple[str, ...] = ()
    owned_keys: Mapping[str, str] = field(default_factory=dict)

    @property
    def accelerate_builtin(self) -> bool:
        return self.tracker is None

    def installed(self) -> bool:
        return not self.requires or any(importlib.util.find_spec(m) for m in self.requires)

    def tracker_class(self) -> type:
        if isinstance(self.tracker, str):
            module, _, attr = self.tracker.partition(":")
            return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]
        if self.tracker is None:
            from accelerate.tracking import LOGGER_TYPE_TO_CLASS

            return LOGGER_TYPE_TO_CLASS[self.name]  # type: ignore[no-any-return]
        return self.tracker

    def make(self, project: str, logging_dir: str | Path, init_kwargs: dict[str, Any]) -> Any:
        """The run's tracker, made as Accelerate makes its own (not started)."""
        cls = self.tracker_class()
        if getattr(cls, "requires_logging_directory", False):
            return cls(project, str(logging_dir), **init_kwargs)
        return cls(project, **init_kwargs)

    def continue_run(self, kwargs: dict[str, Any], previous: dict[str, Any] | None, run_name: str, output_dir: Path, resumed_step: int) -> None:
        """Fill this launch's ``init_kwargs`` for the tracker (``kwargs``, the user's own already
        in it, which win): the run's name, and what makes it log to the tracker run an earlier
        launch recorded (``previous``: what :meth:`identify` returned then; None when none was)."""

    def identify(self, tracker: Any, output_dir: Path) -> dict[str, Any]:
        """What identifies the started ``tracker``'s run, kept in ``logs/trackers.json`` and
        ``run.json`` (JSON values) and handed back to :meth:`continue_run` by the next launch."""
        return {}


class _Wandb(TrackerKind):
    """W&B: ``id`` generated once and reused (``resume="allow"``), the run's files with the run."""

    def continue_run(self, kwargs: dict[str, Any], previous: dict[str, Any] | None, run_name: str, output_dir: Path, resumed_step: int) -> None:
        kwargs.setdefault("id", (previous or {}).get("id") or new_wandb_id())
        kwargs.setdefault("resume", "allow")
        kwargs["name"] = run_name
        if "dir" not in kwargs and not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = str(output_dir / "logs")  # (acc_train.outputs.trackers.TRACKERS_FILE's folder)

    def identify(self, tracker: Any, output_dir: Path) -> dict[str, Any]:
        return {"id": tracker.run.id}


class _Mlflow(TrackerKind):
    """MLflow: the run id its store gave, handed back as ``run_id``."""

    def continue_run(self, kwargs: dict[str, Any], previous: dict[str, Any] | None, run_name: str, output_dir: Path, resumed_step: int) -> None:
        kwargs["run_name"] = run_name
        if (previous or {}).get("run_id"):
            kwargs.setdefault("run_id", previous["run_id"])  # type: ignore[index]

    def identify(self, tracker: Any, output_dir: Path) -> dict[str, Any]:
        info = tracker.active_run.info
        return {"run_id": info.run_id, "experiment_id": info.experiment_id}


class _Tensorboard(TrackerKind):
    """TensorBoard: the same folder; a resumed launch hides the steps it redoes (``purge_step``)."""

    def continue_run(self, kwargs: dict[str, Any], previous: dict[str, Any] | None, run_name: str, output_dir: Path, resumed_step: int) -> None:
        if previous is not None:
            kwargs.setdefault("purge_step", resumed_step + 1)

    def identify(self, tracker: Any, output_dir: Path) -> dict[str, Any]:
        return {"logging_dir": os.path.relpath(tracker.logging_dir, output_dir)}


#: Accelerate's trackers and the modules that must import for each
TRACKER_MODULES: dict[str, tuple[str, ...]] = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "comet_ml": ("comet_ml",),
    "aim": ("aim",),
    "clearml": ("clearml",),
    "dvclive": ("dvclive",),
    "swanlab": ("swanlab",),
    "trackio": ("trackio",),
}

#: init_kwargs that Accelerate or acc-train pass to Accelerate's trackers
_OWNED: dict[str, dict[str, str]] = {
    "wandb": {"project": "training.tracker.project", "name": "training.tracker.run_name"},
    "mlflow": {"experiment_name": "training.tracker.project", "run_name": "training.tracker.run_name"},
    "trackio": {"project": "training.tracker.project"},
    "swanlab": {"project": "training.tracker.project"},
}

ACCELERATE_TRACKERS: tuple[str, ...] = tuple(TRACKER_MODULES)


def builtin_tracker_kinds() -> list[TrackerKind]:
    """Accelerate's trackers, as core's own plugin registers them."""
    special = {"wandb": _Wandb, "mlflow": _Mlflow, "tensorboard": _Tensorboard}
    return [special.get(name, TrackerKind)(name, None, modules, _OWNED.get(name, {})) for name, modules in TRACKER_MODULES.items()]
