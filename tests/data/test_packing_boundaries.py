"""Packing that never leaks across examples: best-fit decreasing rows, flash attention's varlen
keywords for packed batches, and the architectures whose layers cannot keep examples apart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acc_train.data import pack


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=0, max_size=300), st.integers(64, 96))
def test_best_fit_places_every_example_once_in_rows_that_fit(lengths: list[int], seq_len: int) -> None:
    lengths_a = np.asarray(lengths, dtype=np.int64)
    order, per_row = pack.best_fit(lengths_a, seq_len)
    assert sorted(order.tolist()) == list(range(len(lengths)))
    starts = np.concatenate([[0], np.cumsum(lengths_a[order])]).astype(np.int64)
    rows = pack.rows_of(starts, per_row)
    assert len(rows) == len(per_row) and (rows[:, 1] - rows[:, 0] <= seq_len).all() if len(rows) else not lengths
    if len(rows):
        assert rows[0, 0] == 0 and rows[-1, 1] == starts[-1] and (rows[1:, 0] == rows[:-1, 1]).all()  # contiguous, in order
    # never more rows than next-fit over the data's order
    plain = np.concatenate([[0], np.cumsum(lengths_a)]).astype(np.int64)
    assert len(per_row) <= len(pack.packed_rows(plain, seq_len))


def test_best_fit_fills_rows_that_next_fit_leaves_half_empty() -> None:
    lengths = np.asarray([6, 5, 6, 5, 4, 4], dtype=np.int64)  # next-fit: [6] [5] [6] [5,4] [4]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    assert len(pack.packed_rows(starts, 10)) == 5
    order, per_row = pack.best_fit(lengths, 10)
    assert per_row.tolist() == [2, 2, 2]  # [6,4] [6,4] [5,5]
    assert sorted(lengths[order][:2].tolist()) == [4, 6]
    rows = pack.rows_of(np.concatenate([[0], np.cumsum(lengths[order])]), per_row)
    assert pack.fill(rows, 10) == 1.0 and pack.fill(pack.packed_rows(starts, 10), 10) == 30 / 50


def test_flash_varlen_keywords_are_what_transformers_computes_from_the_position_ids() -> None:
    import torch
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    from acc_train.data.rows import Collate, token_row

    rows = [
        token_row(np.arange(10, 17), None, np.asarray([3])),  # two examples: 3 + 4 tokens
        token_row(np.arange(20, 25), None, np.asarray([], dtype=np.int64)),  # one, then padding
    ]
    batch = Collate(8, True, 0, varlen=True)(rows)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert batch["cu_seq_lens_q"].tolist() == cu_q.tolist() == [0, 3, 7, 8, 13, 16]  # the row's pad is a sequence too
    assert batch["cu_seq_lens_k"].tolist() == cu_k.tolist()
    assert batch["max_length_q"] == batch["max_length_k"] == int(max_q) == int(max_k) == 5
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert "cu_seq_lens_q" not in Collate(8, True, 0)(rows)  # sdpa and eager take a mask instead


def test_flash_attention_is_given_varlen_keywords_not_a_mask() -> None:
    from types import SimpleNamespace

    from acc_train.loop.loss import packed_mask_kind

    def model(attn: str, **config: object) -> object:
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn, **config))

    assert packed_mask_kind(model("flash_attention_2")) == "varlen"
    assert packed_mask_kind(model("flash_attention_3", sliding_window=4096)) == "varlen"  # flash applies its own window
    assert packed_mask_kind(model("sdpa")) == "bool" and packed_mask_kind(model("eager")) == "additive"


@pytest.mark.parametrize(("model_type", "carries"), [("llama", None), ("gemma2", None), ("qwen3_next", "linear_attention"), ("mamba", "linear_attention"), ("lfm2", "lfm2")])
def test_architectures_whose_layers_carry_state_across_examples(model_type: str, carries: str | None) -> None:
    import transformers

    from acc_train.model.build import recurrent_layers

    found = recurrent_layers(transformers.AutoConfig.for_model(model_type))
    assert (found is None) if carries is None else (carries in found)


def test_packing_for_a_model_that_cannot_honour_boundaries_is_refused() -> None:
    import transformers

    from acc_train.api import packs_rows
    from acc_train.config import load_job
    from acc_train.errors import UserError
    from acc_train.model.build import check_packing_boundaries

    qwen3_next = transformers.AutoConfig.for_model("qwen3_next")
    check_packing_boundaries(qwen3_next, packs_rows(load_job(None, {}, ["data.kind=prompt_completion"]).config.data))  # padded: fine
    for sets in (["data.kind=prompt_completion", "data.packing=true"], ["data.kind=chat", "data.packing=best_fit"], []):
        with pytest.raises(UserError) as caught:
            check_packing_boundaries(qwen3_next, packs_rows(load_job(None, {}, sets).config.data))  # [] : text packs by default
        assert caught.value.where == "data.packing" and "qwen3_next cannot honour those boundaries" in caught.value.message
        assert "data.packing=false" in caught.value.hint


def test_best_fit_with_streaming_or_for_text_is_refused() -> None:
    from acc_train.config import load_job
    from acc_train.errors import UserError

    with pytest.raises(UserError, match="best_fit sorts every example"):
        load_job(None, {}, ["data.kind=chat", "data.packing=best_fit", "data.streaming=true", "data.train_files=[x.jsonl]", "training.max_steps=5"])
    with pytest.raises(UserError, match="best_fit packs whole examples"):
        load_job(None, {}, ["data.packing=best_fit"])  # kind text: rows cut from the document stream


def test_data_prepare_best_fit_packs_fuller_rows_and_says_how_full(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tests.conftest import run_cli

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    with (tmp_path / "sft.jsonl").open("w") as f:
        for _ in range(300):  # short examples of uneven lengths: what next-fit leaves gaps after
            f.write(json.dumps({"prompt": " ".join(rng.choice(words, rng.integers(1, 8))), "completion": " ".join(rng.choice(words, rng.integers(1, 12)))}) + "\n")
    common = ["--set", f"model.name_or_path={tiny_model_dir}", "--set", f"data.train_files=[{tmp_path / 'sft.jsonl'}]", "--set", "data.kind=prompt_completion",
              "--set", "data.seq_len=64", "--set", f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    summaries = {}
    for packing in ("true", "best_fit"):
        proc = run_cli(*common, "--set", f"data.packing={packing}", "data", "prepare", "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        summaries[packing] = json.loads(proc.stdout)
    nf, bf = summaries["true"], summaries["best_fit"]
    assert bf["documents"] == nf["documents"] == 300 and bf["tokens"] == nf["tokens"] and bf["loss_tokens"] == nf["loss_tokens"]
    assert bf["rows"] < nf["rows"] and bf["packing_efficiency"] > nf["packing_efficiency"]
    assert bf["packing"] == "best_fit" and nf["packing"] is True
    text = run_cli(*common, "--set", "data.packing=best_fit", "data", "prepare").stdout
    assert "packing best fit" in text and "full (packing efficiency" in text
