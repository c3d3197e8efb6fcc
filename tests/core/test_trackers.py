"""Trackers that know their run: ``training.tracker`` (project, run name, init_kwargs), checked
strictly, and a resumed launch that logs to the same W&B, MLflow and TensorBoard run.

The pure parts (the schema, :func:`acc_train.outputs.trackers.plan_trackers`, the identity file) are
tested without launching; one run launched twice (one process each) checks the rest offline:
W&B in offline mode, MLflow with a local file store.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from acc_train.config import load_job
from acc_train.errors import UserError
from acc_train.outputs.samples_file import read_samples
from acc_train.outputs.trackers import TRACKERS_FILE, TrackerConfig, TrackerPlan, default_run_name, plan_trackers, record_runs

from tests.conftest import read_metrics, run_cli, stopped_copy, tiny_job_args

# -- the schema --------------------------------------------------------------------------------


def _job(*sets: str) -> Any:
    return load_job(sets=list(sets)).config


def test_defaults_group_runs_under_one_project_and_name_them_by_output_dir() -> None:
    cfg = _job()
    assert (cfg.training.tracker.project, cfg.training.tracker.run_name, cfg.training.tracker.init_kwargs) == ("acc-train", None, {})
    assert default_run_name("runs/demo") == "demo"
    assert default_run_name(Path("/tmp/x/../y/")) == "y"


@pytest.mark.parametrize(
    ("sets", "fragments"),
    [
        (["training.tracker.init_kwargs.wandbb.tags=[a]"], ["training.tracker.init_kwargs", "unknown tracker 'wandbb'", "did you mean 'wandb'"]),
        (["training.report_to=[tensorboard]", "training.tracker.init_kwargs.wandb.tags=[a]"], ["init_kwargs names wandb", "training.report_to does not list"]),
        (["training.report_to=[wandb]", "training.tracker.init_kwargs.wandb.name=x"], ["wandb.name", "training.tracker.run_name"]),
        (["training.report_to=[wandb]", "training.tracker.init_kwargs.wandb.project=x"], ["wandb.project", "training.tracker.project"]),
        (["training.report_to=[mlflow]", "training.tracker.init_kwargs.mlflow.experiment_name=x"], ["mlflow.experiment_name", "training.tracker.project"]),
        (["training.report_to=[tensorboard]", "training.tracker.init_kwargs.tensorboard.logging_dir=x"], ["tensorboard.logging_dir", "output_dir"]),
        (["training.tracker.project=a/b"], ["training.tracker.project", "not a project name"]),
        (["training.tracker.project=.."], ["training.tracker.project", "not a project name"]),
        (["training.tracker.run_name=''"], ["training.tracker.run_name"]),
        (["training.tracker.init_kwargs.wandb=3"], ["training.tracker.init_kwargs.wandb"]),
        (["training.tracker.runname=x"], ["training.tracker.runname"]),
    ],
)
def test_a_bad_tracker_setting_is_refused_naming_its_key(sets: list[str], fragments: list[str]) -> None:
    with pytest.raises(UserError) as err:
        _job(*sets)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_init_kwargs_the_user_owns_pass_validation() -> None:
    cfg = _job("training.report_to=[wandb,mlflow]", "training.tracker.init_kwargs.wandb={tags: [a], id: fixed1}", "training.tracker.init_kwargs.mlflow.logging_dir=/tmp/art")
    assert cfg.training.tracker.init_kwargs == {"wandb": {"tags": ["a"], "id": "fixed1"}, "mlflow": {"logging_dir": "/tmp/art"}}
    assert "all" in _job("training.report_to=[all]", "training.tracker.init_kwargs.mlflow.tags={a: b}").training.report_to


# -- the plan and the identity file --------------------------------------------------------------


def test_a_first_launch_makes_a_wandb_id_and_a_later_one_reuses_what_was_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = TrackerConfig(project="p", init_kwargs={"wandb": {"tags": ["t"]}})
    first = plan_trackers(cfg, tmp_path, resumed_step=0)
    wandb = first.init_kwargs["wandb"]
    assert (first.project, first.run_name, first.continued) == ("p", tmp_path.name, {})
    assert len(wandb["id"]) == 8 and wandb["id"].isalnum() and wandb["id"].islower()
    assert (wandb["resume"], wandb["name"], wandb["tags"], wandb["dir"]) == ("allow", tmp_path.name, ["t"], str(tmp_path / "logs"))
    assert first.init_kwargs["mlflow"] == {"run_name": tmp_path.name} and "tensorboard" not in first.init_kwargs
    assert cfg.init_kwargs == {"wandb": {"tags": ["t"]}}, "the config is not changed"
    assert plan_trackers(cfg, tmp_path, 0).init_kwargs["wandb"]["id"] != wandb["id"], "nothing recorded: a new id"

    runs = {"wandb": {"id": wandb["id"]}, "mlflow": {"run_id": "abc", "experiment_id": "1"}, "tensorboard": {"logging_dir": "logs/p"}}
    entry = record_runs(tmp_path, first, runs)
    assert entry == {"project": "p", "run_name": tmp_path.name, "runs": runs, "continued": []}
    assert json.loads((tmp_path / TRACKERS_FILE).read_text()) == {"project": "p", "run_name": tmp_path.name, "runs": runs}
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["trackers.json"], "written atomically: no temporary left"

    again = plan_trackers(cfg, tmp_path, resumed_step=10)
    assert again.init_kwargs["wandb"]["id"] == wandb["id"] and again.init_kwargs["mlflow"]["run_id"] == "abc"
    assert again.init_kwargs["tensorboard"] == {"purge_step": 11}, "tensorboard hides the steps the resumed run redoes"
    assert record_runs(tmp_path, again, runs)["continued"] == ["mlflow", "tensorboard", "wandb"]


def test_the_users_own_ids_and_dirs_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record_runs(tmp_path, TrackerPlan("p", "r", {}), {"wandb": {"id": "old"}, "mlflow": {"run_id": "old"}, "tensorboard": {}})
    cfg = TrackerConfig(project="p", run_name="mine", init_kwargs={"wandb": {"id": "pinned", "resume": "must"}, "mlflow": {"run_id": "x"}, "tensorboard": {"purge_step": 3}})
    plan = plan_trackers(cfg, tmp_path, resumed_step=10)
    assert plan.init_kwargs["wandb"]["id"] == "pinned" and plan.init_kwargs["wandb"]["resume"] == "must" and plan.init_kwargs["wandb"]["name"] == "mine"
    assert plan.init_kwargs["mlflow"] == {"run_id": "x", "run_name": "mine"} and plan.init_kwargs["tensorboard"] == {"purge_step": 3}
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    assert "dir" not in plan_trackers(cfg, tmp_path, 0).init_kwargs["wandb"], "WANDB_DIR is W&B's to read"


def test_another_project_or_a_damaged_file_starts_new_runs_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record_runs(tmp_path, TrackerPlan("old", "r", {}), {"wandb": {"id": "keepme"}})
    plan = plan_trackers(TrackerConfig(project="new"), tmp_path, 5)
    assert plan.init_kwargs["wandb"]["id"] != "keepme" and plan.continued == {}
    assert "training.tracker.project is 'new', the earlier launches used 'old'" in capsys.readouterr().err
    (tmp_path / TRACKERS_FILE).write_text("{not json")
    assert plan_trackers(TrackerConfig(), tmp_path, 5).continued == {}
    assert "unreadable" in capsys.readouterr().err


def test_checking_a_tracker_config_imports_no_tracker_library() -> None:
    code = (
        "import sys\n"
        "from acc_train.config import load_job\n"
        "load_job(sets=['training.report_to=[wandb,mlflow]', 'training.tracker.init_kwargs.wandb.tags=[a]'])\n"
        "print('TRACKERS', sorted(m for m in ('wandb', 'mlflow') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "TRACKERS []" in proc.stdout


# -- a run launched twice: the resumed launch logs to the same tracker runs -----------------------


def _wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file (a LevelDB-style log of protobuf records behind a 7-byte
    W&B header), read here because wandb 0.31 ships no Python reader for it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunks, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0:  # zeroed padding up to the next block
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        chunks = chunk if kind in (1, 2) else chunks + chunk  # FULL/FIRST start a record, MIDDLE/LAST extend it
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
    return records


def _wandb_launch(path: Path) -> dict[str, Any]:
    """One offline launch's run record and logged steps."""
    records = _wandb_records(path)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records if r.WhichOneof("record_type") == "history"]
    return {
        "id": run.run_id, "project": run.project, "name": run.display_name, "tags": list(run.tags),
        "losses": {row["_step"]: row["loss"] for row in rows if "loss" in row},
        # a W&B table is logged as its file's record (samples/path, samples/nrows, ...)
        "samples": {row["_step"]: {k.removeprefix("samples/"): v for k, v in row.items() if k.startswith("samples/")} for row in rows if "samples/path" in row},
        "files": path.parent / "files",
    }  # fmt: skip


@pytest.fixture(scope="module")
def tracked_runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> dict[str, Any]:
    """A 4-step run logging to W&B (offline), MLflow (file store) and TensorBoard, checkpointed
    at step 2, with generation samples at steps 2 and 4 (no eval data: samples alone); then a copy of it as if killed after step 2's checkpoint, resumed (``--resume
    latest``): it redoes steps 3 and 4."""
    base = tmp_path_factory.mktemp("trackers")
    env = {
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
        "WANDB_CONFIG_DIR": str(base / "wandb-config"), "WANDB_CACHE_DIR": str(base / "wandb-cache"), "WANDB_DATA_DIR": str(base / "wandb-data"),
        "MLFLOW_TRACKING_URI": f"file:{base / 'mlruns'}", "MLFLOW_ALLOW_FILE_STORE": "true",
    }  # fmt: skip
    args = (
        "--max-steps", "4", "--set", "checkpoint.every=2", "--set", "checkpoint.keep_last=null", "--set", "data.eval_files=[]",
        "--report-to", "wandb", "--report-to", "mlflow", "--report-to", "tensorboard",
        "--set", "training.tracker={project: trk-proj, run_name: trk-run, init_kwargs: {wandb: {tags: [t1]}, mlflow: {tags: {team: x}}}}",
        "--set", "training.eval_every=2", "--set", "eval.samples=[the quick brown]", "--set", "eval.max_new_tokens=4",
    )  # fmt: skip
    first_out = base / "first"
    first = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, first_out, *args), env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    resumed_out = stopped_copy(first_out, base / "resumed", saved=2, lost=4)
    resumed = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, resumed_out, *args, "--resume", "latest"), env=env)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    return {"first": first_out, "resumed": resumed_out, "mlruns": base / "mlruns", "stderr": resumed.stderr}


@pytest.mark.launch
@pytest.mark.xdist_group("trackers")  # one worker shares the module's two launches
def test_run_json_names_the_tracker_runs_and_the_resumed_launch_continues_them(tracked_runs: dict[str, Any]) -> None:
    first = json.loads((tracked_runs["first"] / "run.json").read_text())["trackers"]
    resumed = json.loads((tracked_runs["resumed"] / "run.json").read_text())["trackers"]
    assert (first["project"], first["run_name"], first["continued"]) == ("trk-proj", "trk-run", [])
    assert sorted(first["runs"]) == ["mlflow", "tensorboard", "wandb"]
    assert resumed["runs"] == first["runs"], "the same W&B id, MLflow run and TensorBoard folder"
    assert resumed["continued"] == ["mlflow", "tensorboard", "wandb"]
    assert first["runs"]["tensorboard"] == {"logging_dir": "logs/trk-proj"}
    assert json.loads((tracked_runs["resumed"] / TRACKERS_FILE).read_text())["runs"] == first["runs"]
    assert sorted(read_metrics(tracked_runs["resumed"])) == [1, 2, 3, 4]
    assert "warning: MLflow keeps" not in tracked_runs["stderr"], "only --resume (and the copy's output dir) changed: no params to report"


@pytest.mark.launch
@pytest.mark.xdist_group("trackers")  # one worker shares the module's two launches
def test_wandb_offline_logs_both_launches_under_one_run_id_with_the_names_given(tracked_runs: dict[str, Any]) -> None:
    wandb_id = json.loads((tracked_runs["first"] / "run.json").read_text())["trackers"]["runs"]["wandb"]["id"]
    # the first launch's offline run was copied with the output dir; the resumed launch added its own
    launches = [_wandb_launch(p) for p in sorted((tracked_runs["resumed"] / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))]
    assert len(launches) == 2, launches
    for launch in launches:
        assert (launch["id"], launch["project"], launch["name"], launch["tags"]) == (wandb_id, "trk-proj", "trk-run", ["t1"])
    assert [list(launch["losses"]) for launch in launches] == [[1, 2, 3, 4], [3, 4]], "the resumed launch logs from the step after the checkpoint"
    logged = {step: row.loss for step, row in read_metrics(tracked_runs["resumed"]).items()}
    assert {**launches[0]["losses"], **launches[1]["losses"]} == pytest.approx(logged)
    assert [sorted(launch["samples"]) for launch in launches] == [[2, 4], [4]], "a table of samples at each evaluation"
    made = {r["step"]: (r["completion"], r["new_tokens"]) for r in read_samples(tracked_runs["resumed"])}
    for launch in launches:
        for step, table in launch["samples"].items():
            assert table["_type"] == "table-file" and table["nrows"] == 1, table
            written = json.loads((launch["files"] / table["path"]).read_text())
            assert written["columns"] == ["step", "index", "prompt", "completion", "new_tokens"]
            assert written["data"] == [[step, 0, "the quick brown", *made[step]]]


@pytest.mark.launch
@pytest.mark.xdist_group("trackers")  # one worker shares the module's two launches
def test_mlflow_continues_the_run_in_its_experiment(tracked_runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store only on request

    runs = json.loads((tracked_runs["resumed"] / "run.json").read_text())["trackers"]["runs"]
    client = MlflowClient(tracking_uri=f"file:{tracked_runs['mlruns']}")
    run = client.get_run(runs["mlflow"]["run_id"])
    assert client.get_experiment(run.info.experiment_id).name == "trk-proj"
    assert (run.info.run_name, run.data.tags["team"]) == ("trk-run", "x")
    assert run.data.params["training.tracker.project"] == "trk-proj" and run.data.params["resume"] == "None", "the first launch's params stay"
    assert len(client.search_runs([run.info.experiment_id])) == 1, "no second run"
    # MLflow keeps every value logged: the two steps the resumed launch redoes appear twice
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4, 3, 4]
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "samples")) == ["samples/step-000002.md", "samples/step-000004.md"]
    text = Path(client.download_artifacts(run.info.run_id, "samples/step-000004.md")).read_text()
    (row,) = [r for r in read_samples(tracked_runs["resumed"]) if r["step"] == 4]
    assert text.startswith("# samples at step 4") and f"| the quick brown | {row['completion']} |" in text


@pytest.mark.launch
@pytest.mark.xdist_group("trackers")  # one worker shares the module's two launches
def test_tensorboard_hides_the_steps_the_resumed_launch_redid(tracked_runs: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tracked_runs["resumed"] / "logs" / "trk-proj"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2, "both launches wrote into one folder"
    events = EventAccumulator(str(folder))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("loss")}
    assert sorted(losses) == [1, 2, 3, 4] and len(events.Scalars("loss")) == 4
    assert losses == pytest.approx({step: row.loss for step, row in read_metrics(tracked_runs["resumed"]).items()})
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in EventAccumulator(str(folder), size_guidance={"tensors": 0}).Reload().Tensors("samples/text_summary")}
    rows = read_samples(tracked_runs["resumed"])
    assert sorted(texts) == [2, 4] and all(f"| the quick brown | {r['completion']} |" in texts[r["step"]] for r in rows)
    first = [(r["step"], r["completion"]) for r in read_samples(tracked_runs["first"])]
    assert [(r["step"], r["completion"]) for r in rows] == first and len(first) == 2, "samples without eval data, the same after a resume"


def test_a_tracker_that_cannot_start_is_a_user_error_naming_report_to(tmp_path: Path) -> None:
    from acc_train.outputs.trackers import start_trackers

    def init_trackers(project: str, init_kwargs: dict[str, Any]) -> None:
        raise ModuleNotFoundError("No module named 'sqlalchemy'")  # mlflow-skinny's default store, sqlite

    with pytest.raises(UserError) as err:
        start_trackers(SimpleNamespace(init_trackers=init_trackers), TrackerPlan("p", "r", {}), tmp_path)  # type: ignore[arg-type]
    assert err.value.where == "training.report_to" and "No module named 'sqlalchemy'" in err.value.message
    assert "MLFLOW_TRACKING_URI" in (err.value.hint or "")
    assert list(tmp_path.iterdir()) == [], "no logs/ left: the output dir holds no run, the launch can be repeated"
    with pytest.raises(UserError) as err:  # a recorded run its store no longer has
        start_trackers(SimpleNamespace(init_trackers=init_trackers), TrackerPlan("p", "r", {}, {"mlflow": {"run_id": "x"}}), tmp_path)  # type: ignore[arg-type]
    assert "delete logs/trackers.json" in (err.value.hint or "")
