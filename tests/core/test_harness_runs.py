"""lm-evaluation-harness under sharded strategies (2 CPU processes, fp32): ``eval.harness_tasks``
runs on every rank in lockstep on the ZeRO-3, FSDP2 and FSDP1 model as it trains (a
multiple-choice task, and a generate_until task generated with ``synced_gpus``), and ``acc-train
eval`` scores the checkpoints each wrote; one job, so every score agrees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from acc_train.outputs.metrics import read_metrics
from acc_train.outputs.report import format_summary, read_run
from tests.conftest import GENERATE_TASK_YAML, shared_runs, tiny_job_args

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("harness")]

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
#: FSDP1 too: its root unit (embeddings, head) is gathered only through the strategy's generation_model
STRATEGIES = {"zero3": ("--strategy", "zero3"), "fsdp": ("--strategy", "fsdp"), "fsdp1": ("--strategy", "fsdp1")}


@pytest.fixture(scope="module")
def generate_task(harness_task: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generate_until task over the multiple-choice task's questions."""
    task = tmp_path_factory.mktemp("generate-task") / "tiny_gen.yaml"
    task.write_text(GENERATE_TASK_YAML.format(data=harness_task.parent.parent / "words.jsonl"))
    return task


@pytest.fixture(scope="module")
def runs(no_dropout_model: Path, tiny_data: dict[str, Path], harness_task: Path, generate_task: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: None):
    def args(name: str, out: Path) -> list[str]:
        job = ("--num-processes", "2", "--max-steps", "4", "--set", "training.eval_every=2", "--set", "checkpoint.every=2", "--set", "checkpoint.keep_last=null")
        tasks = ("--set", f"eval.harness_tasks=[{harness_task}, {generate_task}]", "--set", "eval.harness_limit=12")
        return tiny_job_args(no_dropout_model, tiny_data, out, *STRATEGIES[name], *job, *tasks)

    return shared_runs(tmp_path_factory, args)


@pytest.fixture(scope="module")
def monkeypatch_module():
    """The runs (and the commands) read the local task offline."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in OFFLINE.items():
            mp.setenv(name, value)
        yield


def _harness_rows(run: Path) -> dict[int, dict]:
    return {r.step: r.harness for r in read_metrics(run).evals if r.harness is not None}


def _eval(source: Path, task: Path, first: str = "tiny_words acc ") -> dict:
    """``acc-train eval SOURCE --tasks TASK``'s scores (in this process: no interpreter to start)."""
    from click.testing import CliRunner

    from acc_train_cli.main import cli

    out = source.parent / f"{source.name}-{task.stem}-scores.json"
    result = CliRunner().invoke(cli, ["eval", str(source), "--tasks", str(task), "--limit", "12", "--output", str(out)])
    assert result.exit_code == 0, result.output[-3000:]
    assert result.stdout.splitlines()[0].startswith(first)
    return json.loads(out.read_text())["scores"]


def test_sharded_runs_score_the_harness_alike_while_training(runs) -> None:
    """Every strategy records the task at steps 2 and 4 (metrics.jsonl, run.json, the report),
    with the same scores: the model trained alike and every rank ran the same requests."""
    zero3 = _harness_rows(runs("zero3"))
    assert sorted(zero3) == [2, 4] and all(set(zero3[step]) == {"tiny_words", "tiny_gen"} for step in (2, 4))
    for name in ("fsdp", "fsdp1"):
        other = _harness_rows(runs(name))
        assert sorted(other) == [2, 4], name
        for step in (2, 4):
            assert zero3[step]["tiny_words"]["acc"] == pytest.approx(other[step]["tiny_words"]["acc"], abs=1e-6), (name, step)
            for metric in ("exact_match", "chrf"):  # generated under FSDP and ZeRO-3 with synced_gpus, greedily: the same text
                assert zero3[step]["tiny_gen"][metric] == pytest.approx(other[step]["tiny_gen"][metric], abs=1e-6), (name, step, metric)
    for name in STRATEGIES:
        summary = json.loads((runs(name) / "run.json").read_text())
        assert summary["harness"] == _harness_rows(runs(name))[4] and summary["harness_step"] == 4
        assert f"acc {summary['harness']['tiny_words']['acc']:.4f} (step 4)" in format_summary(read_run(runs(name)))  # acc-train report's table


def test_eval_scores_zero3_and_fsdp_checkpoints_alike(runs, harness_task: Path, generate_task: Path) -> None:
    """``acc-train eval`` on the step-2 checkpoint each strategy wrote (its portable state,
    whatever the strategy) gives the same scores, and the ones the run recorded at step 2; the
    generate_until task too (one process here, two synced ranks in the run)."""
    scores = {name: _eval(runs(name) / "checkpoints" / "step-000002", harness_task) for name in STRATEGIES}
    for name in ("fsdp", "fsdp1"):
        assert scores["zero3"]["tiny_words"]["acc"] == pytest.approx(scores[name]["tiny_words"]["acc"], abs=1e-6), name
    assert scores["zero3"]["tiny_words"]["acc"] == pytest.approx(_harness_rows(runs("zero3"))[2]["tiny_words"]["acc"], abs=1e-6)
    generated = _eval(runs("fsdp") / "checkpoints" / "step-000002", generate_task, first="tiny_gen ")
    assert generated["tiny_gen"] == pytest.approx(_harness_rows(runs("fsdp"))[2]["tiny_gen"], abs=1e-6)
