"""local-sgd passes acc-train's conformance kit, and behaves as local SGD should.

The kit's suite is collected here for ``local-sgd``; the tests below reuse the kit's two
launches of it (``acc_train_kit``), so the whole file costs two launches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from acc_train.api import read_strategy_state
from acc_train.testing import KIT_RESUME_STEP, KIT_STEPS, KitRuns, TestStrategyConformance, kit_group  # noqa: F401

# what distinguishes local SGD from plain DDP: the parameter averages a launch makes (run.json)
pytestmark = pytest.mark.acc_train_strategy("local-sgd", effects={"local-sgd": "local_sgd_averages"})


def _rank_tensors(directory: Path, rank: int) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(directory / f"model-rank{rank:05d}.safetensors"))


@pytest.mark.launch
@pytest.mark.xdist_group(kit_group("local-sgd"))
def test_ranks_train_apart_and_are_averaged_every_sync_every_steps(acc_train_kit: KitRuns) -> None:
    run = acc_train_kit.full("local-sgd")
    summary = json.loads((run / "run.json").read_text())
    sync_every = summary["sync_every"]
    assert sync_every == 4 and KIT_RESUME_STEP % sync_every != 0 and KIT_STEPS % sync_every == 0
    averaged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if "local_sgd_averaged" in line]
    assert averaged == list(range(sync_every, KIT_STEPS + 1, sync_every))
    # between averages each rank holds its own model: gradients were not all-reduced
    middle = run / "checkpoints" / f"step-{KIT_RESUME_STEP:06d}"
    a, b = _rank_tensors(middle, 0), _rank_tensors(middle, 1)
    assert any(not a[k].equal(b[k]) for k in a), "the ranks' models agree between averages: gradients were synced"
    # right after an average they hold the same one
    end = run / "checkpoints" / f"step-{KIT_STEPS:06d}"
    a, b = _rank_tensors(end, 0), _rank_tensors(end, 1)
    assert all(a[k].equal(b[k]) for k in a)
    ranks = summary["per_rank"]
    assert ranks[0]["param_checksum"] == ranks[1]["param_checksum"]
    assert summary["local_sgd_averages"] == KIT_STEPS // sync_every
    # the helper's count, the strategy's own state, is in the checkpoint a resume starts from
    assert [read_strategy_state(middle, rank) for rank in (0, 1)] == [("local-sgd", {"num_steps": KIT_RESUME_STEP})] * 2
    resumed = json.loads((acc_train_kit.resumed("local-sgd") / "run.json").read_text())
    assert resumed["local_sgd_averages"] == 2  # at steps 8 and 12


def test_user_scripts_are_refused_rather_than_run_as_plain_ddp() -> None:
    from acc_train import UserError, resolve_strategy

    with pytest.raises(UserError, match="accelerate.local_sgd.LocalSGD"):
        resolve_strategy("local-sgd").accelerator_kwargs(None)
