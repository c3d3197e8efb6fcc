"""Which tracker run a job logs to, and the run identities that let a later launch continue it.

``training.tracker`` names the project and the run; ``init_kwargs`` adds each tracker's own
arguments. The identities a tracker gives its run (W&B's run id, chosen here; MLflow's run id,
given by its store) are kept in ``logs/trackers.json`` in the output directory, so a launch that
resumes or restarts the run there hands them back and logs to the same tracker run:

- **wandb**: ``id`` (generated once) with ``resume="allow"``: the same run online. Offline,
  W&B ignores ``resume``: each launch writes its own ``offline-run-*-ID`` folder with the same id.
- **mlflow**: ``run_id``: the same run, metrics appended. Its params cannot change, so a resumed
  launch logs only the keys the run lacks.
- **tensorboard**: the same folder (``logs/PROJECT``); a resumed launch sets ``purge_step`` so
  TensorBoard hides the steps it redoes.

The file lives in ``logs/``, one of the run's files: ``--overwrite`` moves it aside with the run
it replaces, so a new run gets new identities. Nothing here imports a tracker library at import
time.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from acc_train.errors import UserError
from acc_train.files.output_paths import replace_file
from acc_train.outputs.tracker_kinds import TRACKER_MODULES, TrackerKind, builtin_tracker_kinds, new_wandb_id

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = [
    "TRACKER_MODULES", "TrackerConfig", "TRACKERS_FILE", "DEFAULT_PROJECT", "OWNED_KEYS", "TrackerPlan", "default_run_name", "new_wandb_id",
    "plan_trackers", "start_trackers", "started_runs", "record_runs", "store_config", "owned_key_error", "log_samples", "TEXT_TRACKERS",
]  # fmt: skip

NonEmptyStr = Annotated[str, Field(min_length=1)]

#: Where a run keeps its trackers' identities, relative to the output directory.
TRACKERS_FILE = Path("logs") / "trackers.json"
#: ``training.tracker.project`` unset: one project for every run, as W&B and MLflow group them.
DEFAULT_PROJECT = "acc-train"

#: init_kwargs that Accelerate or acc-train pass to every tracker, and the setting that says them
#: instead (a second value would be a duplicate argument, or silently lose); a tracker's own are
#: its kind's ``owned_keys`` (:class:`acc_train.outputs.tracker_kinds.TrackerKind`)
OWNED_KEYS: dict[str, dict[str, str]] = {
    "*": {"run_name": "training.tracker.project", "logging_dir": "output_dir (its logs/ folder)"},
}


class TrackerConfig(BaseModel):
    """``training.tracker``: the tracker run a job logs to (a config section, strict like the others)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)

    project: NonEmptyStr = Field(
        DEFAULT_PROJECT,
        description=(
            "The name trackers group runs under: W&B project, MLflow experiment, TensorBoard's folder under "
            "`logs/`. One name for every run by default, so runs can be compared."
        ),
    )
    run_name: NonEmptyStr | None = Field(None, description="The run's name in W&B and MLflow. Null: the output directory's name.")
    init_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description=(
            "Each tracker's own arguments, by tracker name (`{wandb: {tags: [a]}}`), handed to Accelerate's "
            "`init_trackers(init_kwargs=...)`."
        ),
    )

    @field_validator("project")
    @classmethod
    def _one_folder(cls, value: str) -> str:
        if value in (".", "..") or any(c in value for c in "/\\"):
            raise ValueError(f"{value!r} is not a project name (TensorBoard makes it a folder under logs/): no '/', '\\', '.' or '..'")
        return value

    # (the tracker names init_kwargs may use are the registered ones: checked with training.report_to,
    # acc_train.config.training, where the plugins' registry is at hand)


def owned_key_error(tracker: str, key: str, kind: TrackerKind | None = None) -> str | None:
    """Why ``init_kwargs[tracker][key]`` is refused, or None when it is the user's to give."""
    setting = (kind.owned_keys if kind is not None else {}).get(key) or OWNED_KEYS["*"].get(key)
    if setting is None or (tracker == "mlflow" and key == "logging_dir"):  # MLflow's artifact location
        return None
    return f"{tracker}.{key} is passed by acc-train from {setting}; set that instead"


def default_run_name(output_dir: str | Path) -> str:
    """``training.tracker.run_name`` unset: the output directory's name (``runs/demo`` -> ``demo``)."""
    return Path(output_dir).resolve().name or DEFAULT_PROJECT


@dataclass
class TrackerPlan:
    """What a launch hands Accelerate's ``init_trackers``, and whether it continues earlier runs."""

    project: str
    run_name: str
    init_kwargs: dict[str, dict[str, Any]]
    #: the identities a previous launch of this run recorded (by tracker), reused here
    continued: dict[str, dict[str, Any]] = field(default_factory=dict)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # a damaged file: start new tracker runs rather than fail the run
        _warn(f"{path} is unreadable ({exc}); the trackers start new runs")
        return {}
    return data if isinstance(data, dict) and isinstance(data.get("runs"), dict) else {}


def _warn(message: str) -> None:
    sys.stderr.write(f"warning: {message}\n")


def plan_trackers(tracker_cfg: Any, output_dir: Path, resumed_step: int, kinds: dict[str, TrackerKind] | None = None) -> TrackerPlan:
    """The project, run name and init_kwargs for this launch of the run in ``output_dir``:
    the user's ``init_kwargs`` plus what each tracker kind adds to continue the runs a previous
    launch started there (when it used the same project). ``resumed_step``: the step this launch
    continues from. ``kinds``: the registered trackers by name (default: Accelerate's)."""
    kinds = kinds if kinds is not None else {k.name: k for k in builtin_tracker_kinds()}
    project = tracker_cfg.project
    run_name = tracker_cfg.run_name or default_run_name(output_dir)
    stored = _read(output_dir / TRACKERS_FILE)
    previous: dict[str, dict[str, Any]] = {}
    if stored and stored.get("project") != project:
        _warn(f"training.tracker.project is {project!r}, the earlier launches used {stored.get('project')!r}: the trackers start new runs")
    elif stored:
        previous = {k: v for k, v in stored["runs"].items() if isinstance(v, dict)}
    kwargs = {name: dict(values) for name, values in tracker_cfg.init_kwargs.items()}
    for name, kind in kinds.items():
        mine = dict(kwargs.get(name, {}))
        kind.continue_run(mine, previous.get(name), run_name, output_dir, resumed_step)
        if mine or name in kwargs:
            kwargs[name] = mine
    return TrackerPlan(project, run_name, kwargs, previous)


def start_trackers(accelerator: Accelerator, plan: TrackerPlan, output_dir: Path, plugin_kinds: list[TrackerKind] = ()) -> None:  # type: ignore[assignment]
    """Accelerate's ``init_trackers`` with the plan (main process), then the trackers plugins
    registered (``plugin_kinds``: not Accelerate's own, which it makes by name). A tracker that cannot start
    (a missing store or key, an argument its library refuses) is the user's setting to fix, and
    leaves no ``logs/`` behind when nothing was written there (the run can be launched again)."""
    logs = output_dir / TRACKERS_FILE.parent
    made = not logs.exists()
    logs.mkdir(parents=True, exist_ok=True)  # W&B writes its run's files there unless told otherwise
    try:
        accelerator.init_trackers(plan.project, init_kwargs=plan.init_kwargs)  # Accelerate's own, by name
        for kind in plugin_kinds:  # a plugin's GeneralTracker, made and started as Accelerate does its own
            tracker = kind.make(plan.project, logs, plan.init_kwargs.get(kind.name, {}))
            tracker.start()
            accelerator.trackers.append(tracker)
    except Exception as exc:
        if made:
            with contextlib.suppress(OSError):
                logs.rmdir()  # only when empty
        again = f"; to start new tracker runs instead of continuing {', '.join(sorted(plan.continued))}'s, delete {TRACKERS_FILE}" if plan.continued else ""
        raise UserError(
            f"a tracker could not start: {type(exc).__name__}: {exc}",
            where="training.report_to",
            hint="fix its setting (training.tracker.init_kwargs, or its environment: WANDB_MODE, WANDB_API_KEY, "
            f"MLFLOW_TRACKING_URI, ...), or leave it out of training.report_to{again}",
        ) from exc


def started_runs(accelerator: Accelerator, output_dir: Path, kinds: dict[str, TrackerKind] | None = None) -> dict[str, dict[str, Any]]:
    """The identity of each tracker run started (main process), by tracker name, as its kind
    tells it (``kinds``: the registered trackers by name, default Accelerate's)."""
    kinds = kinds if kinds is not None else {k.name: k for k in builtin_tracker_kinds()}
    runs: dict[str, dict[str, Any]] = {}
    for tracker in accelerator.trackers:
        kind = kinds.get(tracker.name)
        runs[tracker.name] = kind.identify(tracker, output_dir) if kind is not None else {}
    return runs


def record_runs(output_dir: Path, plan: TrackerPlan, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Keep the runs' identities in ``logs/trackers.json`` (replaced atomically); returns
    ``run.json``'s ``trackers`` entry."""
    record = {"project": plan.project, "run_name": plan.run_name, "runs": runs}
    path = output_dir / TRACKERS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, (json.dumps(record, indent=2) + "\n").encode())
    return {**record, "continued": sorted(name for name in runs if name in plan.continued)}


def store_config(accelerator: Accelerator, values: dict[str, Any], plan: TrackerPlan) -> None:
    """Log the job's config to every tracker (main process), as ``init_trackers(config=...)``
    does, except that a continued MLflow run gets only the params it does not hold yet: MLflow
    refuses to change a logged param (the run's ``config.yaml`` holds this launch's values)."""
    for tracker in accelerator.trackers:
        if tracker.name == "mlflow" and "mlflow" in plan.continued:
            import mlflow

            held = mlflow.MlflowClient().get_run(tracker.active_run.info.run_id).data.params
            # (keys of the launch, not of the training: the run continues whatever they say)
            changed = sorted(k for k, v in values.items() if k in held and held[k] != str(v) and k not in ("output_dir", "resume", "overwrite"))
            if changed:
                _warn(f"MLflow keeps the params the run started with; changed since: {', '.join(changed)}")
            tracker.store_init_configuration({k: v for k, v in values.items() if k not in held})
        else:
            tracker.store_init_configuration(values)


#: the trackers :func:`log_samples` sends text to
TEXT_TRACKERS = ("tensorboard", "wandb", "mlflow")


def _cell(text: Any) -> str:
    """A value as one cell of a Markdown table."""
    return str(text).replace("|", "\\|").replace("\n", "<br>")


def log_samples(accelerator: Accelerator, step: int, rows: list[dict[str, Any]]) -> None:
    """Send one evaluation's generation samples (``samples.jsonl`` rows) to the trackers that
    take text (main process): TensorBoard a Markdown table (its text tab, ``samples``), W&B a
    table (``samples``), MLflow a text artifact (``samples/step-NNNNNN.md``). Others get none."""
    from acc_train.model.prompt_text import prompt_label

    table = [[row["step"], row["index"], prompt_label(row["prompt"]), row["completion"], row["new_tokens"]] for row in rows]
    columns = ["step", "index", "prompt", "completion", "new_tokens"]
    markdown = "\n".join(
        ["| prompt | completion |", "|---|---|", *(f"| {_cell(prompt)} | {_cell(completion)} |" for _, _, prompt, completion, _ in table)]
    )
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_text("samples", markdown, global_step=step)
            tracker.writer.flush()
        elif tracker.name == "wandb":
            tracker.log_table("samples", columns=columns, data=table, step=step)
        elif tracker.name == "mlflow":
            import mlflow

            mlflow.MlflowClient().log_text(tracker.active_run.info.run_id, f"# samples at step {step}\n\n{markdown}\n", f"samples/step-{step:06d}.md")
