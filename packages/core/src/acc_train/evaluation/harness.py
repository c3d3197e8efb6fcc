"""Benchmark tasks through lm-evaluation-harness (``lm_eval``, the core extra ``eval``): the
tasks of ``acc-train eval`` and of ``eval.harness_tasks``, scored on a model object.

A task is a name lm-eval knows (its own tasks, or one in an ``include_path`` directory) or the
path of a task YAML; a local YAML over a local JSON-lines file (``dataset_path: json``) needs no
network. ``lm_eval`` is imported only when tasks are checked or run: never on ``--help``, never
in a training worker whose job names no harness task.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from acc_train.errors import UserError, closest

if TYPE_CHECKING:
    from acc_train.config.harness import HarnessSettings
    from acc_train.run import RunContext

__all__ = [
    "INSTALL_HINT", "HarnessTasks", "require_lm_eval", "harness_tasks", "evaluate_tasks", "score_lines", "check_job_harness",
    "run_harness",
]  # fmt: skip

INSTALL_HINT = "pip install 'acc-train-core[eval]'"
#: run.extras key of the tasks a run evaluates (resolved once per run)
_EXTRAS_KEY = "acc_train.evaluation.harness"


def require_lm_eval(where: str) -> None:
    """A UserError naming the extra to install where ``lm_eval`` cannot be imported (found
    without importing it)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise UserError("lm-evaluation-harness (the lm_eval package) is not installed", where=where, hint=f"install it: {INSTALL_HINT}")


def _is_yaml_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml"))


class HarnessTasks:
    """Task specs checked against lm-eval's index: every name known, every YAML path a file.
    ``load()`` builds fresh Task objects (lm-eval's tasks keep their requests, so each
    evaluation loads its own; a local dataset is read from the ``datasets`` cache after the first)."""

    def __init__(self, specs: list[str], manager: Any, where: str) -> None:
        self.specs = specs
        self.manager = manager
        self.where = where

    def load(self) -> list[Any]:
        try:
            loaded = self.manager.load(list(self.specs))
        except Exception as exc:  # noqa: BLE001 - a task YAML, its dataset or its template is the user's
            message = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise UserError(
                f"cannot load the task(s) {', '.join(self.specs)}: {message}",
                where=self.where,
                hint="check the task YAML (lm-eval's task format) and that its dataset files exist",
            ) from None
        return list(loaded["tasks"].values()) + list(loaded["groups"].values())


def harness_tasks(tasks: list[str], include_path: str | None, where: str, *, include_path_where: str | None = None) -> HarnessTasks:
    """The tasks as lm-eval will run them, or a UserError naming the first unknown name or
    missing file. lm-eval's own index of thousands of tasks takes seconds to build: it is built
    only for a name that is neither a YAML path nor in ``include_path``."""
    require_lm_eval(where)
    if not tasks:
        raise UserError("no task named", where=where, hint="name a task (e.g. hellaswag) or the path of a task YAML")
    if include_path is not None and not Path(include_path).expanduser().is_dir():
        raise UserError(f"{include_path!r} is not a directory", where=include_path_where or where, hint="give the directory that holds your task YAML files")
    for name in tasks:
        if _is_yaml_path(name) and not Path(name).expanduser().is_file():
            raise UserError(f"task file {name!r} does not exist", where=where, hint="give the path of a task YAML, or a task name")
    from lm_eval.tasks import TaskManager

    paths = [str(Path(include_path).expanduser())] if include_path else None
    names = [n for n in tasks if not _is_yaml_path(n)]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if any(n not in manager.all_tasks for n in names):
        manager = TaskManager(include_path=paths)
    for name in names:
        if name not in manager.all_tasks:
            near = closest(name, manager.all_tasks)
            raise UserError(
                f"lm-evaluation-harness has no task, group or tag named {name!r}",
                where=where,
                hint=(f"did you mean {near!r}? " if near else "") + "`lm-eval ls tasks` lists them; a local task: its YAML's path, or --include-path DIR",
            )
    specs = [str(Path(n).expanduser().resolve()) if _is_yaml_path(n) else n for n in tasks]
    return HarnessTasks(specs, manager, where)


def _scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from lm-eval's ``results``: its ``"acc,none"`` keys as
    ``acc``, ``"exact_match,strict-match"`` as ``exact_match/strict-match`` (no comma: trackers
    such as MLflow refuse one in a metric's name), numbers only (a stderr lm-eval could not
    compute is ``"N/A"``: left out)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results.items():
        metrics = {}
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            metric, _, filt = key.partition(",")
            metrics[metric if filt == "none" else f"{metric}/{filt}"] = float(value)
        out[task] = metrics
    return out


@contextlib.contextmanager
def _same_random_state() -> Iterator[None]:
    """lm-eval seeds Python's, NumPy's and torch's global generators (its own defaults, so its
    scores repeat): they are put back afterwards, so a run with harness tasks trains on the same
    random numbers (dropout, say) as one without."""
    import random

    import numpy as np
    import torch

    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


class _PassedAModelObject:
    """Drops HFLM's warnings about being handed a model object (that is how it is used here,
    and their advice, not to launch through Accelerate, is not the user's to follow)."""

    def filter(self, record: Any) -> bool:
        message = str(record.msg)
        return not message.startswith(("`pretrained` model kwarg is not of type", "Passed an already-initialized model"))


_QUIET = _PassedAModelObject()


@contextlib.contextmanager
def _no_fork(forks: bool) -> Iterator[None]:
    """lm-eval bootstraps a corpus metric's stderr (chrF, BLEU, TER) in a ``multiprocessing``
    pool of forked processes unless ``DISABLE_MULTIPROC`` is set. A training worker runs threads
    (gloo's, the tokenizers' pool): a fork copies a lock one of them holds, and the child waits
    on it forever, and with it its rank and every other rank at the next collective (seen here
    under zero3: a chrF task hung a 2-rank run). Without ``forks`` the bootstrap runs in this
    process; the variable is put back after."""
    import os

    if forks:
        yield
        return
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DISABLE_MULTIPROC"]
        else:
            os.environ["DISABLE_MULTIPROC"] = before


def _harness_lm(model: Any, tokenizer: Any | None, batch_size: int, synced: bool) -> Any:
    """lm-eval's ``HFLM`` on ``model``, generating with ``synced_gpus`` where ``synced``: every
    rank then keeps stepping until all are done, so ``generate_until`` tasks stay in lockstep
    under a sharded strategy even where ranks' greedy outputs part (a stop sequence met on one
    rank a token earlier), as HF Trainer generates under ZeRO-3. ``tokenizer`` None: bytes,
    with a newline before a text that has no context (the byte tokenizer's ``PREFIX_ID``)."""
    from lm_eval.models.huggingface import HFLM

    from acc_train.model.byte_tokenizer import PREFIX_ID, byte_tokenizer

    class SyncedHFLM(HFLM):
        def _model_generate(self, context: Any, max_length: int, stop: list[str], **generation_kwargs: Any) -> Any:
            return super()._model_generate(context, max_length, stop, synced_gpus=True, **generation_kwargs)

    extra = {"prefix_token_id": PREFIX_ID} if tokenizer is None else {}
    tokenizer = byte_tokenizer() if tokenizer is None else tokenizer
    return (SyncedHFLM if synced else HFLM)(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **extra)


def evaluate_tasks(
    model: Any,
    tokenizer: Any | None,
    tasks: HarnessTasks,
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    synced: bool = False,
    forks: bool = True,
) -> dict[str, dict[str, float]]:
    """Score ``model`` (a transformers model object, used as it is: not moved, not wrapped) on
    ``tasks``; returns ``{task: {metric: value}}``. ``tokenizer`` None: the demo model's bytes
    (:func:`acc_train.model.byte_tokenizer.byte_tokenizer`, as ``generate`` reads them). ``synced``:
    several ranks run the same requests together (see :func:`_harness_lm`). ``forks`` False: no
    process is forked (a training worker; see :func:`_no_fork`)."""
    import logging

    import lm_eval
    from lm_eval.models.huggingface import HFLM

    logging.getLogger(HFLM.__module__).addFilter(_QUIET)  # (added once: the same object)
    training = bool(getattr(model, "training", False))
    # lm-eval prints progress to stdout ("bootstrapping for stddev: chrf"): sent to stderr, so
    # stdout holds only the scores (acc-train eval's TASK METRIC VALUE lines)
    with _same_random_state(), _no_fork(forks), contextlib.redirect_stdout(sys.stderr):
        try:
            lm = _harness_lm(model, tokenizer, batch_size, synced)
            out = lm_eval.simple_evaluate(model=lm, tasks=tasks.load(), task_manager=tasks.manager, limit=limit, num_fewshot=num_fewshot, log_samples=False)
        finally:
            if training:  # HFLM switches the model to eval mode
                model.train()
    return _scores((out or {}).get("results", {}))


def score_lines(scores: dict[str, dict[str, float]]) -> list[str]:
    """``TASK METRIC VALUE``, one line per task and metric."""
    return [f"{task} {metric} {value:.4f}" for task, metrics in scores.items() for metric, value in metrics.items()]


# -- during training -------------------------------------------------------------------------


def check_job_harness(config: Any) -> HarnessTasks | None:
    """Before launch: ``eval.harness_tasks`` can run (lm-eval installed, every task known and
    loadable), so a mistake is exit 2 now, not at the first evaluation."""
    settings: HarnessSettings = config.eval
    if not settings.harness_tasks:
        return None
    require_lm_eval("eval.harness_tasks")
    tasks = harness_tasks(settings.harness_tasks, settings.harness_include_path, "eval.harness_tasks", include_path_where="eval.harness_include_path")
    tasks.load()
    return tasks


def run_harness(run: RunContext, step: int) -> dict[str, dict[str, float]]:
    """Run ``eval.harness_tasks`` on the run's model after ``step`` (every rank) and return the
    scores (core's evaluator ``harness_tasks``, :mod:`acc_train.loop.evaluators`, records them
    as ``harness`` by the path every evaluator's metrics take).

    Every rank runs the same requests in the same order on the model it trains with, as the
    strategy hands it out for generation (:meth:`acc_train.strategy.Strategy.generation_model`:
    DDP's module, FSDP2's sharded module, ZeRO-3's module with its gathering hooks, FSDP1's
    module with its root unit gathered; never the torch.compile wrapper), so sharded strategies
    gather each unit's weights for every forward in lockstep, as training does: no rank holds a full copy of the model, and what a
    strategy does to its parameters stays the strategy's. lm-eval, given a model object, splits
    no work across processes (its rank 0 of 1 on each), so every rank computes the same scores;
    the main process records them. The cost is every rank doing the whole evaluation. With more
    than one rank, ``generate_until`` tasks generate with ``synced_gpus``, as ``eval.samples``
    does: lockstep by construction, not by every rank's greedy tokens agreeing to the bit.
    """
    from acc_train.model.build import load_tokenizer

    cfg = run.config
    settings: HarnessSettings = cfg.eval
    if _EXTRAS_KEY not in run.extras:
        tasks = harness_tasks(settings.harness_tasks, settings.harness_include_path, "eval.harness_tasks", include_path_where="eval.harness_include_path")
        run.extras[_EXTRAS_KEY] = (tasks, load_tokenizer(cfg.model))
    tasks, tokenizer = run.extras[_EXTRAS_KEY]
    with run.job.strategy.generation_model(run.accelerator, run.model) as model:
        scores = evaluate_tasks(
            model, tokenizer, tasks, limit=settings.harness_limit, num_fewshot=settings.harness_num_fewshot,
            batch_size=settings.harness_batch_size, synced=run.accelerator.num_processes > 1, forks=False,
        )  # fmt: skip
    return scores
