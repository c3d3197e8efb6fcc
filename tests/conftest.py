"""Shared fixtures: a tiny model and data that the tests make themselves, and CLI runners (a
fresh interpreter, :func:`run_cli`, or this process, :func:`cli_in_process`).

Launching workers costs 10-17 s on a 2-core machine, so launch-based tests share runs through
session fixtures and ``xdist_group`` (``--dist loadgroup`` keeps a group on one worker).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
import os
import subprocess
import sys
from pathlib import Path

import pytest
from acc_train import plugins
from acc_train.outputs import metrics
from acc_train.outputs.metrics import MetricsRow
from acc_train.testing.runs import WORDS, save_tiny_model

ROOT = Path(__file__).resolve().parent.parent



def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``acc-train ARGS`` as a user would, in a fresh interpreter: for launches, and for what
    only a fresh process shows. A command that answers or refuses before launch is
    :func:`cli_in_process`'s (no interpreter start, no torch import per command)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "acc_train_cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )


#: Python's own warning filters in a fresh interpreter (no -W, no PYTHONWARNINGS): what a command
#: run in process shows on stderr, where pytest would otherwise record its warnings
_FRESH_WARNING_FILTERS = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, None),
    ("ignore", PendingDeprecationWarning, None),
    ("ignore", ImportWarning, None),
    ("ignore", ResourceWarning, None),
)


class _TookTooLong(BaseException):
    """Raised by the alarm of :func:`cli_in_process` (a BaseException: no ``except Exception`` in
    the command swallows it)."""


def reset_process_state() -> None:
    """What one command or one in-process run leaves behind: loaded plugins, Accelerate's state."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugins.reset()


def cli_in_process(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, input: str | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``acc-train ARGS`` run in this process through click's ``CliRunner``, answered as
    :func:`run_cli` answers: the exit code, stdout and stderr apart, and a traceback on stderr
    (exit 1) for an exception the command lets through, as the interpreter would print it.

    For the commands that refuse or answer without launching workers (listings, ``--print-config``,
    ``plan``, ``config``, ``report``, ``checkpoint``, refusals before launch): no interpreter
    start and no torch import per command. The environment (with ``env``), the working directory,
    ``sys.argv``, the warning filters, the plugins and Accelerate's state are as a fresh process
    has them, and restored after, with the signal handlers. What only a fresh process shows
    (which modules a command imports; output of a library's logging handler made before the run)
    needs :func:`run_cli`. ``input``: what is piped to the command's stdin (none: an empty one).
    """
    import signal
    import traceback
    import warnings

    from click.testing import CliRunner

    from acc_train_cli.main import cli

    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    os.environ.update({"PYTHONUNBUFFERED": "1", **(env or {})})
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):  # no launcher's (single_process)
        os.environ.pop(var, None)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = ["acc-train", *args]

    def took_too_long(signum: int, frame: object) -> None:
        raise _TookTooLong(f"acc-train {' '.join(args)} did not finish in {timeout} s")

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)}
    old_alarm = signal.signal(signal.SIGALRM, took_too_long)  # (pytest runs tests in the main thread)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    reset_process_state()
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(_FRESH_WARNING_FILTERS):
                warnings.filterwarnings(action, category=category, module=module or "")
            warnings.showwarning = warnings._showwarning_orig  # type: ignore[attr-defined]  # to sys.stderr, as printed
            result = CliRunner().invoke(cli, list(args), input=input, prog_name="acc-train", catch_exceptions=True)
    except _TookTooLong as exc:
        raise subprocess.TimeoutExpired(["acc-train", *args], timeout) from exc
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_alarm)
        for signum, handler in handlers.items():  # a command that got as far as the launcher's own
            signal.signal(signum, handler)
        reset_process_state()
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    stderr, code = result.stderr, result.exit_code
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        assert result.exc_info is not None
        stderr += "".join(traceback.format_exception(*result.exc_info))
        code = 1
    return subprocess.CompletedProcess(["acc-train", *args], code, result.stdout, stderr)


#: every variable acc_train.launch.cluster reads, cleared around each test (a test run inside a Slurm
#: job or a pod must not see its own cluster)
CLUSTER_VARS = [
    *(f"SLURM_{v}" for v in (
        "JOB_ID", "STEP_ID", "STEPID", "STEP_NUM_NODES", "NNODES", "JOB_NUM_NODES", "NODEID", "STEP_NODELIST", "JOB_NODELIST",
        "NODELIST", "GPUS_ON_NODE", "GPUS_PER_NODE", "JOB_GPUS", "STEP_TASKS_PER_NODE", "NTASKS_PER_NODE",
    )),
    *(f"{p}{v}" for p in ("", "PET_") for v in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")),
]  # fmt: skip


def torch_extensions_dir() -> str:
    """torch's own folder for extension builds, as it picks it with the user's cache: DeepSpeed's
    CPU ops (shm comm, about 50 s to compile on 2 cores) are compiled there once per machine,
    where the suite's own XDG_CACHE_HOME would have every xdist worker compile them again."""
    import torch

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    cuda = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    return str(Path.home() / ".cache" / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{cuda}")


@pytest.fixture(scope="session", autouse=True)
def _shared_torch_extensions() -> None:
    """Set for the whole session, before any module's shared launch (torch locks a build, so the
    workers share one)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir()


@pytest.fixture(autouse=True)
def _no_user_default_config(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`acc-train` reads the file `acc-train config` saved when no --config is given; a tester's
    own must not change what the tests see."""
    monkeypatch.setenv("ACC_TRAIN_CONFIG_FILE", str(tmp_path_factory.getbasetemp() / "no-default-config.yaml"))
    # tokenized data is cached under the test session's own directory, not the tester's ~/.cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
    # a test run inside a Slurm job or a pod must not launch its tests on that cluster
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)


def read_metrics(out: Path) -> dict[int, MetricsRow]:
    """The run's logged training steps by step (``acc_train.outputs.metrics``, the one reader)."""
    return metrics.read_metrics(out).steps


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiniest Llama and a word-level tokenizer, saved with save_pretrained (the kit's)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_bf16_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The tiny model stored in bf16, as hub checkpoints are (its config.json says bfloat16)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("tiny-bf16-model")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)  # the tokenizer's files
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).to(torch.bfloat16).save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    return out


@pytest.fixture(scope="session")
def no_dropout_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model without dropout: runs on different world sizes draw no random numbers
    that could differ, so a resume under another world size continues the same losses."""
    import shutil

    path = tmp_path_factory.mktemp("tiny-model-no-dropout") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.0
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """jsonl train and eval files of word salad over the tiny tokenizer's vocabulary."""
    import random

    path = tmp_path_factory.mktemp("tiny-data")
    rng = random.Random(0)
    files = {}
    # train_small: ~7 optimizer steps an epoch at 2 ranks x 4 sequences of 16 tokens
    for split, n in (("train", 400), ("eval", 40), ("train_small", 60)):
        f = path / f"{split}.jsonl"
        with f.open("w") as fh:
            for _ in range(n):
                fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))}) + "\n")
        files[split] = f
    return files


def tiny_job_args(model: Path, data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """CLI arguments for a tiny, fast, fp32 job on the saved model and data. The tiny model is
    randomly initialised: it trains at the demo's learning rate, not fine-tuning's default."""
    return [
        "--set", f"model.name_or_path={model}",
        "--lr", "1e-3",
        "--set", f"data.train_files=[{data['train']}]",
        "--set", f"data.eval_files=[{data['eval']}]",
        "--set", "data.seq_len=16",
        "--micro-batch-size", "4",
        "--mixed-precision", "no",
        "--seed", "7",
        "--set", "training.progress_bar=false",
        "--output-dir", str(out),
        *extra,
    ]  # fmt: skip


#: the job options every launch-based strategy test shares, so their losses are comparable
REFERENCE_STEPS = ("--max-steps", "20", "--set", "checkpoint.every=10", "--set", "checkpoint.keep_last=null", "--set", "training.eval_every=10")


#: generation samples (eval.samples) at each of the reference job's evaluations (steps 10 and 20),
#: greedy: the reference runs that carry them compare completions across strategies and resumes,
#: and keep the losses of the runs without them (generation draws no training random number)
SAMPLE_PROMPTS = ("the quick brown", "a lazy dog")
SAMPLE_ARGS = ("--set", f"eval.samples={json.dumps(list(SAMPLE_PROMPTS))}", "--set", "eval.max_new_tokens=8")


def reference_args(model: Path, data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """The reference job: 20 steps on the small training file (so they cross epochs)."""
    small = {"train": data["train_small"], "eval": data["eval"]}
    return tiny_job_args(model, small, out, "--num-processes", "2", *REFERENCE_STEPS, *extra)


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> Path:
    """The reference DDP run on 2 CPU processes, with generation samples (tests using it belong to
    xdist group "reference-runs")."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    proc = run_cli(*reference_args(tiny_model_dir, tiny_data, out, "--strategy", "ddp", "--report-to", "tensorboard", *SAMPLE_ARGS))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


#: a 4-step run on one process, checkpoints at 2 and 4, both kept (:func:`one_process_run`)
ONE_PROCESS_RUN = ("--strategy", "ddp", "--num-processes", "1", "--max-steps", "4", "--set", "checkpoint.every=2", "--set", "checkpoint.keep_last=null", "--set", "training.eval_every=0")


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> Path:
    """The tiny job of :data:`ONE_PROCESS_RUN`, finished: tests copy it before changing or
    resuming it (tests using it belong to xdist group "data-loss")."""
    out = tmp_path_factory.mktemp("one-process") / "run"
    proc = run_cli(*tiny_job_args(tiny_model_dir, tiny_data, out, *ONE_PROCESS_RUN))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000002", "step-000004"]
    return out


def shared_runs(tmp_path_factory: pytest.TempPathFactory, args_for: Callable[[str, Path], list[str]]) -> Callable[[str], Path]:
    """Launches made on first use and shared by a module's tests: ``get(name)`` runs
    ``acc-train *args_for(name, out)`` once (asserting it succeeds) and returns its output dir."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(name) / "run"
            proc = run_cli(*args_for(name, out))
            assert proc.returncode == 0, proc.stderr[-4000:]
            (out.parent / "stderr.txt").write_text(proc.stderr)  # what the user saw, beside the run
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="session")
def ordered_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """jsonl train and eval files whose lines are 8-24 of the tiny vocabulary's words in one
    cyclic order from a random start: the next word is learnable, so a randomly initialised
    model's loss falls within a few steps (word salad sits at its entropy from the first)."""
    import random

    path = tmp_path_factory.mktemp("ordered-data")
    words = list(dict.fromkeys(WORDS))
    rng = random.Random(0)
    files = {}
    for split, n in (("train", 200), ("eval", 20)):
        with (path / f"{split}.jsonl").open("w") as fh:
            for _ in range(n):
                start = rng.randrange(len(words))
                fh.write(json.dumps({"text": " ".join(words[(start + i) % len(words)] for i in range(rng.randint(8, 24)))}) + "\n")
        files[split] = path / f"{split}.jsonl"
    return files


def matrix_args(model: Path, data: dict[str, Path], out: Path, name: str, *extra: str) -> list[str]:
    """The launch of tests/matrix/combinations.py's combination ``name``: 6 steps, checkpoints
    at 3 and 6, at 1e-2 (the ordered data at that rate falls clearly in 6 steps)."""
    from tests.matrix.combinations import COMBINATIONS, SAVED, STEPS

    steps = ("--max-steps", str(STEPS), "--set", f"checkpoint.every={SAVED}", "--set", "checkpoint.keep_last=null", "--set", "training.eval_every=0")
    return [*tiny_job_args(model, data, out, "--lr", "1e-2", *steps), *COMBINATIONS[name].args(), *extra]


@pytest.fixture(scope="session")
def matrix_runs(tmp_path_factory: pytest.TempPathFactory, tiny_bf16_model_dir: Path, ordered_data: dict[str, Path]) -> Callable[[str], Path]:
    """The support matrix's combinations (tests/matrix/combinations.py) on the tiny model stored
    in bf16, launched on first use (their tests share each one's xdist group)."""
    return shared_runs(tmp_path_factory, lambda name, out: matrix_args(tiny_bf16_model_dir, ordered_data, out, name))


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The loop in this process, as one rank: no launcher's variables, fresh plugins, and
    Accelerate's state reset after."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    plugins.reset()
    yield
    reset_process_state()


def stopped_copy(run: Path, dest: Path, saved: int, lost: int) -> Path:
    """A copy of a finished run as if killed right after step ``saved``'s checkpoint: step
    ``lost``'s checkpoint, ``final/`` and ``run.json`` gone, ``latest`` naming step ``saved``."""
    import shutil

    shutil.copytree(run, dest)
    shutil.rmtree(dest / "checkpoints" / f"step-{lost:06d}")
    shutil.rmtree(dest / "final")
    (dest / "run.json").unlink()
    (dest / "checkpoints" / "latest").write_text(f"step-{saved:06d}\n")
    return dest


def resume_from_step_10(run: Path, tmp_path: Path, model: Path, data: dict[str, Path], *strategy_args: str) -> Path:
    """A copy of a reference run as if killed after step 10's checkpoint, resumed with --resume latest."""
    resumed = stopped_copy(run, tmp_path / "resumed", saved=10, lost=20)
    proc = run_cli(*reference_args(model, data, resumed, *strategy_args, "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return resumed


def checkpointed_run(
    tmp_path: Path, model: Path, data: dict[str, Path], *strategy_args: str, switches: tuple[str, ...] = ("training.gradient_checkpointing=true",)
) -> dict:
    """The reference job with activation checkpointing switched on by ``switches`` (no
    checkpoint saves): its run.json, its losses by step and what the user saw on stderr."""
    out = tmp_path / "checkpointed"
    sets = [arg for switch in (*switches, "checkpoint.every=0") for arg in ("--set", switch)]
    proc = run_cli(*reference_args(model, data, out, *strategy_args, *sets))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"run": json.loads((out / "run.json").read_text()), "losses": read_metrics(out), "stderr": proc.stderr}


def same_samples(run: Path) -> list[tuple]:
    """``samples.jsonl``'s rows without their timing: (step, index, prompt, completion, new tokens)."""
    from acc_train.outputs.samples_file import read_samples

    return [(r["step"], r["index"], r["prompt"], r["completion"], r["new_tokens"]) for r in read_samples(run)]


def assert_same_losses(got: dict, reference: dict, abs: float = 1e-6) -> None:
    """Steps 1-20 (past the epoch boundaries) give the reference's losses."""
    assert sorted(got) == sorted(reference) == list(range(1, 21))
    for step in range(1, 21):
        assert got[step]["loss"] == pytest.approx(reference[step]["loss"], abs=abs), step


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU-only tests skip cleanly where no GPU exists."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def assert_model_card(run: Path, strategy: str, adapter: bool = False) -> dict:
    """``run/final/README.md`` is a model card ``huggingface_hub`` reads, with the run's facts;
    returns its metadata."""
    from huggingface_hub import ModelCard

    summary = json.loads((run / "run.json").read_text())
    card = ModelCard.load(run / "final" / "README.md")
    meta = card.data.to_dict()
    assert meta["library_name"] == ("peft" if adapter else "transformers") and meta["pipeline_tag"] == "text-generation"
    assert "acc-train" in meta["tags"] and strategy in meta["tags"] and ("lora" in meta["tags"]) == adapter
    assert f"{summary['steps']} optimizer steps, {summary['tokens']} tokens" in card.text
    assert f"world size {summary['world_size']}" in card.text and f"{summary['final_loss']:.4f} (training)" in card.text
    assert "```yaml\n" in card.text and "\nstrategy:\n" in card.text and "\ntraining:\n" in card.text  # the resolved job
    return meta


#: a multiple-choice lm-evaluation-harness task over a local JSON-lines file (``{data}``: its path)
HARNESS_TASK_YAML = """\
task: tiny_words
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

#: a generate_until task over the same file (``{data}``): greedy, a few words after the context,
#: scored by exact match and chrF (a score that moves with the text generated)
GENERATE_TASK_YAML = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
  - metric: chrf
"""


@pytest.fixture(scope="session")
def harness_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The path of ``tasks/tiny_words.yaml``: 24 questions of word salad over the tiny
    tokenizer's vocabulary (which 2-word continuation of 5 words), read offline."""
    import random

    root = tmp_path_factory.mktemp("harness")
    rng = random.Random(0)
    data = root / "words.jsonl"
    with data.open("w") as fh:
        for _ in range(24):
            choices = [" ".join(rng.choice(WORDS) for _ in range(2)) for _ in range(3)]
            fh.write(json.dumps({"context": " ".join(rng.choice(WORDS) for _ in range(5)), "choices": choices, "answer": rng.randrange(3)}) + "\n")
    (root / "tasks").mkdir()
    task = root / "tasks" / "tiny_words.yaml"
    task.write_text(HARNESS_TASK_YAML.format(data=data))
    return task
