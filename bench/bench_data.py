"""Data at size: acc-train's tokenize-once cache against a plain ``datasets.map``, memory per rank
on a large corpus against a small one, the second launch's set-up against the first, and padded
against packed rows on short instruction examples.

Everything is made here: a JSONL corpus of ``--gb`` gigabytes (synthetic words with a Zipf
distribution, documents of 30 to 400 words), a 10 MB corpus of the same kind, 20,000 short
prompt/completion examples, a byte-level BPE tokenizer (8,192 tokens) trained on a sample, and
a small Llama (4 layers, hidden 256).

1. ``tokenize``: tokens per second of a plain ``datasets.load_dataset`` + ``map(batched=True,
   num_proc=cores)`` tokenization of the corpus (the span: loading the files to having the
   tokens), against acc-train's preparation of the same files in the first launch (its
   ``build_s`` in the cache's ``meta.json``: loading, tokenizing and writing the arrays).
2. ``rss``: each rank's peak RSS (``run.json`` ``per_rank.peak_memory_bytes``) training 2 ranks
   for ``--steps`` steps on the large corpus against the same job on the 10 MB corpus.
3. ``setup``: ``run.json`` ``data.setup_s`` (launch to first batch) of the second launch on the
   large corpus (cache hit) against the first (cache built).
4. ``padding``: the same instruction job (``kind: prompt_completion``) with ``packing: false``
   (padded per batch), ``packing: true`` (next-fit) and ``packing: best_fit`` (best-fit
   decreasing): real (non-padding) tokens per second, from the mean step time, the share of
   padding in the batches the run read (replayed from the sampler), and the rows' fill.

Usage: python bench/bench_data.py [--gb 2.0] [--workdir DIR] [--steps 30] [--parts tokenize rss setup padding]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

SEQ_LEN = 256
MICRO_BATCH = 8


def cores() -> int:
    return len(os.sched_getaffinity(0))


def make_words(n: int, rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(n)]


def write_corpus(path: Path, target_bytes: int, seed: int) -> int:
    """JSONL documents until ``target_bytes``: a 64 MB block of unique documents, written again
    with fresh document ids (tokenizers cache words, not documents, so repetition helps neither side)."""
    rng = random.Random(seed)
    words = make_words(20_000, rng)
    weights = [1.0 / (i + 1) for i in range(len(words))]
    block: list[str] = []
    size = 0
    while size < min(target_bytes, 64 * 2**20):
        doc = " ".join(rng.choices(words, weights, k=rng.randint(30, 400)))
        line = json.dumps({"text": doc})
        block.append(line)
        size += len(line) + 1
    written, docs = 0, 0
    with path.open("w") as fh:
        while written < target_bytes:
            for line in block:
                fh.write(line[:-2] + f' #{docs}"}}\n')
                written += len(line) + 8
                docs += 1
                if written >= target_bytes:
                    break
    return docs


def write_instructions(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    words = make_words(5_000, rng)
    with path.open("w") as fh:
        for _ in range(n):
            prompt = "Question: " + " ".join(rng.choices(words, k=rng.randint(3, 20))) + "\nAnswer:"
            completion = " " + " ".join(rng.choices(words, k=rng.randint(2, 30)))
            fh.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")


def make_model(model_dir: Path, sample: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<pad>", "</s>"])

    def lines():
        with sample.open() as fh:
            for i, line in enumerate(fh):
                if i >= 20_000:
                    return
                yield json.loads(line)["text"]

    tok.train_from_iterator(lines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(model_dir)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=SEQ_LEN, eos_token_id=1, pad_token_id=0)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(model_dir)


def plain_datasets_tokenize(files: list[Path], model_dir: Path, work: Path) -> dict:
    """The baseline: what a user writes with ``datasets`` alone."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", cache_dir=str(work / "hf"))
    out = ds.map(lambda b: tok(b["text"], add_special_tokens=False), batched=True, num_proc=cores(), remove_columns=ds.column_names)
    elapsed = time.perf_counter() - t0
    tokens = 0
    for batch in out.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=50_000):
        tokens += len(batch.column(0).combine_chunks().flatten())
    shutil.rmtree(work / "hf", ignore_errors=True)
    return {"tokens": tokens, "seconds": round(elapsed, 2), "tokens_per_s": tokens / elapsed}


def train(out: Path, model_dir: Path, files: list[Path], cache: Path, steps: int, *extra: str) -> dict:
    cmd = [
        sys.executable, "-m", "acc_train_cli", "--strategy", "ddp", "--num-processes", "2",
        "--set", f"model.name_or_path={model_dir}", "--set", f"data.train_files=[{','.join(map(str, files))}]",
        "--set", f"data.seq_len={SEQ_LEN}", "--set", "data.eval_fraction=0", "--set", f"data.cache_dir={cache}",
        "--micro-batch-size", str(MICRO_BATCH), "--max-steps", str(steps), "--mixed-precision", "no",
        "--set", "checkpoint.every=0", "--set", "training.progress_bar=false", "--output-dir", str(out), "--overwrite", *extra,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"training failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "run.json").read_text())


def replay_padding(model_dir: Path, files: list[Path], cache: Path, steps: int, packing: bool | str) -> dict:
    """Real and padded positions of the batches the run read: the sampler's order, cut into the
    micro-batches Accelerate hands the 2 ranks in turn, each padded as the collator pads it."""
    from transformers import AutoTokenizer

    from acc_train.config.schema import DataConfig
    from acc_train.data import ResumableSampler, prepare_data

    cfg = DataConfig(train_files=[str(f) for f in files], seq_len=SEQ_LEN, kind="prompt_completion", packing=packing, cache_dir=str(cache), eval_fraction=0)
    prepared = prepare_data(cfg, AutoTokenizer.from_pretrained(model_dir))
    rows = prepared.train.rows
    order = list(iter(ResumableSampler(len(rows), 42, True, group=2 * MICRO_BATCH)))[: steps * 2 * MICRO_BATCH]
    real = padded = 0
    for b in range(0, len(order), MICRO_BATCH):
        lengths = [int(rows[i][1] - rows[i][0]) for i in order[b : b + MICRO_BATCH]]
        width = SEQ_LEN if packing else max(lengths)
        real += sum(lengths)
        padded += width * len(lengths)
    return {"real_tokens": real, "positions": padded, "padding_share": 1 - real / padded, "rows": len(rows), "packing_efficiency": prepared.packing_efficiency()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/acc-train-bench-data"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--parts", nargs="+", default=["tokenize", "rss", "setup", "padding"])
    args = ap.parse_args()
    w = args.workdir
    w.mkdir(parents=True, exist_ok=True)
    big, small, inst, model = w / "big.jsonl", w / "small.jsonl", w / "instructions.jsonl", w / "model"
    if not big.exists() or big.stat().st_size < args.gb * 1e9:
        t0 = time.perf_counter()
        docs = write_corpus(big, int(args.gb * 1e9), seed=0)
        print(f"corpus: {big.stat().st_size / 1e9:.2f} GB, {docs} documents, written in {time.perf_counter() - t0:.0f} s", flush=True)
    if not small.exists():
        write_corpus(small, 10 * 2**20, seed=1)
    if not inst.exists():
        write_instructions(inst, 20_000, seed=2)
    if not (model / "config.json").exists():
        make_model(model, small)
    print(f"machine: {platform.processor() or platform.machine()}, {cores()} cores, python {platform.python_version()}", flush=True)
    results: dict = {"gb": round(big.stat().st_size / 1e9, 3)}
    if "tokenize" in args.parts or "setup" in args.parts or "rss" in args.parts:
        base = plain_datasets_tokenize([big], model, w) if "tokenize" in args.parts else None
        cache = w / "cache-big"
        if "tokenize" in args.parts or "setup" in args.parts:  # the first launch builds the cache
            shutil.rmtree(cache, ignore_errors=True)
        first = train(w / "run-big-1", model, [big], cache, args.steps)
        meta = json.loads((Path(first["data"]["cache"]["path"]) / "meta.json").read_text())
        second = train(w / "run-big-2", model, [big], cache, args.steps)
        if base is not None:
            ours = meta["train"]["tokens"] / meta["build_s"]
            results["tokenize"] = {"datasets_map": base, "acc_train": {"tokens": meta["train"]["tokens"], "seconds": meta["build_s"], "tokens_per_s": ours},
                                   "ratio": ours / base["tokens_per_s"]}  # fmt: skip
            print(f"tokenize: plain datasets.map {base['tokens_per_s']:,.0f} tokens/s, acc-train {ours:,.0f} tokens/s (x{ours / base['tokens_per_s']:.2f})", flush=True)
        if "setup" in args.parts:
            results["setup"] = {"first_s": first["data"]["setup_s"], "first_cache": first["data"]["cache"]["status"],
                              "second_s": second["data"]["setup_s"], "second_cache": second["data"]["cache"]["status"],
                              "ratio": second["data"]["setup_s"] / first["data"]["setup_s"]}  # fmt: skip
            print(f"setup: first launch {first['data']['setup_s']:.1f} s ({first['data']['cache']['status']}), second {second['data']['setup_s']:.1f} s ({second['data']['cache']['status']}): {results['setup']['ratio']:.1%}", flush=True)
        small_run = train(w / "run-small", model, [small], w / "cache-small", args.steps)
        rss_big = [r["peak_memory_bytes"] for r in second["per_rank"]]
        rss_small = [r["peak_memory_bytes"] for r in small_run["per_rank"]]
        results["rss"] = {"big": rss_big, "small": rss_small, "ratio": max(b / s for b, s in zip(rss_big, rss_small)),
                          "big_rows": second["data"]["rows"], "small_rows": small_run["data"]["rows"]}  # fmt: skip
        print(f"rss per rank: {[f'{b / 2**20:.0f}' for b in rss_big]} MiB on {results['gb']} GB vs {[f'{s / 2**20:.0f}' for s in rss_small]} MiB on 10 MB: ratio {results['rss']['ratio']:.3f}", flush=True)
    if "padding" in args.parts:
        rows = {}
        for packing in (False, True, "best_fit"):
            name = {False: "padded", True: "packed", "best_fit": "best_fit"}[packing]
            value = packing if isinstance(packing, str) else str(packing).lower()
            run = train(w / f"run-{name}", model, [inst], w / "cache-inst", args.steps, "--set", "data.kind=prompt_completion", "--set", f"data.packing={value}")
            pad = replay_padding(model, [inst], w / "cache-inst", args.steps, packing)
            per_step = pad["real_tokens"] / args.steps
            rows[name] = {**pad, "step_time_s": run["step_time_s"], "real_tokens_per_s": per_step / run["step_time_s"], "loss_tokens": run["data"]["loss_tokens"]}
            print(f"{name}: {rows[name]['real_tokens_per_s']:,.0f} real tokens/s, padding {pad['padding_share']:.1%}, step {run['step_time_s'] * 1000:.0f} ms", flush=True)
        rows["packed_over_padded"] = rows["packed"]["real_tokens_per_s"] / rows["padded"]["real_tokens_per_s"]
        rows["best_fit_over_packed"] = rows["best_fit"]["real_tokens_per_s"] / rows["packed"]["real_tokens_per_s"]
        print(f"best_fit: {rows['best_fit']['rows']} rows against next-fit's {rows['packed']['rows']}, "
              f"{rows['best_fit']['packing_efficiency']:.1%} full against {rows['packed']['packing_efficiency']:.1%}", flush=True)
        results["padding"] = rows
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
