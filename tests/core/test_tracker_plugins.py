"""A tracker from a separately installed plugin (an entry point, no change to core): Accelerate's
own ``GeneralTracker``, registered through ``acc_train_register_trackers`` as core registers
Accelerate's nine, named in ``training.report_to``; it gets every logged row and the config, the
plugin's ``acc_train_train_end`` the run's summary, and a resumed launch continues its run."""

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
from acc_train.api import TrackerKind, hookimpl


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
    job = load_job(flags=flags, sets=[*TINY_DEMO, "training.report_to=[dash]", "training.eval_every=2", "checkpoint.every=2", *sets])
    check_output_dir(job)
    summary = train(job)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugins.reset()
    return summary


def _entries(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "dash.jsonl").read_text().splitlines()]


def test_a_plugins_tracker_gets_every_row_the_config_and_the_summary_and_continues_on_resume(dash_installed: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _run(out, 2, "training.tracker.init_kwargs.dash.colour=green")
    _run(out, 4, "training.tracker.init_kwargs.dash.colour=green", resume=True)

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


def test_a_misspelt_plugin_tracker_is_refused_naming_it(dash_installed: Path) -> None:
    with pytest.raises(UserError) as err:
        load_job(sets=["training.report_to=[dsh]"])
    assert "training.report_to" in str(err.value) and "unknown tracker 'dsh'" in str(err.value) and "did you mean 'dash'" in str(err.value)
    with pytest.raises(UserError) as err:
        load_job(sets=["training.report_to=[tensorboard]", "training.tracker.init_kwargs.dash.colour=red"])
    assert "init_kwargs names dash" in str(err.value)
    assert load_job(sets=["training.report_to=[all]"]).config.training.report_to == ["all"]
