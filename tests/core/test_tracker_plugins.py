"""A tracker and an evaluator from a separately installed plugin (an entry point, no change to
core). The tracker: Accelerate's own ``GeneralTracker``, registered through
``acc_train_register_trackers`` as core registers Accelerate's nine, named in
``training.report_to``; it gets every logged row and the config, the plugin's
``acc_train_train_end`` the run's summary, and a resumed launch continues its run. The evaluator:
registered through ``acc_train_register_evaluators`` as core registers its three, asked for as
``eval.probe`` with its own options; its metrics reach ``metrics.jsonl``, the tracker,
``run.json``, the report and the model card by the path core's evaluators' take. One run
(and its resume) serves both."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from pathlib import Path

import pytest

from acc_train import plugins
from acc_train.config import load_job
from acc_train.errors import UserError
from acc_train.outputs.metrics import MetricsRow
from acc_train.trainer import check_output_dir, train
from tests.core.test_train_in_process import TINY_DEMO

PLUGIN = '''
import json, os
from accelerate.tracking import GeneralTracker
from pydantic import BaseModel, ConfigDict
from acc_train.api import EvaluatorKind, TrackerKind, hookimpl


class DashTracker(GeneralTracker):
    """A team's own dashboard: every call written to logs/dash.jsonl."""

    name = "dash"
    requires_logging_directory = True
    main_process_only = True

    def __init__(self, run_name, logging_dir, resumed_from=None, colour="blue"):
        super().__init__()
        self.path = os.path.join(logging_dir, "dash.jsonl")
        self.args = {"run_name": run_name, "resumed_from": resumed_from, "colour": colour}

    @property
    def tracker(self):
        return self.path

    def _write(self, **entry):
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\\n")

    def start(self):
        self._write(kind="start", **self.args)

    def store_init_configuration(self, values):
        self._write(kind="config", values=values)

    def log(self, values, step=None, **kwargs):
        self._write(kind="log", step=step, values=values)

    def finish(self):
        self._write(kind="finish")


class DashKind(TrackerKind):
    def continue_run(self, kwargs, previous, run_name, output_dir, resumed_step):
        if previous is not None:
            kwargs["resumed_from"] = previous

    def identify(self, tracker, output_dir):
        return {"file": os.path.relpath(tracker.path, output_dir)}


@hookimpl
def acc_train_register_trackers(register):
    register(DashKind("dash", "dash_plugin:DashTracker"))


class ProbeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    scale: float = 1.0


def probe(ctx):
    """The mean absolute weight of the model as it stands (scaled), and a benchmark-shaped score."""
    weights = [p.detach().float() for p in ctx.model.parameters()]
    mean = sum(float(w.abs().sum()) for w in weights) / sum(w.numel() for w in weights)
    return {"probe_weight": mean * ctx.options.scale, "probe_suite": {"tiny": {"acc": 0.5, "acc_stderr": 0.1}}, "probe_steps": ctx.step}


@hookimpl
def acc_train_register_evaluators(register):
    register(EvaluatorKind("probe", "dash_plugin:probe", options_schema=ProbeOptions))


@hookimpl
def acc_train_train_end(run, summary):
    if run.is_main_process:
        with open(os.path.join(run.output_dir, "logs", "dash.jsonl"), "a") as f:
            f.write(json.dumps({"kind": "summary", "steps": summary["steps"], "final_loss": summary["final_loss"]}) + "\\n")
'''



@pytest.fixture
def dash_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, single_process: None) -> Path:
    """The plugin as an installed distribution with an ``acc_train`` entry point, on sys.path."""
    folder = tmp_path / "site"
    dist = folder / "dash_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dash-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[acc_train]\ndash = dash_plugin\n")
    (folder / "dash_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(folder))
    importlib.invalidate_caches()
    plugins.reset()
    yield folder
    sys.modules.pop("dash_plugin", None)


def _run(out: Path, steps: int, *sets: str, resume: bool = False) -> dict:
    flags = {"output_dir": (str(out), "--output-dir"), "training.max_steps": (steps, "--max-steps")}
    if resume:
        flags["resume"] = ("latest", "--resume")
    job = load_job(flags=flags, sets=[*TINY_DEMO, "training.report_to=[dash]", "training.eval_every=2", "checkpoint.every=2", "eval.probe={scale: 2.0}", *sets])
    check_output_dir(job)
    summary = train(job)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugins.reset()
    return summary


def _entries(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "dash.jsonl").read_text().splitlines()]


@pytest.fixture
def dash_run(dash_installed: Path, tmp_path: Path) -> Path:
    """A run of 2 steps and its resume to 4, with the plugin's tracker and evaluator."""
    out = tmp_path / "run"
    _run(out, 2, "training.tracker.init_kwargs.dash.colour=green")
    _run(out, 4, "training.tracker.init_kwargs.dash.colour=green", resume=True)
    return out


def test_a_plugins_tracker_gets_every_row_the_config_and_the_summary_and_continues_on_resume(dash_run: Path) -> None:
    out = dash_run

    entries = _entries(out)
    starts = [e for e in entries if e["kind"] == "start"]
    assert [s["colour"] for s in starts] == ["green", "green"], "training.tracker.init_kwargs reach the tracker"
    assert starts[0]["resumed_from"] is None and starts[1]["resumed_from"] == {"file": "logs/dash.jsonl"}, "the resumed launch continues the run"
    assert starts[0]["run_name"] == "acc-train", "made as Accelerate makes its own: the project first"
    configs = [e["values"] for e in entries if e["kind"] == "config"]
    assert len(configs) == 2 and "dash" in str(configs[0]["training.report_to"]), "the job's config, as Accelerate's trackers get it"

    # every row of metrics.jsonl, as trackers take it (training and evaluation rows)
    logged = [(e["step"], e["values"]) for e in entries if e["kind"] == "log"]
    rows = [MetricsRow.from_dict(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = [(row.step, row.numbers()) for row in rows]
    assert logged == expected and {s for s, _ in logged} == {1, 2, 3, 4}
    assert any("eval_loss" in values for _, values in logged)

    summaries = [e for e in entries if e["kind"] == "summary"]
    assert [s["steps"] for s in summaries] == [2, 4]
    assert sum(e["kind"] == "finish" for e in entries) == 2
    run_json = json.loads((out / "run.json").read_text())
    assert run_json["trackers"]["runs"] == {"dash": {"file": "logs/dash.jsonl"}} and run_json["trackers"]["continued"] == ["dash"]

    # the plugin's evaluator, by the one path every evaluator's metrics take
    from acc_train.outputs.metrics import read_metrics
    from acc_train.outputs.report import format_summary, read_run

    probes = [r for r in read_metrics(out).evals if "probe_weight" in r.evaluation]
    assert [r.step for r in probes] == [2, 4], "a row at each evaluation (the resumed launch redid none)"
    assert all(r.evaluation["probe_steps"] == r.step and r.evaluation["probe_suite"] == {"tiny": {"acc": 0.5, "acc_stderr": 0.1}} for r in probes)
    assert all(set(r.evaluation) == {"probe_weight", "probe_suite", "probe_steps"} for r in probes), "its own row, apart from eval_loss's"
    assert any(values.get("probe_suite/tiny/acc") == 0.5 and "probe_weight" in values for _, values in logged), "the tracker got it, flattened"
    last = probes[-1].evaluation
    assert run_json["evaluations"]["probe"] == {"step": 4, "metrics": last}
    assert run_json["evaluations"]["eval_loss"]["step"] == 4 and run_json["final_eval_loss"] == run_json["evaluations"]["eval_loss"]["metrics"]["eval_loss"]
    rows = dict(line.split("  ", 1) for line in format_summary(read_run(out)).splitlines())
    assert rows["probe weight"].strip() == f"{last['probe_weight']:.4f} (step 4)"
    assert rows["probe suite tiny"].strip() == "acc 0.5000 (step 4); acc by evaluation: 0.5000 -> 0.5000"
    assert rows["eval loss"].strip().endswith("(step 4)") and rows["probe steps"].strip() == "4 (step 4)"
    card = (out / "final" / "README.md").read_text()
    assert f"| evaluation probe | after step 4: probe_weight {last['probe_weight']:.4f}; probe_suite tiny acc 0.5000; probe_steps 4 |" in card
    from huggingface_hub import ModelCard

    results = {(r.dataset_name, r.metric_type): r.metric_value for r in ModelCard(card).data.eval_results}
    assert results == {("tiny", "acc"): 0.5}, "a {dataset: {metric: value}} score is the card's model-index"


def test_a_plugins_evaluator_is_checked_with_the_config_and_at_run_time(dash_installed: Path, tmp_path: Path) -> None:
    """``eval.NAME`` names a registered evaluator (exit 2 in process, naming the key and the
    closest), its options are its schema's; what it returns must be metrics."""
    from tests.conftest import cli_in_process

    proc = cli_in_process("--print-config", "--set", "eval.prob=true")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert 'eval.prob (--set eval.prob=true): unknown key' in proc.stderr and 'did you mean "eval.probe"?' in proc.stderr
    assert "acc_train_register_evaluators" in proc.stderr and "evaluators installed: probe" in proc.stderr
    proc = cli_in_process("--print-config", "--set", "eval.probe={scale: high}")
    assert proc.returncode == 2 and "eval.probe.scale" in proc.stderr, proc.stderr
    proc = cli_in_process("--print-config", "--set", "eval.probe={scael: 2}")
    assert proc.returncode == 2 and "eval.probe.scael" in proc.stderr and 'did you mean "scale"?' in proc.stderr, proc.stderr
    proc = cli_in_process("--print-config", "--set", "eval.probe=true")
    assert proc.returncode == 0 and "probe:\n    scale: 1.0" in proc.stdout, proc.stderr  # the resolved config shows every option
    with pytest.raises(UserError) as err:
        load_job(sets=["eval.eval_loss=true"])
    assert "data.eval_files / data.eval_fraction asks for it" in str(err.value)

    from acc_train.config.json_schema import job_json_schema

    section = job_json_schema()["$defs"]["EvalConfig"]
    assert "scale" in section["properties"]["probe"]["anyOf"][0]["properties"] and section["additionalProperties"] is False  # editors complete it

    from acc_train.evaluation.kinds import metrics_problem

    assert metrics_problem({"loss": 1.0}) is not None and metrics_problem({"probe": "high"}) is not None
    assert metrics_problem([1.0]) is not None and metrics_problem({"probe": {"t": {"acc": 0.5}}, "probe_n": 3}) is None


def test_a_misspelt_plugin_tracker_is_refused_naming_it(dash_installed: Path) -> None:
    with pytest.raises(UserError) as err:
        load_job(sets=["training.report_to=[dsh]"])
    assert "training.report_to" in str(err.value) and "unknown tracker 'dsh'" in str(err.value) and "did you mean 'dash'" in str(err.value)
    with pytest.raises(UserError) as err:
        load_job(sets=["training.report_to=[tensorboard]", "training.tracker.init_kwargs.dash.colour=red"])
    assert "init_kwargs names dash" in str(err.value)
    assert load_job(sets=["training.report_to=[all]"]).config.training.report_to == ["all"]
