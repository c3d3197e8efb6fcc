"""Benchmark tasks through lm-evaluation-harness in one process (no launch): ``acc-train eval``'s
output and its refusals, and ``eval.harness_tasks`` recorded by a run (metrics.jsonl, run.json,
the report) without changing what it trains. The task is a local YAML over a local JSON-lines
file, read offline."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from acc_train_cli.main import cli

LINE = re.compile(r"^(\S+) (\S+) (-?\d+\.\d{4})$")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, single_process: None) -> None:
    """No network (the task is local), and one process whatever launched the tests."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def acc_train(*args: str):
    return CliRunner().invoke(cli, list(args))


def scores_of(output: str) -> dict[str, dict[str, float]]:
    """``TASK METRIC VALUE`` lines as ``{task: {metric: value}}`` (every stdout line is one)."""
    out: dict[str, dict[str, float]] = {}
    for line in output.strip().splitlines():
        match = LINE.match(line)
        assert match, f"not TASK METRIC VALUE: {line!r}"
        out.setdefault(match[1], {})[match[2]] = float(match[3])
    return out


def test_eval_scores_a_local_task_by_its_yaml_path_and_by_name(tiny_model_dir: Path, harness_task: Path, tmp_path: Path) -> None:
    by_path = acc_train("eval", str(tiny_model_dir), "--tasks", str(harness_task), "--output", str(tmp_path / "scores.json"))
    assert by_path.exit_code == 0, by_path.output
    scores = scores_of(by_path.stdout)
    assert set(scores) == {"tiny_words"} and set(scores["tiny_words"]) == {"acc", "acc_stderr"}
    assert 0 <= scores["tiny_words"]["acc"] <= 1
    written = json.loads((tmp_path / "scores.json").read_text())
    assert written["model"] == str(tiny_model_dir) and written["scores"]["tiny_words"]["acc"] == pytest.approx(scores["tiny_words"]["acc"], abs=1e-4)
    by_name = acc_train("eval", str(tiny_model_dir), "--tasks", "tiny_words", "--include-path", str(harness_task.parent))
    assert by_name.exit_code == 0, by_name.output
    assert scores_of(by_name.stdout) == scores
    # --limit: the first N questions; 1 of them is right or wrong
    one = acc_train("eval", str(tiny_model_dir), "--tasks", str(harness_task), "--limit", "1", "--batch-size", "1")
    assert one.exit_code == 0, one.output
    assert scores_of(one.stdout)["tiny_words"]["acc"] in (0.0, 1.0)


def _user_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    for fragment in fragments:
        assert fragment in result.output, (fragment, result.output)


def test_the_guides_local_task_scores_offline(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guide's task YAML and JSON-lines file, as written there, and its commands' forms."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "look-at-what-you-trained.md").read_text()
    files = dict(re.findall(r'^```(?:yaml|jsonl) title="([^"]+)"\n(.*?)^```', page, flags=re.M | re.S))
    assert set(files) == {"data/capitals.jsonl", "tasks/capitals.yaml"}
    monkeypatch.chdir(tmp_path)
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    by_path = acc_train("eval", str(tiny_model_dir), "--tasks", "tasks/capitals.yaml")
    assert by_path.exit_code == 0, by_path.output
    acc = scores_of(by_path.stdout)["capitals"]["acc"]
    assert any(acc == pytest.approx(right / 3, abs=1e-4) for right in range(4))  # 3 questions
    by_name = acc_train("eval", str(tiny_model_dir), "--tasks", "capitals", "--include-path", "tasks")
    assert by_name.exit_code == 0, by_name.output
    assert by_name.stdout == by_path.stdout


def test_eval_refuses_bad_input_with_exit_2(tiny_model_dir: Path, harness_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(tiny_model_dir)
    _user_error(acc_train("eval", model, "--tasks", str(tmp_path / "missing.yaml")), "--tasks", "does not exist")
    _user_error(acc_train("eval", model, "--tasks", "tiny_words", "--include-path", str(tmp_path / "nowhere")), "--include-path", "not a directory")
    _user_error(acc_train("eval", str(tmp_path / "no-run"), "--tasks", str(harness_task)), "does not exist")
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: broken\ndataset_path: json\ndataset_kwargs: {data_files: {test: " + str(tmp_path / "no.jsonl") + "}}\noutput_type: multiple_choice\n")
    _user_error(acc_train("eval", model, "--tasks", str(broken)), "--tasks", "cannot load the task", "hint:")
    not_yaml = tmp_path / "not.yaml"
    not_yaml.write_text("task: [unclosed\n")
    _user_error(acc_train("eval", model, "--tasks", str(not_yaml)), "--tasks", "cannot load the task")
    # an unknown name, against an index of the local tasks alone (lm-eval's own ~15k take seconds to index)
    import lm_eval.tasks

    class LocalOnly(lm_eval.tasks.TaskManager):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalOnly)
    _user_error(acc_train("eval", model, "--tasks", "tiny_wrds", "--include-path", str(harness_task.parent)), "no task, group or tag named 'tiny_wrds'", "did you mean 'tiny_words'")


def test_without_lm_eval_the_command_and_the_config_say_what_to_install(tiny_model_dir: Path, harness_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else find_spec(name, *a))
    _user_error(acc_train("eval", str(tiny_model_dir), "--tasks", str(harness_task)), "pip install 'acc-train-core[eval]'")
    job = ["--set", f"model.name_or_path={tiny_model_dir}", "--set", f"eval.harness_tasks=[{harness_task}]", "--output-dir", str(tmp_path / "run")]
    _user_error(acc_train(*job), "eval.harness_tasks", "pip install 'acc-train-core[eval]'")
    assert not (tmp_path / "run").exists()


#: a multiple-choice task over bytes, for the demo model: which of 3 snippets goes on a line of Python
BYTE_TASK_YAML = """\
task: code_bytes
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
BYTE_QUESTIONS = [
    {"context": "import", "choices": ["os", "(x)", "é ü"], "answer": 0},
    {"context": "def f(self):\n    return", "choices": ["self", "import", "]]"], "answer": 0},
    {"context": "for i in", "choices": ["range(n):", "class", "\u00e9t\u00e9"], "answer": 0},
    {"context": "class A(object):\n   ", "choices": ["def", "é", "}"], "answer": 0},
    {"context": "if x is", "choices": ["None:", "def", "import"], "answer": 0},
    {"context": "    except", "choices": ["OSError:", "return", "?!"], "answer": 0},
    {"context": "from . import", "choices": ["util", "))", "else"], "answer": 0},
    {"context": "x = [1, 2,", "choices": ["3]", "def", "while"], "answer": 0},
]


def _byte_task(root: Path) -> Path:
    (root / "tasks").mkdir(parents=True)
    data = root / "code.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in BYTE_QUESTIONS))
    task = root / "tasks" / "code_bytes.yaml"
    task.write_text(BYTE_TASK_YAML.format(data=data))
    return task


def _byte_level_accuracy(model_dir: Path) -> float:
    """The task's accuracy computed here, without lm-eval: each choice's log-likelihood after
    its context (lm-eval puts a space between them), on the UTF-8 bytes the demo trains on."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = 0
    for q in BYTE_QUESTIONS:
        context = list(q["context"].encode())
        scores = []
        for choice in q["choices"]:
            ids = context + list((" " + choice).encode())
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            scores.append(sum(logp[i - 1, ids[i]].item() for i in range(len(context), len(ids))))
        right += max(range(len(scores)), key=scores.__getitem__) == q["answer"]
    return right / len(BYTE_QUESTIONS)


def test_the_demo_run_is_scored_on_its_bytes(tmp_path: Path) -> None:
    """The demo model has no tokenizer: lm-eval reads it through the byte tokenizer ``generate``
    uses, in ``eval.harness_tasks`` (accepted before launch) and ``acc-train eval`` on the run,
    with the accuracy computed by hand on the bytes."""
    from acc_train.config import load_job
    from acc_train.evaluation.harness import check_job_harness
    from acc_train.outputs.metrics import read_metrics
    from acc_train.trainer import check_output_dir, train

    task = _byte_task(tmp_path)
    job = load_job(
        flags={"output_dir": (str(tmp_path / "demo"), "--output-dir"), "training.max_steps": (2, "--max-steps")},
        sets=[
            "model.config={hidden_size: 16, intermediate_size: 32, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2}",
            "data.seq_len=16", "data.demo_max_bytes=20000", "training.micro_batch_size=2", "training.mixed_precision=no",
            "training.progress_bar=false", "training.eval_every=2", f"eval.harness_tasks=[{task}]",
        ],
    )  # fmt: skip
    assert check_job_harness(job.config) is not None  # the demo job is accepted (it was refused: "no tokenizer")
    run = check_output_dir(job)
    train(job)
    recorded = {r.step: r.harness for r in read_metrics(run).evals if r.harness is not None}
    assert list(recorded) == [2]
    expected = _byte_level_accuracy(run / "final")
    assert recorded[2]["code_bytes"]["acc"] == pytest.approx(expected, abs=1e-6)
    final = acc_train("eval", str(run), "--tasks", "code_bytes", "--include-path", str(task.parent))
    assert final.exit_code == 0, final.output
    assert scores_of(final.stdout)["code_bytes"]["acc"] == pytest.approx(expected, abs=1e-4)


def test_the_byte_tokenizer_reads_text_as_the_demo_trains_on_it() -> None:
    """Encoding is the demo data's own (the text kind without a tokenizer); decoding is UTF-8
    with replacement, as ``generate`` shows text; 256 bytes plus one special token."""
    import random

    from acc_train.model.byte_tokenizer import byte_tokenizer
    from acc_train.config.model_data import DataConfig
    from acc_train.data.kinds import TextKind
    from acc_train.model.prompt_text import decode_tokens, encode_prompt

    tokenizer = byte_tokenizer()
    texts = ["héllo\x00 wörld 🙂\n\tdef f(x): return x", "<|endoftext|> spelt out", " ", "Ā ĉ"]
    trained = TextKind().tokenize({"text": texts}, None, DataConfig())["input_ids"]
    assert [tokenizer.encode(t) for t in texts] == trained == [list(t.encode()) for t in texts]
    tokenizer.padding_side = "left"  # as lm-eval pads a batch to generate from: byte 0, masked
    batch = tokenizer(texts[:2], padding="longest")
    pad = len(trained[0]) - len(trained[1])
    assert batch["input_ids"][1] == [0] * pad + trained[1] and batch["attention_mask"][1] == [0] * pad + [1] * len(trained[1])
    assert len(tokenizer) == 257 and tokenizer.eos_token_id == 256 and tokenizer.pad_token_id == 0
    assert [encode_prompt(None, t, where="p") for t in texts] == trained  # generate and eval.samples
    rng = random.Random(0)
    for _ in range(500):  # any bytes, incomplete and invalid UTF-8 included
        ids = [rng.randrange(256) for _ in range(rng.randrange(1, 12))]
        assert tokenizer.decode(ids) == decode_tokens(None, ids) == bytes(ids).decode("utf-8", errors="replace"), ids
    assert decode_tokens(None, [104, 256, 105]) == "hi"  # the special token is left out


def _train(model: Path, data: dict[str, Path], out: Path, *sets: str) -> Path:
    from acc_train.config import load_job
    from acc_train.trainer import check_output_dir, train

    job = load_job(
        flags={"output_dir": (str(out), "--output-dir"), "training.max_steps": (4, "--max-steps")},
        sets=[
            f"model.name_or_path={model}", f"data.train_files=[{data['train']}]", f"data.eval_files=[{data['eval']}]",
            "data.seq_len=16", "training.micro_batch_size=4", "training.mixed_precision=no", "training.progress_bar=false",
            "training.eval_every=2", "training.eval_batches=2", "optimizer.lr=1e-3", "checkpoint.every=0", *sets,
        ],
    )  # fmt: skip
    check_output_dir(job)
    train(job)
    return out


def test_a_run_records_its_harness_scores(tiny_model_dir: Path, tiny_data: dict[str, Path], harness_task: Path, tmp_path: Path) -> None:
    """``eval.harness_tasks`` at every evaluation (steps 2 and 4) and after the last: rows in
    metrics.jsonl, run.json's last scores, the report's rows; the scores are the ones
    ``acc-train eval`` gives for the run's final model."""
    from acc_train.outputs.metrics import read_metrics
    from acc_train.outputs.report import format_summary, read_run

    run = _train(tiny_model_dir, tiny_data, tmp_path / "harness", f"eval.harness_tasks=[{harness_task}]", "eval.harness_limit=12")
    rows = read_metrics(run)
    harness = [r for r in rows.evals if r.harness is not None]
    assert [r.step for r in harness] == [2, 4]
    assert all(set(r.harness) == {"tiny_words"} and 0 <= r.harness["tiny_words"]["acc"] <= 1 for r in harness)
    assert [r.step for r in rows.evals if r.eval_loss is not None] == [2, 4]
    assert [r.step for r in rows.training] == [1, 2, 3, 4]
    assert harness[-1].numbers()["harness/tiny_words/acc"] == harness[-1].harness["tiny_words"]["acc"]  # what trackers get
    summary = json.loads((run / "run.json").read_text())
    assert summary["harness"] == harness[-1].harness and summary["harness_step"] == 4
    assert summary["evaluations"]["harness_tasks"] == {"step": 4, "metrics": {"harness": harness[-1].harness}}  # as every evaluator's
    assert summary["final_eval_loss"] == pytest.approx(rows.evals[-2].eval_loss if rows.evals[-1].eval_loss is None else rows.evals[-1].eval_loss)
    report = format_summary(read_run(run))
    assert re.search(r"^harness tiny_words +acc \d\.\d{4} \(step 4\); acc by evaluation: \d\.\d{4} -> \d\.\d{4}$", report, flags=re.M), report
    assert "eval loss" in report and "- (step" not in report
    card = (run / "final" / "README.md").read_text()  # the model card names them
    assert f"| evaluation harness_tasks | after step 4: harness tiny_words acc {summary['harness']['tiny_words']['acc']:.4f} |" in card
    offline = acc_train("eval", str(run), "--tasks", str(harness_task), "--limit", "12")
    assert offline.exit_code == 0, offline.output
    assert scores_of(offline.stdout)["tiny_words"]["acc"] == pytest.approx(summary["harness"]["tiny_words"]["acc"], abs=1e-4)


def test_the_harness_leaves_the_random_generators_as_it_found_them(tiny_model_dir: Path, harness_task: Path) -> None:
    """lm-eval seeds Python's, NumPy's and torch's generators: they are put back, so a run with
    harness tasks draws the same dropout masks afterwards as one without."""
    import random

    import numpy as np
    import torch
    import transformers

    from acc_train.evaluation.harness import evaluate_tasks, harness_tasks

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    evaluate_tasks(model, tokenizer, harness_tasks([str(harness_task)], None, "--tasks"), limit=2)
    assert model.training  # HFLM switched it to eval mode; it trains on
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


@pytest.mark.parametrize("failing", ["eval.harness_tasks", "eval.samples"])
def test_a_failing_evaluation_stops_the_run_with_its_steps_checkpoint_written(
    failing: str, tiny_model_dir: Path, tiny_data: dict[str, Path], harness_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's checkpoint is saved before its evaluations: a task whose dataset is gone by
    then, or generation out of memory, stops the run as a UserError naming the evaluation and
    the step, and ``--resume latest`` continues from that step's checkpoint."""
    from acc_train.checkpoint import verify_checkpoint
    from acc_train.errors import UserError

    if failing == "eval.harness_tasks":
        gone = tmp_path / "gone.jsonl"
        task = tmp_path / "gone.yaml"
        task.write_text(harness_task.read_text().replace(str(harness_task.parent.parent / "words.jsonl"), str(gone)).replace("tiny_words", "gone"))
        sets = (f"eval.harness_tasks=[{task}]",)
    else:
        import acc_train.loop.samples

        def out_of_memory(*args, **kwargs):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

        monkeypatch.setattr(acc_train.loop.samples, "complete", out_of_memory)
        sets = ('eval.samples=["the quick"]',)
    out = tmp_path / "run"
    with pytest.raises(UserError) as raised:
        _train(tiny_model_dir, tiny_data, out, "checkpoint.every=2", *sets)
    error = raised.value
    assert error.where == failing and "the evaluation after step 2 failed: " in error.message
    assert ("cannot load the task(s)" if failing == "eval.harness_tasks" else "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB") in error.message
    assert "checkpoint step-000002 is written (this step)" in error.hint and "--resume latest" in error.hint
    assert verify_checkpoint(out / "checkpoints" / "step-000002")["step"] == 2
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000002"
    if failing == "eval.samples":  # the hint holds: the run continues from step 2's checkpoint
        monkeypatch.undo()
        from acc_train.config import load_job
        from acc_train.trainer import train

        job = load_job(config_file=out / "config.yaml", flags={"resume": ("latest", "--resume")}, sets=["checkpoint.every=0"])
        assert train(job)["steps"] == 4


def test_generate_until_tasks_generate_in_lockstep_on_several_ranks(
    tiny_model_dir: Path, harness_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several ranks, lm-eval's generation runs with ``synced_gpus``: every rank steps
    until all are done, lockstep by construction, not by greedy outputs agreeing to the bit
    (here one rank of a gloo group, so the synced path runs for real). As in a training worker,
    nothing is forked: lm-eval's pool for chrF's bootstrapped stderr would copy the locks of the
    worker's threads (a child stuck on one hung a 2-rank zero3 run)."""
    import multiprocessing

    import torch.distributed as dist
    import transformers

    from acc_train.evaluation.harness import evaluate_tasks, harness_tasks
    from tests.conftest import GENERATE_TASK_YAML

    task = tmp_path / "gen.yaml"
    task.write_text(GENERATE_TASK_YAML.format(data=harness_task.parent.parent / "words.jsonl"))
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    calls: list[dict] = []
    generate = model.generate

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return generate(*args, **kwargs)

    model.generate = recording

    def no_pool(*args, **kwargs):
        raise AssertionError("a training worker must not fork")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with monkeypatch.context() as patched:
            patched.setattr(multiprocessing, "Pool", no_pool)
            synced = evaluate_tasks(model, tokenizer, harness_tasks([str(task)], None, "--tasks"), limit=4, synced=True, forks=False)
    finally:
        dist.destroy_process_group()
    assert calls and all(c.get("synced_gpus") is True for c in calls)
    calls.clear()
    alone = evaluate_tasks(model, tokenizer, harness_tasks([str(task)], None, "--tasks"), limit=4)
    assert calls and not any(c.get("synced_gpus") for c in calls)
    assert synced == alone and set(alone["tiny_gen"]) >= {"exact_match", "chrf"}
    command = acc_train("eval", str(tiny_model_dir), "--tasks", str(task), "--limit", "4")  # lm-eval's prints stay off stdout
    assert command.exit_code == 0, command.output
    assert scores_of(command.stdout) == {"tiny_gen": pytest.approx(alone["tiny_gen"], abs=1e-4)}
