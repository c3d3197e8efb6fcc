"""``final/README.md``: a Hugging Face model card for what a run trained, as HF Trainer writes
one into what it saves. The YAML metadata (``huggingface_hub``'s ``ModelCardData``) names the
base model, the library that loads the directory and tags, and the evaluators' scores shaped
``{dataset: {metric: value}}`` (lm-evaluation-harness's ``{task: {metric: value}}``) as
``model-index`` results (``EvalResult``), which the Hub shows; the body says how it was trained:
the strategy and world size, steps and tokens, the loss, every evaluator's last metrics (run.json's
``evaluations``, one path for all), the data files and the digest of what was read, and the
job's config, so the directory explains itself wherever it is copied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from acc_train.model.prompt_text import prompt_label

__all__ = ["model_card", "checkpoint_summary", "base_model_id", "data_digest"]


def base_model_id(name_or_path: str | None) -> str | None:
    """The base model as the card's metadata names it: a hub id (``org/name``, or a bare
    ``gpt2``) as given, a local
    ``save_pretrained`` directory by the hub id its config records (``_name_or_path``) if that
    is one; None for the demo model or a local model of unknown origin."""
    if not name_or_path:
        return None
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        try:
            recorded = json.loads((path / "config.json").read_text()).get("_name_or_path")
        except (OSError, ValueError):
            return None
        return recorded if _hub_id(recorded) else None
    return name_or_path if _hub_id(name_or_path) else None


def _hub_id(text: Any) -> bool:
    """Whether ``text`` is a name the Hub accepts as a repository id (its own rule, so ``gpt2``
    is one and ``./model``, ``~/m`` or ``/abs/path`` are not)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(text, str):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def data_digest(summary: dict[str, Any]) -> str | None:
    """The digest of the training data the run read (its cache entry's, what a resume checks)."""
    path = ((summary.get("data") or {}).get("cache") or {}).get("path")
    if not path:
        return None
    try:
        return json.loads((Path(path) / "meta.json").read_text())["train"].get("digest")
    except (OSError, ValueError, KeyError):
        return None


def _loss(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


def checkpoint_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's manifest says of its run, in ``run.json``'s terms (for the card of an
    exported checkpoint: its step, not the run's end; no losses)."""
    data = manifest.get("data") or {}
    return {
        "strategy": manifest.get("strategy"),
        "world_size": manifest.get("world_size"),
        "steps": manifest.get("step"),
        "data": {"kind": data.get("kind"), "rows": data.get("train_rows")},
        "digest": data.get("train_digest"),
        "checkpoint": True,
    }


def model_card(config_yaml: str, config: Any, summary: dict[str, Any], adapter: bool) -> str:
    """The card's text: YAML metadata between ``---`` lines, then Markdown. ``summary``: the
    run's ``run.json``, or :func:`checkpoint_summary` for an exported checkpoint."""
    if summary.get("checkpoint"):
        return _checkpoint_card(config_yaml, config, summary, adapter)
    base = base_model_id(config.model.name_or_path)
    evaluations = {k: v for k, v in (summary.get("evaluations") or {}).items() if isinstance(v, dict) and isinstance(v.get("metrics"), dict)}
    data = _metadata(config, str(summary.get("strategy") or config.strategy["name"]), adapter, _datasets(evaluations))
    data_section = summary.get("data") or {}
    files = list(config.data.train_files) or ["the demo text (the Python standard library's source)"]
    digest = data_digest(summary)
    facts = [
        ("base model", base or (config.model.name_or_path or "acc-train's demo model (random initialisation)")),
        ("what this directory is", "LoRA adapters (PeftModel.from_pretrained(base_model, this directory))" if adapter else "the full model (AutoModelForCausalLM.from_pretrained(this directory))"),
        ("strategy", f"{summary.get('strategy')} ({summary.get('distributed_type')}), world size {summary.get('world_size')} on {summary.get('num_machines')} machine(s), {summary.get('device')}"),
        ("precision", f"mixed precision {summary.get('mixed_precision')}, parameters held in {config.model.dtype}"),
        ("steps", f"{summary.get('steps')} optimizer steps, {summary.get('tokens')} tokens"),
        ("final loss", f"{_loss(summary.get('final_loss'))} (training)"),
        ("data", f"{', '.join(files)}; kind {data_section.get('kind')}, {data_section.get('documents')} examples, {data_section.get('rows')} rows of {config.data.seq_len} tokens"
                 + (f"; digest {digest}" if digest else "")),
    ]  # fmt: skip
    for name, last in evaluations.items():  # every evaluator's last metrics (eval loss, harness, a plugin's)
        shown = "; ".join(f"{metric} {_number(value)}" for metric, value in _flat(last["metrics"]).items() if not metric.endswith("_stderr"))
        facts.append((f"evaluation {name}", f"after step {last.get('step')}: {shown or 'no metrics'}"))
    intro = (
        "Trained with [acc-train](https://github.com/acc-train/acc-train), which ran the job's own training loop under the "
        "strategy below through Hugging Face Accelerate."
    )
    return _render(data, Path(config.output_dir).name, intro, facts, config_yaml, _samples_section(summary.get("samples")))


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested metrics by their names joined with spaces (``harness hellaswag acc``)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key} "))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _datasets(evaluations: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The evaluators' metrics shaped ``{dataset: {metric: number}}`` (lm-evaluation-harness's
    ``{task: {metric: value}}``), merged: what the card's ``model-index`` holds."""
    out: dict[str, dict[str, float]] = {}
    for last in evaluations.values():
        for value in last["metrics"].values():
            if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
                for dataset, metrics in value.items():
                    numbers = {m: v for m, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                    out.setdefault(dataset, {}).update(numbers)
    return out


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", "<br>")


def _samples_section(samples: Any) -> list[str]:
    """The completions of the run's last evaluation (``eval.samples``; run.json's ``samples``)."""
    if not isinstance(samples, dict) or not samples.get("last"):
        return []
    rows = []
    for row in samples["last"]:
        rows.append(f"| {_cell(prompt_label(row.get('prompt')))} | {_cell(row.get('completion'))} |")
    return ["## Samples", "", f"What the model wrote at step {samples.get('step')}, its last evaluation (`{samples.get('file')}` holds every one):", "",
            "| prompt | completion |", "|---|---|", *rows, ""]  # fmt: skip


def _render(data: Any, title: str, intro: str, facts: list[tuple[str, Any]], config_yaml: str, extra: list[str] | None = None) -> str:
    """Metadata between ``---`` lines, the title, the facts as a table, any extra section, the resolved job."""
    body = [
        f"# {title}", "", intro, "", "| | |", "|---|---|", *[f"| {name} | {value} |" for name, value in facts], "", *(extra or []),
        "## Training config", "", "The resolved job (`config.yaml` of the run):", "", "```yaml", config_yaml.rstrip(), "```", "",
    ]  # fmt: skip
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)


def _metadata(config: Any, strategy: str, adapter: bool, harness: dict[str, dict[str, float]] | None = None) -> Any:
    """The card's YAML metadata; ``harness`` (``{dataset: {metric: value}}``: the evaluators'
    scores of that shape, such as ``eval.harness_tasks``') becomes its ``model-index``, one result
    per dataset and metric (standard errors left out: they qualify a score, they are not one)."""
    from huggingface_hub import EvalResult, ModelCardData

    tags = ["acc-train", strategy, f"data-{config.data.kind}"] + (["lora"] if adapter else [])
    results = [
        EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task, metric_type=metric, metric_value=value)
        for task, metrics in (harness or {}).items() if isinstance(metrics, dict)
        for metric, value in metrics.items() if not metric.endswith("_stderr")
    ]  # fmt: skip
    return ModelCardData(
        base_model=base_model_id(config.model.name_or_path), library_name="peft" if adapter else "transformers", tags=tags,
        pipeline_tag="text-generation", model_name=Path(config.output_dir).name if results else None, eval_results=results or None,
    )  # fmt: skip


def _checkpoint_card(config_yaml: str, config: Any, summary: dict[str, Any], adapter: bool) -> str:
    data = _metadata(config, str(summary.get("strategy")), adapter)
    files = ", ".join(config.data.train_files) or "the demo text"
    digest = f"; digest {summary['digest']}" if summary.get("digest") else ""
    facts = [
        ("base model", base_model_id(config.model.name_or_path) or config.model.name_or_path or "the demo model"),
        ("strategy", f"{summary.get('strategy')}, world size {summary.get('world_size')}"),
        ("steps", f"{summary.get('steps')} optimizer steps (this checkpoint)"),
        ("data", f"{files}; kind {summary['data'].get('kind')}, {summary['data'].get('rows')} rows{digest}"),
    ]
    intro = "Exported by acc-train from a checkpoint of a run (`acc-train checkpoint export`)."
    return _render(data, f"{Path(config.output_dir).name}, step {summary.get('steps')}", intro, facts, config_yaml)
