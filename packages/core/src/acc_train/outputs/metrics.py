"""One row of ``metrics.jsonl`` as a typed record, and the one reader of that file.

A run appends one JSON object per line: a *training row* for each logged optimizer step (it has
``loss``) and an *evaluation row* for each evaluator at each evaluation (no ``loss``: ``step`` and
the evaluator's metrics: ``eval_loss``, ``harness`` (the scores of ``eval.harness_tasks``,
``{task: {metric: value}}``), or a plugin's own, kept in ``extra``). Which is which is
decided here and nowhere else: the reporter that writes the file, ``acc-train report``, the
plugin kit and the tests all go through :class:`MetricsRow` and :func:`read_metrics`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from acc_train.errors import UserError
from acc_train.files.user_files import read_user_text

__all__ = ["METRICS_FILE", "ROW_FIELDS", "TRAINING_KEYS", "MetricsRow", "RunMetrics", "flat_numbers", "parse_line", "read_metrics", "row_problem", "shape_problem"]

#: The file in a run's output directory.
METRICS_FILE = "metrics.jsonl"

#: the keys of a training row (an evaluator's metrics are a row's other keys)
TRAINING_KEYS = frozenset({"step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "elapsed_s"})


@dataclass(frozen=True)
class MetricsRow(Mapping[str, Any]):
    """One line of ``metrics.jsonl``. Keys a plugin added to the row are kept in ``extra``.

    It is also a read-only mapping of the JSON object it is written as (``row["loss"]``,
    ``row["perplexity"]``, ``set(row)``); a key the line does not hold is a ``KeyError``.
    """

    step: int
    epoch: int | None = None
    #: mean over ranks and accumulation micro-steps; present exactly on logged training steps
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    #: real tokens trained on since step 0 (all ranks; padding left out)
    tokens: int | None = None
    #: real tokens per second, mean since this run (not the runs it resumed) started
    tokens_per_s: float | None = None
    #: model FLOPs utilization of that mean (:mod:`acc_train.outputs.mfu`); None where no peak is known
    mfu: float | None = None
    #: training time since step 0, resumed runs included
    elapsed_s: float | None = None
    #: present exactly on evaluation rows of the loss
    eval_loss: float | None = None
    #: present exactly on evaluation rows of ``eval.harness_tasks``: ``{task: {metric: value}}``
    harness: dict[str, dict[str, float]] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_training(self) -> bool:
        """A logged optimizer step (what the progress bar, the report's curves and tests read)."""
        return self.loss is not None

    @property
    def is_eval(self) -> bool:
        """An evaluator's row: not a training step's, and holding a metric of its own."""
        return not self.is_training and bool(self.evaluation)

    @property
    def evaluation(self) -> dict[str, Any]:
        """An evaluation row's metrics, by name (its keys that are not a training row's); empty on a training row."""
        return {} if self.is_training else {k: v for k, v in self.to_dict().items() if k not in TRAINING_KEYS}

    def numbers(self) -> dict[str, float]:
        """The row's numbers as trackers take them: nested metrics flattened, their names joined
        by ``/`` (``harness/TASK/METRIC``); ``step`` and what is not a number left out."""
        return {k: v for k, v in flat_numbers(self.to_dict()).items() if k != "step"}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MetricsRow:
        """The row for a parsed line (or the dict the loop hands ``acc_train_step_end``)."""
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in known}, extra={k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written as one line: the fields that are set, then the extras."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        out = {k: v for k, v in out.items() if v is not None or (k == "grad_norm" and self.is_training)}
        return {**out, **self.extra}

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


def flat_numbers(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers in ``values``, nested mappings' names joined by ``/`` (booleans are not numbers)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(flat_numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = value
    return out


@dataclass
class RunMetrics:
    """What ``metrics.jsonl`` holds, split by kind."""

    #: training rows by step (a resumed run's redone steps: the later row)
    steps: dict[int, MetricsRow] = field(default_factory=dict)
    #: evaluation rows, in file order
    evals: list[MetricsRow] = field(default_factory=list)

    @property
    def training(self) -> list[MetricsRow]:
        """Training rows in step order."""
        return [self.steps[s] for s in sorted(self.steps)]


def parse_line(line: str) -> MetricsRow | None:
    """The row on one line, or None for a line cut short by a crash or one without a step."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("step"), int):
        return None
    return MetricsRow.from_dict(data)


def _row_shape() -> type[BaseModel]:
    """:class:`MetricsRow`'s fields as a strict pydantic model, so a line is checked at every
    depth (``harness``'s scores too) against the one declaration of a row: ``"2.4"`` is not a
    number, ``true`` is not a step; keys a plugin added are kept unchecked."""
    hints = get_type_hints(MetricsRow)
    known = {f.name: (hints[f.name], ... if f.default is MISSING else f.default) for f in fields(MetricsRow) if f.name != "extra"}
    return create_model("MetricsRowShape", __config__=ConfigDict(strict=True, extra="allow"), **known)  # type: ignore[call-overload,no-any-return]


_ROW_SHAPE = _row_shape()

#: the fields of a row acc-train reads (the others are a plugin's, kept in ``MetricsRow.extra``)
ROW_FIELDS: tuple[str, ...] = tuple(_ROW_SHAPE.model_fields)

#: what pydantic's error types ask for, as a person says it
_WANTED = {"int_type": "an integer", "float_type": "a number", "dict_type": "an object", "string_type": "a string", "bool_type": "true or false"}


def shape_problem(exc: ValidationError) -> str:
    """The first problem pydantic found, as a person reads it: the key at any depth (dotted:
    ``harness.TASK.METRIC``), what it must be, and what the file holds."""
    err = exc.errors()[0]
    key = ".".join(str(part) for part in err["loc"]) or "the object"
    if err["type"] == "missing":
        return f"`{key}` is missing"
    want = _WANTED.get(err["type"])
    what = f"must be {want}" if want else err["msg"][0].lower() + err["msg"][1:]
    return f"`{key}` {what}, not {json.dumps(err.get('input'))[:40]}"


def row_problem(data: Any) -> str | None:
    """What is wrong with a parsed line as a row (None when it is a row): not an object, a
    ``step`` that is not an integer, a known field of the wrong type at any depth."""
    if not isinstance(data, dict):
        return f"is a JSON {type(data).__name__}, not an object"
    try:
        _ROW_SHAPE.model_validate(data)
    except ValidationError as exc:
        return shape_problem(exc)
    return None


def read_metrics(path: str | Path) -> RunMetrics:
    """Read ``metrics.jsonl`` (a file, or the run's output directory holding it). A last line
    cut short by a crash and objects without a ``step`` are skipped; any other line that is not
    a row is a UserError naming the file and the line."""
    p = Path(path)
    if p.is_dir() and p.name != METRICS_FILE:
        p = p / METRICS_FILE
    text = read_user_text(p, what="metrics file")
    lines = text.split("\n")
    out = RunMetrics()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except RecursionError:
            problem: str | None = "nests too deeply to read"
        except ValueError as exc:
            if number == len(lines):  # no newline after it: the write was cut short
                continue
            problem = f"is not JSON ({getattr(exc, 'msg', exc)})"
        else:
            if isinstance(data, dict) and "step" not in data:  # not a row (a plugin's own line)
                continue
            problem = row_problem(data)
        if problem is not None:
            raise UserError(
                f"line {number}: {problem}",
                where=str(p),
                hint="each line of metrics.jsonl is one JSON object written by a run (step, loss, lr, ...); fix or remove that line",
            )
        row = MetricsRow.from_dict(data)
        if row.is_training:
            out.steps[row.step] = row
        elif row.is_eval:
            out.evals.append(row)
    return out
