"""State a strategy owns beyond model and optimizer (``Strategy.state_dict`` /
``load_state_dict``): written per rank as safetensors plus JSON, restored before
``acc_train_train_start``, so a resumed run continues exactly.

The strategy is the PowerSGD-style test plugin (:mod:`tests.checkpoints.powersgd_plugin`),
installed for this module as a distribution on ``PYTHONPATH``: in one process (no launch) its
resume is checked step by step, and on 2 processes it runs acc-train's conformance kit (two
launches), whose resume check holds it to the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from acc_train import PluginError, hookimpl, plugins
from acc_train.checkpoint.strategy_state import join_strategy_state, read_strategy_state, split_strategy_state
from acc_train.testing import KIT_RESUME_STEP, KitRuns, TestStrategyConformance, kit_group  # noqa: F401
from tests.checkpoints import powersgd_plugin
from tests.conftest import stopped_copy

NAME = powersgd_plugin.NAME

# the kit's suite for the test plugin; its distinguishing effect: the compressions each launch made
pytestmark = pytest.mark.acc_train_strategy(NAME, effects={NAME: "powersgd_compressions"})


@pytest.fixture(scope="module", autouse=True)
def powersgd_installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The plugin installed for this module alone: on ``sys.path`` here, on ``PYTHONPATH`` for
    the processes the kit starts; the other modules never see it."""
    site = powersgd_plugin.install(tmp_path_factory.mktemp("powersgd-site"))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        plugins.reset()
        yield
    sys.modules.pop(powersgd_plugin.MODULE, None)
    plugins.reset()


def test_a_state_of_tensors_and_json_round_trips_without_pickle() -> None:
    import torch

    state = {"errors": {"layer.weight": torch.arange(6.0).view(2, 3), "b": {"deep": torch.ones(2, dtype=torch.bfloat16)}}, "count": 3, "seen": [1, "two", None, {"k": 1.5}], "empty": {}}
    document, tensors = split_strategy_state(state, NAME)
    json.dumps(document, allow_nan=False)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values()) and len(tensors) == 2
    back = join_strategy_state(json.loads(json.dumps(document)), tensors)
    assert back.keys() == state.keys() and back["count"] == 3 and back["seen"] == state["seen"] and back["empty"] == {}
    assert back["errors"]["layer.weight"].equal(state["errors"]["layer.weight"])
    assert back["errors"]["b"]["deep"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("state", "where", "what"),
    [
        ({"ids": {1, 2}}, "at ids", "a set"),
        ({"by_bucket": {0: 1}}, "at by_bucket[0]", "int key"),
        ({"list": [1, {"t": "TENSOR"}]}, "at list[1]/t", "a Tensor"),
        ({"loss": float("nan")}, "at loss", "the number nan"),
        ({"obj": object()}, "at obj", "a object"),
    ],
)
def test_state_a_checkpoint_cannot_hold_without_pickle_is_refused_by_key(state: dict[str, Any], where: str, what: str) -> None:
    import torch

    if "list" in state:
        state["list"][1]["t"] = torch.ones(1)
    with pytest.raises(PluginError) as raised:
        split_strategy_state(state, NAME)
    text = str(raised.value)
    assert f'strategy "{NAME}"' in text and where in text and what in text and "pickle" in text and "hint:" in text, text


class Order:
    """Records when the strategy's state comes back relative to the run's start."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @hookimpl
    def acc_train_train_start(self, run: Any) -> None:
        self.calls.append("train_start")


def _train(out: Path, resume: bool = False, strategy: str = NAME) -> tuple[dict[str, Any], list[str]]:
    """The tiny demo job, 6 steps checkpointed every 3, in this process under the test plugin:
    (run.json's content, when the strategy's state came back relative to ``train_start``)."""
    from acc_train.config import load_job
    from acc_train.trainer import train
    from tests.core.test_train_in_process import TINY_DEMO

    plugins.reset()
    order = Order()
    plugins.get_plugin_manager().register(order, name="order")
    strategy_cls = type(plugins.strategies().get(NAME))
    loaded = strategy_cls.load_state_dict

    def recorded(self: Any, run: Any, state: dict[str, Any]) -> None:
        order.calls.append("load_state_dict")
        loaded(self, run, state)

    strategy_cls.load_state_dict = recorded  # type: ignore[method-assign]
    try:
        flags = {"output_dir": (str(out), "--output-dir"), "training.max_steps": (6, "--max-steps"), "strategy.name": (strategy, "--strategy")}
        if resume:
            flags["resume"] = ("latest", "--resume")
        job = load_job(flags=flags, sets=[*TINY_DEMO, "checkpoint.every=3", "checkpoint.keep_last=null"])
        return train(job), order.calls
    finally:
        strategy_cls.load_state_dict = loaded  # type: ignore[method-assign]


def test_a_strategys_own_state_survives_stop_and_resume_exactly(tmp_path: Path, single_process: None, capsys: pytest.CaptureFixture[str]) -> None:
    from acc_train.outputs.metrics import read_metrics

    full, calls = _train(tmp_path / "run")
    assert calls == ["train_start"], "load_state_dict was called on a fresh run"
    assert full["powersgd_compressions"] > 0 and full["powersgd_compressions_total"] == full["powersgd_compressions"]
    step3 = tmp_path / "run" / "checkpoints" / "step-000003"
    manifest = json.loads((step3 / "manifest.json").read_text())
    assert {"strategy-rank00000.json", "strategy-rank00000.safetensors"} <= set(manifest["files"])
    owner, saved = read_strategy_state(step3, 0)
    assert owner == NAME and saved["compressions"] == full["powersgd_compressions"] // 2 and saved["errors"].keys() == saved["q"].keys()

    resumed_dir = stopped_copy(tmp_path / "run", tmp_path / "resumed", saved=3, lost=6)
    resumed, calls = _train(resumed_dir, resume=True)
    assert calls == ["load_state_dict", "train_start"], calls
    # JSON state back: the run's count continues from the checkpoint's
    assert resumed["powersgd_compressions_total"] == full["powersgd_compressions_total"]
    assert resumed["powersgd_compressions"] == full["powersgd_compressions"] // 2
    a, b = read_metrics(tmp_path / "run").steps, read_metrics(resumed_dir).steps
    for step in (4, 5, 6):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], abs=1e-6), step

    # the check can fail: without the state (a resume that drops it) the run goes elsewhere
    forgetful = stopped_copy(tmp_path / "run", tmp_path / "forgetful", saved=3, lost=6)
    strategy_cls = type(plugins.strategies().get(NAME))
    original = strategy_cls.load_state_dict
    strategy_cls.load_state_dict = lambda self, run, state: None  # type: ignore[method-assign]
    try:
        _train(forgetful, resume=True)
    finally:
        strategy_cls.load_state_dict = original  # type: ignore[method-assign]
    c = read_metrics(forgetful).steps
    assert any(abs(c[s]["loss"] - a[s]["loss"]) > 1e-6 for s in (4, 5, 6)), "the error feedback changes nothing: this test proves nothing"

    # another strategy resuming the checkpoint is not handed the state: it says so and starts afresh
    capsys.readouterr()
    _, calls = _train(stopped_copy(tmp_path / "run", tmp_path / "as-ddp", saved=3, lost=6), resume=True, strategy="ddp")
    assert calls == ["train_start"]
    assert f'per-rank state of strategy "{NAME}" is not restored (strategy "{NAME}" wrote it, and this run has strategy "ddp"' in capsys.readouterr().err


@pytest.mark.launch
@pytest.mark.xdist_group(kit_group(NAME))
def test_each_rank_keeps_its_own_error_feedback(acc_train_kit: KitRuns) -> None:
    """On 2 processes the state is per rank: each rank's error differs (its gradients differ), and
    both ranks' files are in the checkpoint the kit resumes from."""
    middle = acc_train_kit.full(NAME) / "checkpoints" / f"step-{KIT_RESUME_STEP:06d}"
    (owner0, rank0), (owner1, rank1) = read_strategy_state(middle, 0), read_strategy_state(middle, 1)
    assert owner0 == owner1 == NAME and rank0["errors"].keys() == rank1["errors"].keys() and rank0["errors"]
    assert any(not rank0["errors"][k].equal(rank1["errors"][k]) for k in rank0["errors"])