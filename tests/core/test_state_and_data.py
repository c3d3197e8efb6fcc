"""Pickle-free state, checkpoint lookup and the resumable data order."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from acc_train.checkpoint import (
    capture_rng,
    find_checkpoint,
    flatten_optimizer_state,
    restore_rng,
    unflatten_optimizer_state,
)
from acc_train.data import ResumableSampler, demo_text_bytes
from acc_train.errors import UserError


def test_optimizer_state_round_trips_through_safetensors_and_json(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "weight_decay": 0.1}, {"params": model[1].parameters(), "weight_decay": 0.0}], lr=0.01)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    tensors, meta = flatten_optimizer_state(opt.state_dict())
    save_file(tensors, str(tmp_path / "opt.safetensors"))
    (tmp_path / "opt.json").write_text(json.dumps(meta))
    restored = unflatten_optimizer_state(load_file(str(tmp_path / "opt.safetensors")), json.loads((tmp_path / "opt.json").read_text()))
    fresh = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.5)
    fresh.load_state_dict(restored)
    original = opt.state_dict()
    assert fresh.state_dict()["param_groups"] == original["param_groups"]
    for pid, state in original["state"].items():
        for key, value in state.items():
            assert torch.equal(fresh.state_dict()["state"][pid][key], value)


def test_rng_states_round_trip() -> None:
    as_json, tensors = capture_rng()
    json.dumps(as_json)  # JSON, not pickle
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(as_json, tensors)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_find_checkpoint(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step-000005").mkdir(parents=True)
    assert find_checkpoint(tmp_path, "auto") is None
    with pytest.raises(UserError, match="no complete checkpoint"):
        find_checkpoint(tmp_path, "latest")
    with pytest.raises(UserError, match="not a complete checkpoint"):
        find_checkpoint(tmp_path, str(ckpts / "step-000005"))  # no manifest: never resumed from
    (ckpts / "step-000005" / "manifest.json").write_text("{}")
    (ckpts / "latest").write_text("step-000005\n")
    assert find_checkpoint(tmp_path, "latest") == ckpts / "step-000005"
    assert find_checkpoint(tmp_path, str(tmp_path)) == ckpts / "step-000005"  # an output dir
    with pytest.raises(UserError, match="does not exist"):
        find_checkpoint(tmp_path, str(tmp_path / "nope"))


@pytest.mark.parametrize("world,mbs,gas", [(1, 4, 1), (2, 3, 2), (4, 2, 1)])
def test_sampler_resumes_exactly_where_it_stopped(world: int, mbs: int, gas: int) -> None:
    sampler = ResumableSampler(101, seed=3, shuffle=True, group=world * mbs * gas)
    assert sampler.usable % (world * mbs * gas) == 0
    sampler.set_epoch(2)
    full = list(sampler)
    done_batches = 2 * gas  # per rank
    sampler.set_epoch(2)
    sampler.set_start(done_batches * world * mbs)
    assert list(sampler) == full[done_batches * world * mbs :]
    assert list(sampler) == full  # the skip applies to one pass only
    sampler.set_epoch(3)
    assert list(sampler) != full and sorted(sampler) == sorted(set(sampler))


def test_sampler_rejects_data_smaller_than_one_step() -> None:
    with pytest.raises(UserError, match="fewer than one optimizer step"):
        ResumableSampler(5, seed=0, shuffle=True, group=8)


def test_demo_corpus_is_the_stdlib_and_deterministic() -> None:
    a = demo_text_bytes(50_000)
    assert len(a) == 50_000 and a == demo_text_bytes(50_000)
    assert b"def " in a and b"import " in a
