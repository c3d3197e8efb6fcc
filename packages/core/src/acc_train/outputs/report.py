"""A run's report: the run read back (:func:`read_run`), its summary table and its samples.

Read from what a run leaves in its output directory (``metrics.jsonl``, ``run.json``,
``checkpoints/``), so ``acc-train report`` shows it for any run, finished or not, and the
end of training draws the same one (core's ``builtin`` plugin, on ``acc_train_train_end``);
:mod:`acc_train.outputs.plot` draws its ``report.png``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from acc_train.errors import UserError
from acc_train.outputs.evaluation_rows import evaluation_rows
from acc_train.outputs.metrics import METRICS_FILE, MetricsRow, read_metrics, shape_problem
from acc_train.model.prompt_text import prompt_label
from acc_train.outputs.samples_file import SAMPLES_FILE, read_samples
from acc_train.files.user_files import read_user_json, read_user_text

__all__ = [
    "RunRecord", "read_run", "read_summary", "read_configured_strategy", "summary_rows", "format_summary", "format_samples",
]  # fmt: skip


@dataclass
class RunRecord:
    """What a run's output directory says about it."""

    output_dir: Path
    #: logged training steps (``loss``, ``lr``, ``tokens_per_s``...), in step order
    steps: list[MetricsRow] = field(default_factory=list)
    #: evaluators' rows (``step`` and an evaluator's metrics: ``eval_loss``, ``harness``, a plugin's own)
    evals: list[MetricsRow] = field(default_factory=list)

    @property
    def loss_evals(self) -> list[MetricsRow]:
        """The evaluations of the loss (drawn beside the training loss)."""
        return [r for r in self.evals if r.eval_loss is not None]

    #: ``run.json``, or None for a run that did not finish
    summary: dict[str, Any] | None = None
    #: the strategy name from ``config.yaml`` (for a run without run.json)
    configured_strategy: str | None = None
    #: (directory name, step, is the latest) of each complete checkpoint
    checkpoints: list[tuple[str, int | None, bool]] = field(default_factory=list)
    #: the rows of ``samples.jsonl`` (``eval.samples``), in the order written
    samples: list[dict[str, Any]] = field(default_factory=list)


def read_run(output_dir: str | Path) -> RunRecord:
    """Read a run's outputs. A directory without ``metrics.jsonl`` is a user error."""
    out = Path(output_dir)
    metrics = out / METRICS_FILE
    if not metrics.is_file():
        what = "does not exist" if not out.exists() else f"holds no {METRICS_FILE}"
        raise UserError(
            f"{str(out)!r} {what}, so there is no run to report on",
            where="report OUTPUT_DIR",
            hint="give the --output-dir of a run (it writes metrics.jsonl from its first step)",
        )
    rows = read_metrics(metrics)
    record = RunRecord(out, steps=rows.training, evals=rows.evals)
    if (out / "run.json").exists():
        record.summary = read_summary(out / "run.json")
    if (out / "config.yaml").exists():
        record.configured_strategy = read_configured_strategy(out / "config.yaml")
    record.checkpoints = _checkpoints(out / "checkpoints")
    record.samples = read_samples(out / SAMPLES_FILE)
    return record


class _MfuBasis(BaseModel):
    """``run.json``'s ``mfu_basis``: what the MFU row says it is measured against."""

    model_config = ConfigDict(strict=True, extra="allow")

    flops_per_token: float | None = None
    peak_flops: float | None = None
    precision: str | None = None


class _Evaluation(BaseModel):
    """An entry of ``run.json``'s ``evaluations``: an evaluator's last metrics and their step."""

    model_config = ConfigDict(strict=True, extra="allow")

    step: int | None = None
    metrics: dict[str, Any] = {}


class _Summary(BaseModel):
    """The keys of ``run.json`` the report reads, by type at every depth (a harness score
    too); the run's other keys are kept unchecked. None is allowed: an unfinished figure."""

    model_config = ConfigDict(strict=True, extra="allow")

    strategy: str | None = None
    distributed_type: str | None = None
    world_size: int | None = None
    steps: int | None = None
    start_step: int | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    mfu_basis: _MfuBasis | None = None
    final_loss: float | None = None
    elapsed_s: float | None = None
    #: eval.harness_tasks' last scores, ``{task: {metric: value}}``, and the step they were taken after
    harness: dict[str, dict[str, float]] | None = None
    harness_step: int | None = None
    #: each evaluator's last metrics and their step, by evaluator
    evaluations: dict[str, _Evaluation] | None = None


def read_summary(path: Path) -> dict[str, Any]:
    """``run.json``: a JSON object whose keys the report reads have their types, else a
    UserError naming the file and the key."""
    hint = "run.json is written by a finished run; restore it, or remove it to report from metrics.jsonl"
    summary = read_user_json(path, what="run summary", kind=dict, hint=hint)
    try:
        _Summary.model_validate(summary)
    except ValidationError as exc:
        raise UserError(shape_problem(exc), where=str(path), hint=hint) from None
    return summary


def read_configured_strategy(path: Path) -> str | None:
    """The strategy name in a run's ``config.yaml`` (a mapping), else a UserError naming it."""
    import yaml

    from acc_train.files.yaml_loader import Loader

    hint = "config.yaml is the resolved config a run writes; restore it, or remove it"
    text = read_user_text(path, what="run config", hint=hint)
    try:
        config = yaml.load(text, Loader=Loader) or {}  # noqa: S506 - Loader is a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"not YAML{at} ({getattr(exc, 'problem', None) or exc})", where=str(path), hint=hint) from None
    except RecursionError:
        raise UserError("the run config nests too deeply to read", where=str(path), hint=hint) from None
    if not isinstance(config, dict):
        raise UserError(f"the run config must be a mapping of keys, not a {type(config).__name__}", where=str(path), hint=hint)
    strategy = config.get("strategy")
    name = strategy.get("name") if isinstance(strategy, dict) else strategy
    if name is not None and not isinstance(name, str):
        raise UserError("`strategy` must be a name or a mapping with a `name`", where=str(path), hint=hint)
    return name


def _checkpoints(root: Path) -> list[tuple[str, int | None, bool]]:
    """(name, step, is latest) of each complete checkpoint, "latest" being the one ``--resume
    auto`` would continue from (the newest complete one where the ``latest`` pointer is damaged);
    a damaged manifest shows as an unknown step (``checkpoint inspect`` says what is wrong)."""
    if not root.is_dir():
        return []
    from acc_train.checkpoint.layout import latest_checkpoint

    try:  # what --resume auto and checkpoint inspect find: the pointer's, or the newest complete one
        path, _ = latest_checkpoint(root)
        latest = path.name if path is not None else None
    except UserError:  # the newest checkpoint's manifest is damaged: none would be resumed
        latest = None
    found = []
    for d in sorted(root.glob("step-*")):
        manifest = d / "manifest.json"
        if not manifest.is_file():  # incomplete: never resumed from
            continue
        try:
            step = json.loads(manifest.read_bytes()).get("step")
        except (ValueError, AttributeError, RecursionError):
            step = None
        found.append((d.name, step if isinstance(step, int) and not isinstance(step, bool) else None, d.name == latest))
    return found


def _fmt_loss(value: Any) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    return f"{value:.4f}" if abs(value) < 1e9 else f"{value:.4g}"


def _fmt_mfu(mfu: Any, basis: Any) -> str:
    """``9.1%`` and, from run.json, what it is measured against: ``of 318 GFLOP/s fp32 peak (...)``."""
    if not isinstance(mfu, (int, float)) or isinstance(mfu, bool) or not math.isfinite(mfu):
        return "-"
    text = f"{mfu:.1%}" if abs(mfu) < 1e6 else f"{mfu:.3g}"
    if isinstance(basis, dict) and isinstance(basis.get("peak_flops"), (int, float)) and isinstance(basis.get("flops_per_token"), (int, float)):
        peak = basis["peak_flops"]
        shown = f"{peak / 1e12:.3g} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:.3g} GFLOP/s"
        text += f" of {shown} {basis.get('precision', '')} peak ({basis['flops_per_token'] / 1e6:.4g} MFLOPs/token)"
    return text


def summary_rows(record: RunRecord) -> list[tuple[str, str]]:
    """(key, value) rows of the summary table."""
    s = record.summary or {}
    last = record.steps[-1] if record.steps else None
    best = min(record.steps, key=lambda r: r.loss) if record.steps else None
    strategy = s.get("strategy") or record.configured_strategy or "-"
    if s.get("distributed_type"):
        strategy += f" ({s['distributed_type'].removeprefix('DistributedType.')})"
    steps = str(s.get("steps", last.step if last else "-"))
    if s.get("start_step"):
        steps += f" (resumed at step {s['start_step']})"
    tokens_per_s = s.get("tokens_per_s", last.tokens_per_s if last else None)
    mfu = s.get("mfu", last.mfu if last else None)
    final_loss = s.get("final_loss", last.loss if last else None)
    rows = [
        ("run", str(record.output_dir) + ("" if record.summary else "  (no run.json: unfinished; figures from metrics.jsonl)")),
        ("strategy", strategy),
        ("world size", str(s.get("world_size", "-"))),
        ("steps", steps),
        ("tokens/s", f"{tokens_per_s:,.0f}" if isinstance(tokens_per_s, (int, float)) else "-"),
        ("MFU", _fmt_mfu(mfu, s.get("mfu_basis"))),
        ("final loss", _fmt_loss(final_loss)),
        ("best loss", f"{_fmt_loss(best.loss)} (step {best.step})" if best else "-"),
    ]
    rows += evaluation_rows(_evaluations(record))
    if s.get("elapsed_s") is not None:
        rows.append(("training time", f"{s['elapsed_s']:.1f} s"))
    if record.checkpoints:
        names = [f"{name} (step {step}{', latest' if latest else ''})" for name, step, latest in record.checkpoints]
        rows.append(("checkpoints", ", ".join(names)))
    else:
        rows.append(("checkpoints", "none"))
    return rows


def _evaluations(record: RunRecord) -> list[tuple[int, dict[str, Any]]]:
    """(step, metrics) of every evaluator's row, in the order written: ``metrics.jsonl``'s, else
    the last ones ``run.json`` kept (``evaluations``)."""
    if record.evals:
        return [(row.step, row.evaluation) for row in record.evals]
    kept = (record.summary or {}).get("evaluations") or {}
    return [(entry.get("step"), entry.get("metrics") or {}) for entry in kept.values() if isinstance(entry, dict)]


def format_summary(record: RunRecord) -> str:
    rows = summary_rows(record)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _indented(text: str, indent: str) -> str:
    return text.replace("\n", "\n" + indent)


def format_samples(record: RunRecord, prompt: int = 0) -> str:
    """The generation samples (``samples.jsonl``): every completion of the last evaluation, then
    prompt number ``prompt``'s completions at each evaluation. Empty without samples."""
    if not record.samples:
        return ""
    last = max(row["step"] for row in record.samples)
    lines = [f"samples at step {last} ({SAMPLES_FILE}):"]
    for row in (r for r in record.samples if r["step"] == last):
        lines += [f"  [{row.get('index')}] {_indented(prompt_label(row.get('prompt')), '      ')}", f"      -> {_indented(row['completion'], '         ')}"]
    chosen = [r for r in record.samples if r.get("index") == prompt]
    if not chosen:
        known = sorted({r.get("index") for r in record.samples if isinstance(r.get("index"), int)})
        raise UserError(f"no samples of prompt {prompt} in {SAMPLES_FILE}", where="--prompt", hint=f"the run's prompts are numbered {known}")
    lines.append(f"prompt [{prompt}] across steps: {_indented(prompt_label(chosen[0].get('prompt')), '  ')}")
    width = len(str(max(r["step"] for r in chosen)))
    lines += [f"  step {str(r['step']).rjust(width)}  {_indented(r['completion'], ' ' * (width + 9))}" for r in chosen]
    return "\n".join(lines)
