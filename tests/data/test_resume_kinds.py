"""Chat fine-tuning with packing, through the command: the cache is built by the first launch and
hit by the next, run.json says what was trained on, and a run stopped after step 6 and resumed
gives the losses of the uninterrupted run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_cli, stopped_copy
from tests.data.conftest import CHATML, CORPUS_WORDS, train_tokenizer

pytestmark = [pytest.mark.launch, pytest.mark.xdist_group("chat-runs")]


@pytest.fixture(scope="module")
def chat_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("chat")
    model = root / "model"
    tok = train_tokenizer(CHATML)
    tok.save_pretrained(model)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=128, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(model)
    rng = random.Random(3)
    data = root / "chat.jsonl"
    with data.open("w") as fh:
        for _ in range(240):
            turns = []
            if rng.random() < 0.3:
                turns.append({"role": "system", "content": " ".join(rng.choices(CORPUS_WORDS, k=4))})
            for _ in range(rng.randint(1, 2)):
                turns.append({"role": "user", "content": " ".join(rng.choices(CORPUS_WORDS, k=rng.randint(2, 8)))})
                turns.append({"role": "assistant", "content": " ".join(rng.choices(CORPUS_WORDS, k=rng.randint(1, 10)))})
            fh.write(json.dumps({"messages": turns}) + "\n")
    return {"model": model, "data": data, "root": root}


def _args(assets: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        "--strategy", "ddp", "--num-processes", "2",
        "--set", f"model.name_or_path={assets['model']}", "--set", f"data.train_files=[{assets['data']}]",
        "--set", "data.kind=chat", "--set", "data.packing=true", "--set", "data.seq_len=64", "--set", "data.eval_fraction=0",
        "--set", f"data.cache_dir={assets['root'] / 'cache'}",
        "--micro-batch-size", "2", "--max-steps", "12", "--mixed-precision", "no", "--seed", "5",
        "--set", "checkpoint.every=6", "--set", "checkpoint.keep_last=null", "--set", "training.progress_bar=false",
        "--output-dir", str(out), *extra,
    ]  # fmt: skip


def test_chat_with_packing_resumes_exactly_from_the_cache(chat_assets: dict[str, Path], tmp_path: Path) -> None:
    full = tmp_path / "full"
    proc = run_cli(*_args(chat_assets, full))
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((full / "run.json").read_text())
    data = summary["data"]
    assert (data["kind"], data["packing"], data["streaming"]) == ("chat", True, False)
    assert data["cache"]["status"] == "built", "the first launch tokenizes"
    assert 0 < data["loss_tokens"] < data["tokens"], "system and user tokens are not in the loss"
    assert data["documents"] == 240 and data["setup_s"] > 0

    resumed = stopped_copy(full, tmp_path / "resumed", saved=6, lost=12)
    proc = run_cli(*_args(chat_assets, resumed, "--resume", "latest"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads((resumed / "run.json").read_text())["data"]
    assert again["cache"] == {"status": "hit", "path": data["cache"]["path"]}, "a resume maps the cache the first launch built"
    a, b = read_metrics(full), read_metrics(resumed)
    assert [b[s].loss for s in range(7, 13)] == pytest.approx([a[s].loss for s in range(7, 13)], abs=1e-6)
