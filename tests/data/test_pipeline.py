"""The data pipeline a user relies on: packed rows whose position ids restart at each example
and whose examples do not see each other, padding that never counts in the loss, a cache that
is hit on the second launch and rebuilt when a file changes, and overlong examples counted."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from acc_train.config.schema import DataConfig
from acc_train.data import IGNORE_INDEX, Collate, TokenRows, prepare_data
from acc_train.data import pack
from acc_train.data.npyfile import NpyFile
from acc_train.data.rows import Split
from acc_train.testing.runs import WORDS, save_tiny_model


def _split(examples: list[list[int]], seq_len: int, loss: list[list[int]] | None = None, packed: bool = True) -> Split:
    tokens = np.asarray([t for e in examples for t in e], dtype=np.uint16)
    starts = np.zeros(len(examples) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in examples], out=starts[1:])
    flags = None if loss is None else np.asarray([f for fl in loss for f in fl], dtype=np.uint8)
    rows = pack.packed_rows(starts, seq_len) if packed else pack.single_rows(starts)
    return Split(tokens, flags, starts, rows)


def test_packed_rows_keep_examples_whole_in_order_and_fit() -> None:
    lengths = [5, 3, 7, 2, 8, 1, 1, 6]
    split = _split([[i + 2] * n for i, n in enumerate(lengths)], seq_len=8)
    spans = [tuple(int(x) for x in r) for r in split.rows]
    assert spans[0][0] == 0 and spans[-1][1] == sum(lengths)
    assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:])), "rows are contiguous and in order"
    assert all(0 < e - s <= 8 for s, e in spans)
    assert all(s in split.starts for s, _ in spans), "no example is cut between rows"
    # next-fit: [5,3] [7] [2] [8] [1,1,6]
    assert [e - s for s, e in spans] == [8, 7, 2, 8, 8]


def test_position_ids_restart_and_the_first_token_of_each_example_is_not_predicted() -> None:
    examples = [[2, 3, 4], [5, 6], [7, 8, 9]]
    split = _split(examples, seq_len=8)
    row = TokenRows(split)[0]
    assert row["input_ids"].tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    # tokens 5 and 7 start examples: they would be predicted from the example before them
    assert row["labels"].tolist() == [2, 3, 4, IGNORE_INDEX, 6, IGNORE_INDEX, 8, 9]


def test_text_rows_cut_anywhere_and_restart_positions_inside() -> None:
    starts = np.asarray([0, 3, 10, 12], dtype=np.int64)
    tokens = np.arange(12, dtype=np.uint16) + 2
    split = Split(tokens, None, starts, pack.text_rows(12, 4))
    assert len(split) == 3
    rows = [TokenRows(split)[i] for i in range(3)]
    assert rows[0]["position_ids"].tolist() == [0, 1, 2, 0]
    assert rows[1]["position_ids"].tolist() == [0, 1, 2, 3], "a document continued from the previous row starts at 0"
    assert rows[2]["position_ids"].tolist() == [0, 1, 0, 1]
    assert rows[0]["labels"].tolist()[3] == IGNORE_INDEX and rows[2]["labels"].tolist()[2] == IGNORE_INDEX
    assert pack.loss_tokens(split.rows, starts, None) == 12 - 2


def test_loss_flags_mask_the_prompt() -> None:
    split = _split([[2, 3, 4, 5], [6, 7, 8]], seq_len=8, loss=[[0, 0, 1, 1], [0, 1, 1]])
    row = TokenRows(split)[0]
    assert row["labels"].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 4, 5, IGNORE_INDEX, 7, 8]
    assert pack.loss_tokens(split.rows, split.starts, split.loss) == 4


def _tiny_llama(attn: str) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = attn
    cfg.use_cache = False  # as training builds it: with a KV cache, transformers does not look for packed rows
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_examples_do_not_attend_to_each_other(attn: str) -> None:
    """Each example's logits in a packed row equal its logits alone: no attention across examples."""
    model = _tiny_llama(attn)
    examples = [[3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14]]
    batch = Collate(seq_len=16, packed=True, pad_id=0)([TokenRows(_split(examples, seq_len=16))[0]])
    assert "attention_mask" not in batch
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        at = 0
        for ex in examples:
            alone = model(input_ids=torch.tensor([ex])).logits[0]
            torch.testing.assert_close(packed[at : at + len(ex)], alone, atol=1e-5, rtol=1e-5)
            at += len(ex)


def test_padding_never_counts_in_the_loss() -> None:
    model = _tiny_llama("sdpa")
    examples = [[3, 4, 5, 6, 7, 8], [9, 10, 11]]
    split = _split(examples, seq_len=8, packed=False)
    batch = Collate(seq_len=8, packed=False, pad_id=0)([TokenRows(split)[i] for i in range(2)])
    assert batch["input_ids"].shape == (2, 6), "padded to the batch's longest row, not to seq_len"
    assert batch["attention_mask"].tolist()[1] == [1, 1, 1, 0, 0, 0]
    assert batch["labels"].tolist()[1][3:] == [IGNORE_INDEX] * 3
    with torch.no_grad():
        padded = model(**batch).loss
        # the same tokens without padding: the mean of the per-token losses of both examples
        sums, count = 0.0, 0
        for ex in examples:
            out = model(input_ids=torch.tensor([ex]), labels=torch.tensor([ex]))
            sums += float(out.loss) * (len(ex) - 1)
            count += len(ex) - 1
    assert float(padded) == pytest.approx(sums / count, rel=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model"))


def _corpus(path: Path, n: int, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))}) + "\n")
    return path


def _cfg(tmp_path: Path, files: list[Path], **kw: Any) -> DataConfig:
    return DataConfig(train_files=[str(f) for f in files], cache_dir=str(tmp_path / "cache"), **{"seq_len": 16, **kw})


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_second_prepare_hits_the_cache_and_a_changed_file_rebuilds(tmp_path: Path, model_dir: Path) -> None:
    data = _corpus(tmp_path / "train.jsonl", 300)
    tok = _tokenizer(model_dir)
    first = prepare_data(_cfg(tmp_path, [data]), tok)
    assert first.cache == "built"
    second = prepare_data(_cfg(tmp_path, [data]), tok)
    assert (second.cache, second.path) == ("hit", first.path)
    assert isinstance(second.train.tokens, NpyFile), "every rank reads the tokens from the cache on demand, it does not load them"
    assert second.train.tokens.path.parent == Path(first.path) and second.train.tokens.dtype == np.uint16
    np.testing.assert_array_equal(first.train.tokens, second.train.tokens)
    # another option is another entry
    other = prepare_data(_cfg(tmp_path, [data], seq_len=32), tok)
    assert other.cache == "built" and other.path != first.path
    # a changed file is rebuilt, and the rebuild holds the new text
    _corpus(data, 100, seed=1)
    os.utime(data, ns=(os.stat(data).st_atime_ns, os.stat(data).st_mtime_ns + 10**9))
    changed = prepare_data(_cfg(tmp_path, [data]), tok)
    assert changed.cache == "built" and changed.path != first.path
    assert changed.counts["documents"] == 100
    # nothing half-built is left behind
    assert not [p for p in (tmp_path / "cache").iterdir() if "building" in p.name]


def test_counts_match_the_tokens(tmp_path: Path, model_dir: Path) -> None:
    data = _corpus(tmp_path / "train.jsonl", 200)
    tok = _tokenizer(model_dir)
    prepared = prepare_data(_cfg(tmp_path, [data]), tok)
    lines = [json.loads(x)["text"] for x in data.read_text().splitlines()]
    expected = sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in lines)  # + EOS each
    c = prepared.counts
    assert (c["documents"], c["tokens"]) == (200, expected)
    assert c["rows"] == expected // 16
    summed = sum(int((TokenRows(prepared.train)[i]["labels"] != IGNORE_INDEX).sum()) for i in range(len(prepared.train)))
    assert c["loss_tokens"] == summed


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_examples_are_truncated_or_dropped_and_counted(tmp_path: Path, model_dir: Path, overlong: str) -> None:
    data = tmp_path / "train.jsonl"
    texts = [" ".join(WORDS[:n]) for n in (5, 30, 10, 40, 3)]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepared = prepare_data(_cfg(tmp_path, [data], packing=False, overlong=overlong), _tokenizer(model_dir))
    c = prepared.counts
    if overlong == "truncate":
        assert (c["documents"], c["truncated"], c["dropped"]) == (5, 2, 0)
        assert max(int(e - s) for s, e in prepared.train.rows) == 16
    else:
        assert (c["documents"], c["truncated"], c["dropped"]) == (3, 0, 2)
    assert c["rows"] == c["documents"], "without packing, one example per row"


def test_npy_files_read_on_demand_what_numpy_reads(tmp_path: Path) -> None:
    import pickle

    flat = np.arange(1000, dtype=np.uint16) * 7
    table = np.arange(60, dtype=np.int64).reshape(30, 2)
    starts = np.asarray([0, 3, 3, 10, 57, 200], dtype=np.int64)
    for name, arr in (("flat", flat), ("table", table), ("starts", starts)):
        np.save(tmp_path / f"{name}.npy", arr)
    f, t, s = NpyFile(tmp_path / "flat.npy"), NpyFile(tmp_path / "table.npy"), NpyFile(tmp_path / "starts.npy")
    np.testing.assert_array_equal(f[10:20], flat[10:20])
    np.testing.assert_array_equal(f[995:2000], flat[995:])
    assert f[-1] == flat[-1] and len(f) == 1000 and f.shape == (1000,)
    np.testing.assert_array_equal(t[4], table[4])
    window = t.window(5, 12)
    assert len(window) == 7 and window.shape == (7, 2)
    np.testing.assert_array_equal(window[0], table[5])
    np.testing.assert_array_equal(np.asarray(list(window)), table[5:12])
    for value in (-1, 0, 3, 4, 57, 100, 200, 500):
        for side in ("left", "right"):
            assert s.searchsorted(value, side=side) == np.searchsorted(starts, value, side=side), (value, side)
    with pytest.raises(IndexError):
        f[1000]
    again = pickle.loads(pickle.dumps(window))
    np.testing.assert_array_equal(again[0:7], table[5:12])


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda e: os.truncate(e / "train.tokens.npy", (e / "train.tokens.npy").stat().st_size - 7), "train.tokens.npy holds"),
        (lambda e: (e / "train.rows.npy").unlink(), "train.rows.npy is missing"),
        (lambda e: (e / "meta.json").write_text('{"format_version": 1, "tr'), "meta.json"),
    ],
    ids=["truncated-tokens", "deleted-rows", "cut-meta"],
)
def test_a_damaged_cache_entry_is_rebuilt_with_a_warning(tmp_path: Path, model_dir: Path, damage: Any, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    data = _corpus(tmp_path / "train.jsonl", 120)
    tok = _tokenizer(model_dir)
    first = prepare_data(_cfg(tmp_path, [data]), tok)
    whole = np.asarray(first.train.tokens[:]).copy()
    damage(Path(first.path))
    again = prepare_data(_cfg(tmp_path, [data]), tok)
    err = capsys.readouterr().err
    assert f"warning: the data cache entry {first.path} is damaged" in err and says in err and "rebuilding it" in err
    assert again.cache == "built" and again.path == first.path
    np.testing.assert_array_equal(np.asarray(again.train.tokens[:]), whole)
    assert prepare_data(_cfg(tmp_path, [data]), tok).cache == "hit"
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


def _bytes_read_opening(monkeypatch: pytest.MonkeyPatch, cfg: DataConfig, tok: Any) -> tuple[int, Any]:
    """The bytes a worker reads from the cache's arrays while it opens the prepared data and
    summarises it for ``run.json`` (a cache hit, as in every worker)."""
    from acc_train.data import npyfile

    read = [0]
    real = os.pread

    def counted(fd: int, n: int, offset: int) -> bytes:
        out = real(fd, n, offset)
        read[0] += len(out)
        return out

    monkeypatch.setattr(npyfile.os, "pread", counted)
    try:
        prepared = prepare_data(cfg, tok)
        summary = prepared.summary()
    finally:
        monkeypatch.setattr(npyfile.os, "pread", real)
    assert prepared.cache == "hit"
    return read[0], summary


def test_a_worker_opening_and_summarising_its_data_reads_nothing_that_grows_with_the_corpus(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 41: ``run.json``'s packing efficiency read every row of the cache in every worker
    (313 MB of peak memory per rank for 1.75M rows). It is computed once, when the entry is
    built, and read from meta.json."""
    tok = _tokenizer(model_dir)
    small, large = _corpus(tmp_path / "small.jsonl", 100), _corpus(tmp_path / "large.jsonl", 2000, seed=1)
    seen = {}
    for name, data in (("small", small), ("large", large)):
        cfg = _cfg(tmp_path, [data])
        built = prepare_data(cfg, tok)  # the command builds the entry
        seen[name] = (_bytes_read_opening(monkeypatch, cfg, tok), built)
    (small_read, small_summary), small_built = seen["small"]
    (large_read, large_summary), large_built = seen["large"]
    assert large_built.counts["rows"] >= 15 * small_built.counts["rows"]
    assert large_read == small_read, f"a worker read {small_read:,} bytes of a {small_built.counts['rows']}-row split and {large_read:,} of a {large_built.counts['rows']}-row one"
    for summary, built in ((small_summary, small_built), (large_summary, large_built)):
        rows = np.load(Path(built.path) / "train.rows.npy")
        exact = float((rows[:, 1] - rows[:, 0]).sum()) / (len(rows) * 16)
        assert summary["packing_efficiency"] == round(exact, 4)
        assert json.loads((Path(built.path) / "meta.json").read_text())["train"]["packing_efficiency"] == round(exact, 4)


def test_an_entry_built_before_packing_efficiency_was_recorded_gets_it_once(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An older cache entry lacks the packing efficiency: the first process to open it (the
    command, before the workers) computes it and writes it into meta.json; later ones read it."""
    tok = _tokenizer(model_dir)
    cfg = _cfg(tmp_path, [_corpus(tmp_path / "train.jsonl", 300)])
    built = prepare_data(cfg, tok)
    meta_file = Path(built.path) / "meta.json"
    meta = json.loads(meta_file.read_text())
    expected = meta["train"].pop("packing_efficiency")
    assert expected is not None and 0 < expected <= 1
    meta_file.write_text(json.dumps(meta))
    assert prepare_data(cfg, tok).summary()["packing_efficiency"] == expected  # the command's open upgrades the entry
    assert json.loads(meta_file.read_text())["train"]["packing_efficiency"] == expected
    read, summary = _bytes_read_opening(monkeypatch, cfg, tok)
    assert summary["packing_efficiency"] == expected
    rows_bytes = (Path(built.path) / "train.rows.npy").stat().st_size
    assert read < rows_bytes / 4, "a worker after the command reads no rows file to summarise"
