"""The kit's launches: the tiniest model and data, one run per strategy and one resume of it.

Launching 2 worker processes costs 10-17 s of start-up on a small machine, so each strategy gets
exactly one uninterrupted run and one resumed copy of it, cached for the session; a launch that
fails is cached too, so every test that needs it fails with the same message instead of
relaunching.
"""

from __future__ import annotations

import json
import importlib.util
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KIT_STEPS", "KIT_RESUME_STEP", "WORDS", "KitAssets", "KitLaunchError", "KitRuns", "build_tiny_assets", "kit_group", "save_tiny_model"]

#: optimizer steps of the kit's job; it checkpoints at the middle and at the end
KIT_STEPS = 12
KIT_RESUME_STEP = 6

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small models train on two tiny "
    "processes and every step must match exactly after resume with the same batches"
).split()


class KitLaunchError(AssertionError):
    """``acc-train`` exited non-zero for the kit's job; carries the end of its stderr."""


@dataclass(frozen=True)
class KitAssets:
    model_dir: Path
    train_file: Path
    eval_file: Path


def save_tiny_model(model_dir: Path) -> Path:
    """The tiniest Llama (1 layer, hidden size 32, attention dropout on, so an exact resume
    must restore every rank's RNG) and a word-level tokenizer over :data:`WORDS`, saved with
    ``save_pretrained`` into ``model_dir``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(model_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_dropout=0.1,
        eos_token_id=1,
        bos_token_id=None,
        pad_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)
    return model_dir


def build_tiny_assets(root: Path) -> KitAssets:
    """:func:`save_tiny_model` and jsonl word salad over its vocabulary: about 7 optimizer
    steps an epoch at 2 ranks x 4 sequences of 16 tokens, so the kit's job crosses an epoch."""
    model_dir = save_tiny_model(root / "tiny-model")
    rng = random.Random(0)
    files = {}
    for split, n in (("train", 60), ("eval", 40)):
        path = root / f"{split}.jsonl"
        with path.open("w") as f:
            for _ in range(n):
                f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))}) + "\n")
        files[split] = path
    return KitAssets(model_dir, files["train"], files["eval"])


#: what ``StrategyPlanner.equivalent_to_ddp`` promises to match: the kit compares losses with its runs
REFERENCE_STRATEGY = "ddp"


def kit_group(strategy_name: str) -> str:
    """The ``xdist_group`` of a strategy's kit tests. Strategies declaring DDP equivalence share
    one group, so the DDP run they are compared with is launched once."""
    from acc_train.config import resolve_strategy

    try:
        equivalent = strategy_name == REFERENCE_STRATEGY or resolve_strategy(strategy_name).planner().equivalent_to_ddp()
    except Exception:  # an unknown or broken strategy: its own tests report why
        equivalent = False
    return "acc-train-kit-ddp-equivalent" if equivalent else f"acc-train-kit-{strategy_name}"


class KitRuns:
    """The session's kit launches, by strategy name."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._assets: KitAssets | None = None
        self._done: dict[tuple[str, str], Path | KitLaunchError] = {}

    @property
    def assets(self) -> KitAssets:
        if self._assets is None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._assets = build_tiny_assets(self.root)
        return self._assets

    def job_args(self, strategy_name: str, out: Path, *extra: str) -> list[str]:
        """``acc-train`` arguments of the kit's job: tiny, fp32, 2 CPU processes, seeded; the
        randomly initialised tiny model trains at the demo's learning rate (its loss must fall)."""
        a = self.assets
        return [
            "--strategy", strategy_name,
            "--num-processes", "2",
            "--set", f"model.name_or_path={a.model_dir}",
            "--lr", "1e-3",
            "--set", f"data.train_files=[{a.train_file}]",
            "--set", f"data.eval_files=[{a.eval_file}]",
            "--set", "data.seq_len=16",
            "--micro-batch-size", "4",
            "--mixed-precision", "no",
            "--seed", "7",
            "--max-steps", str(KIT_STEPS),
            "--set", f"checkpoint.every={KIT_RESUME_STEP}",
            "--set", "checkpoint.keep_last=null",
            "--set", f"training.eval_every={KIT_RESUME_STEP}",
            "--set", "training.progress_bar=false",
            "--output-dir", str(out),
            *extra,
        ]  # fmt: skip

    def full(self, strategy_name: str) -> Path:
        """The uninterrupted run of the kit's job under ``strategy_name``."""
        return self._once(strategy_name, "run", lambda out: self._launch(self.job_args(strategy_name, out)))

    def resumed(self, strategy_name: str) -> Path:
        """A copy of :meth:`full` as if killed after step ``KIT_RESUME_STEP``'s checkpoint,
        continued with ``--resume latest``."""
        full = self.full(strategy_name)

        def make(out: Path) -> None:
            shutil.copytree(full, out)
            step = f"step-{KIT_RESUME_STEP:06d}"
            for later in (out / "checkpoints").glob("step-*"):
                if later.name > step:
                    shutil.rmtree(later)
            shutil.rmtree(out / "final")
            (out / "run.json").unlink()
            (out / "checkpoints" / "latest").write_text(step + "\n")
            self._launch(self.job_args(strategy_name, out, "--resume", "latest"))

        return self._once(strategy_name, "resumed", make)

    def _once(self, strategy_name: str, kind: str, make: object) -> Path:
        key = (strategy_name, kind)
        if key not in self._done:
            out = self.root / f"{_safe(strategy_name)}-{kind}"
            if out.exists():
                shutil.rmtree(out)
            try:
                make(out)  # type: ignore[operator]
                self._done[key] = out
            except KitLaunchError as exc:
                self._done[key] = exc
        done = self._done[key]
        if isinstance(done, KitLaunchError):
            raise done
        return done

    def _launch(self, args: list[str]) -> None:
        if importlib.util.find_spec("acc_train_cli") is None:  # core never imports the CLI: it launches it
            raise KitLaunchError("the conformance kit launches the `acc-train` command: pip install acc-train-cli")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "acc_train_cli", *args], capture_output=True, text=True, env=env, timeout=900
        )
        if proc.returncode != 0:
            raise KitLaunchError(
                f"`acc-train {' '.join(args[:4])} ...` exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
            )


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
