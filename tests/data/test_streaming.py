"""Streamed data (``data.streaming``): the rows are the cached path's rows, a saved position
continues exactly (mid-read, mid-document, across passes, per rank), and a streamed run
resumed from a checkpoint gives the uninterrupted run's losses; another world size is refused."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from acc_train.config.schema import DataConfig
from acc_train.data import TokenRows, data_kind, pack, prepare_data
from acc_train.data import stream as stream_module
from acc_train.data.build import _tokenize
from acc_train.data.kinds import TextKind
from acc_train.data.rows import Split
from acc_train.data.stream import StreamRows
from acc_train.testing.runs import WORDS, save_tiny_model

from tests.conftest import read_metrics, run_cli, stopped_copy, tiny_job_args


class _Examples(TextKind):
    """``text`` as whole examples (not continuous): packing is next-fit, overlong applies."""

    name: ClassVar[str] = "examples"
    continuous: ClassVar[bool] = False


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(save_tiny_model(tmp_path_factory.mktemp("model")))


def _corpus(path: Path, n: int, seed: int, longest: int = 40) -> Path:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, longest)))}) + "\n")
    return path


def _cfg(tmp_path: Path, files: list[Path], **kw: Any) -> DataConfig:
    return DataConfig(train_files=[str(f) for f in files], cache_dir=str(tmp_path / "cache"), streaming=True, **{"seq_len": 16, **kw})


def _same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert set(x) == set(y) == {"input_ids", "labels", "position_ids"}
        for k in x:
            assert x[k].dtype == y[k].dtype == np.int64, k
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"row {i} {k}")


@pytest.mark.parametrize("packing", [None, False])
def test_text_rows_equal_the_cached_rows(tmp_path: Path, tokenizer: Any, packing: bool | None) -> None:
    files = [_corpus(tmp_path / "a.jsonl", 300, 0), _corpus(tmp_path / "b.jsonl", 200, 1, longest=60)]
    cfg = _cfg(tmp_path, files, packing=packing)
    cached = prepare_data(cfg, tokenizer)
    expected = [TokenRows(cached.train)[i] for i in range(len(cached.train))]
    stream = StreamRows(cfg.train_files, "data.train_files", cfg, data_kind(cfg), tokenizer, passes=1)
    _same(list(stream), expected)
    assert stream.counts == {k: cached.counts[k] for k in stream_module.COUNTS}, "one pass counts what the cache counted"


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_example_rows_equal_the_cached_path(tmp_path: Path, tokenizer: Any, packing: bool, overlong: str) -> None:
    """A kind that is not continuous: next-fit packing of whole examples, or one per row; the
    cached path's functions (``_tokenize``, ``pack``, ``TokenRows``) give the expected rows."""
    files = [_corpus(tmp_path / "a.jsonl", 400, 2, longest=24)]
    cfg = _cfg(tmp_path, files, packing=packing, overlong=overlong)
    kind = _Examples()
    texts = [json.loads(x)["text"] for x in files[0].read_text().splitlines()]
    tok = _tokenize({"text": texts}, kind, tokenizer, cfg, cfg.seq_len)
    kept = [(ids, loss) for ids, loss, fate in zip(tok["input_ids"], tok["loss_mask"], tok["fate"]) if fate <= 1]
    starts = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in kept])]).astype(np.int64)
    tokens = np.asarray([t for ids, _ in kept for t in ids], dtype=np.uint16)
    flags = np.asarray([f for _, loss in kept for f in loss], dtype=np.uint8)
    rows = pack.packed_rows(starts, cfg.seq_len) if packing else pack.single_rows(starts)
    split = Split(tokens, flags, starts, rows)
    stream = StreamRows(cfg.train_files, "data.train_files", cfg, kind, tokenizer, passes=1)
    _same(list(stream), [TokenRows(split)[i] for i in range(len(split))])
    assert stream.counts["dropped" if overlong == "drop" else "truncated"] > 0


def _resumed_everywhere(make: Any, n: int, cuts: list[int]) -> None:
    """Rows ``0..n`` of one stream equal rows read up to each cut, saved, and continued by a new
    stream loaded from the saved position (through JSON)."""
    expected = list(itertools.islice(iter(make()), n))
    for cut in cuts:
        first = make()
        head = list(itertools.islice(iter(first), cut))
        saved = json.loads(json.dumps(first.state_dict()))
        second = make()
        second.load_state_dict(saved)
        _same(head + list(itertools.islice(iter(second), n - cut)), expected)


@pytest.mark.parametrize("mode", ["text", "packed", "single"])
def test_a_saved_position_continues_exactly(tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Every cut: inside a read, inside a document cut between rows (text rows of 16 tokens,
    documents up to 60), at a pass's end and in the next pass; two ranks, shuffled files (3
    files: every other example each; 4 for packed: whole files each)."""
    monkeypatch.setattr(stream_module, "READ_SIZE", 7)  # many reads, cuts in each
    files = [_corpus(tmp_path / f"{i}.jsonl", 25, 10 + i, longest=60) for i in range(4 if mode == "packed" else 3)]
    cfg = _cfg(tmp_path, files, packing=mode != "single")
    kind = _Examples() if mode == "packed" else data_kind(cfg)
    for rank in (0, 1):

        def make(rank: int = rank) -> StreamRows:
            return StreamRows(cfg.train_files, "data.train_files", cfg, kind, tokenizer, rank=rank, world_size=2, seed=5, shuffle=True)

        one_pass = len(list(StreamRows(cfg.train_files, "data.train_files", cfg, kind, tokenizer, rank=rank, world_size=2, seed=5, shuffle=True, passes=1)))
        n = 2 * one_pass + 3  # into the third pass
        _resumed_everywhere(make, n, sorted(set(range(0, n, 3)) | {one_pass - 1, one_pass, one_pass + 1}))
        if mode == "text":
            cut = make()
            assert any(cut.position.offset for _ in itertools.islice(iter(cut), n)), "some cut falls inside a document"


def test_passes_differ_when_shuffled_and_repeat_when_not(tmp_path: Path, tokenizer: Any) -> None:
    files = [_corpus(tmp_path / f"{i}.jsonl", 10, 20 + i) for i in range(6)]
    cfg = _cfg(tmp_path, files)
    kind = data_kind(cfg)
    for shuffle in (True, False):
        s = StreamRows(cfg.train_files, "w", cfg, kind, tokenizer, seed=1, shuffle=shuffle, passes=2)
        rows = [r["input_ids"].tolist() for r in s]
        assert len(rows) % 2 == 0
        half = len(rows) // 2
        assert (rows[:half] != rows[half:]) == shuffle


def test_the_ranks_read_disjoint_shares(tmp_path: Path, tokenizer: Any) -> None:
    files = [_corpus(tmp_path / f"{i}.jsonl", 30, 30 + i) for i in range(3)]  # 3 files, 2 ranks: every other example
    cfg = _cfg(tmp_path, files, packing=False)
    kind = data_kind(cfg)
    shares = [[tuple(r["input_ids"].tolist()) for r in StreamRows(cfg.train_files, "w", cfg, kind, tokenizer, rank=r, world_size=2, passes=1)] for r in (0, 1)]
    whole = [tuple(r["input_ids"].tolist()) for r in StreamRows(cfg.train_files, "w", cfg, kind, tokenizer, passes=1)]
    assert sorted(shares[0] + shares[1]) == sorted(whole)
    assert abs(len(shares[0]) - len(shares[1])) <= 1


def test_another_world_size_is_refused(tmp_path: Path, tokenizer: Any) -> None:
    from acc_train.errors import UserError

    cfg = _cfg(tmp_path, [_corpus(tmp_path / "a.jsonl", 20, 0)])
    kind = data_kind(cfg)
    saved = StreamRows(cfg.train_files, "w", cfg, kind, tokenizer, rank=0, world_size=2).state_dict()
    with pytest.raises(UserError) as err:
        StreamRows(cfg.train_files, "w", cfg, kind, tokenizer, rank=0, world_size=1).load_state_dict(saved)
    assert err.value.where == "--num-processes"


def test_the_config_refuses_epochs_and_a_stream_without_files() -> None:
    from acc_train.config import load_job
    from acc_train.errors import UserError

    with pytest.raises(UserError, match=r"data.streaming needs training.max_steps, not training.epochs"):
        load_job(sets=["data.streaming=true", "data.train_files=[a.jsonl]", "training.epochs=2"])
    with pytest.raises(UserError, match=r"data.streaming reads data.train_files"):
        load_job(sets=["data.streaming=true"])
    assert load_job(sets=["data.streaming=true", "data.train_files=[a.jsonl]"]).config.max_steps == 300, "the default max_steps serves"


def test_a_token_beyond_the_models_vocabulary_is_a_user_error(tmp_path: Path, tokenizer: Any) -> None:
    from acc_train.errors import UserError

    cfg = _cfg(tmp_path, [_corpus(tmp_path / "a.jsonl", 20, 0)])
    stream = StreamRows(cfg.train_files, "data.train_files", cfg, data_kind(cfg), tokenizer)
    stream.vocab_size = 5
    with pytest.raises(UserError, match="vocab_size is 5"):
        next(iter(stream))


def test_a_share_without_rows_is_a_user_error(tmp_path: Path, tokenizer: Any) -> None:
    from acc_train.errors import UserError

    data = tmp_path / "short.jsonl"
    data.write_text(json.dumps({"text": "a b"}) + "\n")
    cfg = _cfg(tmp_path, [data])
    with pytest.raises(UserError, match="gives no row"):
        next(iter(StreamRows(cfg.train_files, "data.train_files", cfg, data_kind(cfg), tokenizer)))


def test_accumulation_syncs_every_n_micro_batches_without_a_prepared_loader(tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamed loader is not prepared: Accelerate's ``accumulate`` counts the micro-steps
    itself. 3 steps x 2 micro-batches x 2 rows, in one process, with an evaluation between."""
    from acc_train.config import load_job
    from acc_train.trainer import check_output_dir, train
    from accelerate.state import AcceleratorState, GradientState

    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    sets = [f"model.name_or_path={tiny_model_dir}", f"data.train_files=[{tiny_data['train']}]", f"data.eval_files=[{tiny_data['eval']}]"]
    sets += ["data.streaming=true", "data.seq_len=16", "training.micro_batch_size=2", "training.gradient_accumulation_steps=2"]
    sets += ["training.mixed_precision=no", "training.progress_bar=false", "training.eval_every=1", "checkpoint.every=2"]
    job = load_job(flags={"output_dir": (str(tmp_path / "run"), "--output-dir"), "training.max_steps": (3, "--max-steps")}, sets=sets)
    try:
        check_output_dir(job)
        summary = train(job)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert summary["steps"] == 3 and summary["data"]["rows"] == 3 * 2 * 2
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["stream"][0]["taken"] > 0 and len(state["stream"]) == 1


# -- launched runs ----------------------------------------------------------------------------

STREAM_ARGS = ("--set", "data.streaming=true", "--max-steps", "12", "--set", "checkpoint.every=6", "--set", "checkpoint.keep_last=null", "--set", "training.eval_every=6")


@pytest.fixture(scope="module")
def streamed_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_data: dict[str, Path]) -> Path:
    out = tmp_path_factory.mktemp("stream") / "run"
    small = {"train": tiny_data["train_small"], "eval": tiny_data["eval"]}  # several passes in 12 steps
    proc = run_cli(*tiny_job_args(tiny_model_dir, small, out, "--num-processes", "2", *STREAM_ARGS))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.launch
def test_a_streamed_run_resumes_with_the_same_losses_and_refuses_another_world_size(
    streamed_run: Path, tmp_path: Path, tiny_model_dir: Path, tiny_data: dict[str, Path]
) -> None:
    summary = json.loads((streamed_run / "run.json").read_text())
    data = summary["data"]
    assert (data["streaming"], data["kind"], data["packing"], data["cache"]) == (True, "text", True, {"status": "none"})
    assert data["rows"] == 12 * 2 * 4, "12 steps x 2 ranks x micro-batch 4: what this run read"
    assert data["documents"] > 0 and data["tokens"] >= data["rows"] * 16 > data["loss_tokens"] > 0
    assert summary["final_eval_loss"] is not None
    state = json.loads((streamed_run / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert [s["rank"] for s in state["stream"]] == [0, 1] and all(s["world_size"] == 2 for s in state["stream"])
    assert all(s["pass_number"] == 0 and s["taken"] > 0 for s in state["stream"]), "mid-pass at step 6; the next pass begins before step 12"

    small = {"train": tiny_data["train_small"], "eval": tiny_data["eval"]}
    resumed = stopped_copy(streamed_run, tmp_path / "resumed", saved=6, lost=12)
    before = sorted(p.name for p in resumed.rglob("*"))

    refused = run_cli(*tiny_job_args(tiny_model_dir, small, resumed, "--num-processes", "1", *STREAM_ARGS, "--resume", "latest"))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "--num-processes" in refused.stderr and "2 processes" in refused.stderr, refused.stderr[-3000:]
    assert sorted(p.name for p in resumed.rglob("*")) == before, "a refused resume changes nothing"

    proc = run_cli(*tiny_job_args(tiny_model_dir, small, resumed, "--num-processes", "2", *STREAM_ARGS, "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    full, again = read_metrics(streamed_run), read_metrics(resumed)
    assert [s for s in again if s > 6] == list(range(7, 13))
    for step in range(7, 13):
        assert again[step].loss == pytest.approx(full[step].loss, abs=1e-6), step
    assert json.loads((resumed / "run.json").read_text())["final_eval_loss"] == pytest.approx(summary["final_eval_loss"], abs=1e-6)
