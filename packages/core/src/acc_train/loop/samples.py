"""Generation samples at each evaluation (``eval.samples``): every prompt completed by the model
as it stands, under the run's strategy; rank 0 appends the rows to ``samples.jsonl`` and sends
them to the trackers that take text.

How the ranks generate: every rank runs ``generate`` on the same prompts, in lockstep
(``synced_gpus`` with more than one rank, as HF Trainer generates under ZeRO-3). Under a
strategy that shards parameters (FSDP, ZeRO-3) each forward gathers one unit's parameters from
every rank and frees them after, as training's forward does, so no rank ever holds more of the
model than training does; gathering the whole model onto each rank first (TRL's
``unwrap_model_for_generation``) is faster per token but needs the whole model's memory on
every rank, which is what a sharded run exists to avoid. The strategy says which module to call
(:meth:`acc_train.strategy.Strategy.generation_model`); a LoRA model generates through its
adapters (PEFT's ``generate``). All ranks having the same completions, the split needs no
gather, and it works under any mesh (ranks of a tensor- or context-parallel group must run the
same input).

Randomness: ``generate`` samples from torch's global generator. It runs inside
``torch.random.fork_rng``, seeded from ``eval.seed`` (else ``training.seed``), the step and the
prompt's position, so training's random streams (dropout, data order) are exactly as they were
after it, samples are the same for a seed, and an exact resume writes the same samples.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from acc_train.model.prompt_text import decode_tokens, encode_prompt
from acc_train.outputs.samples_file import SAMPLES_FILE, append_rows, read_samples, start_samples_file
from acc_train.outputs.trackers import log_samples

if TYPE_CHECKING:
    from acc_train.config.evaluation import EvalConfig
    from acc_train.run import RunContext

__all__ = ["Samples", "complete", "sample_seed", "samples_summary"]


def sample_seed(seed: int, step: int, index: int) -> int:
    """The seed of prompt ``index``'s sampling at ``step``: the same on every rank and in a
    resumed run, different for each prompt and evaluation."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{index}".encode()).digest()[:8], "big") >> 1


@contextlib.contextmanager
def _own_rng(device: Any, seed: int) -> Iterator[None]:
    """torch's generators (CPU, and the run's device) seeded with ``seed`` inside, as they were after."""
    import torch

    devices = [device.index or 0] if device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield


def _decoding(settings: EvalConfig) -> dict[str, Any]:
    """``generate``'s decoding arguments, each given so the model's own generation config
    (a chat model's ``do_sample: true``, say) never decides them."""
    if settings.temperature > 0:
        return {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
    return {"do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 50}  # (the neutral values: no warnings)


def complete(
    accelerator: Any, model: Any, strategy: Any, tokenizer: Any, prompts: Sequence[Any], ids: Sequence[list[int]], settings: EvalConfig, seed: int, step: int
) -> list[dict[str, Any]]:
    """Generate a completion of every prompt (``ids``: their tokens) on every rank; returns the
    rows of ``samples.jsonl``. The model is in eval mode meanwhile, and back in train mode after."""
    import torch

    device = accelerator.device
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    pad = pad if pad is not None else eos if eos is not None else 0
    special = {"pad_token_id": pad, **({"eos_token_id": eos} if eos is not None else {})}
    rows: list[dict[str, Any]] = []
    model.eval()
    try:
        with strategy.generation_model(accelerator, model) as generator, torch.no_grad(), accelerator.autocast():
            for index, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
                x = torch.tensor([prompt_ids], dtype=torch.long, device=device)
                with _own_rng(device, sample_seed(seed, step, index)):
                    start = time.perf_counter()
                    out = generator.generate(
                        x, attention_mask=torch.ones_like(x), max_new_tokens=settings.max_new_tokens, use_cache=True,
                        synced_gpus=accelerator.num_processes > 1, **_decoding(settings), **special,
                    )  # fmt: skip
                    seconds = time.perf_counter() - start
                new = [int(t) for t in out[0, len(prompt_ids) :].tolist()]
                rows.append(
                    {
                        "step": step,
                        "index": index,
                        "prompt": prompt,
                        "completion": decode_tokens(tokenizer, new),
                        "new_tokens": len(new),
                        "tokens_per_s": round(len(new) / seconds, 2) if seconds > 0 else None,
                    }
                )
    finally:
        model.train()
    return rows


class Samples:
    """One run's samples: the prompts tokenized once (a prompt that cannot be is refused before
    the first step), and on rank 0 the file the rows are appended to."""

    def __init__(self, run: RunContext, resumed_step: int) -> None:
        cfg = run.config
        self.run = run
        self.prompts = [p if isinstance(p, str) else [m.model_dump() for m in p] for p in cfg.eval.samples]
        self._fd: int | None = None
        if not self.prompts:
            if run.is_main_process and resumed_step and (run.output_dir / SAMPLES_FILE).is_file():
                os.close(start_samples_file(run.output_dir / SAMPLES_FILE, resumed_step))  # steps it redoes have none now
            return
        from acc_train.model.build import load_tokenizer

        self.tokenizer = load_tokenizer(cfg.model)
        self.ids = [encode_prompt(self.tokenizer, p, where=f"eval.samples[{i}]") for i, p in enumerate(self.prompts)]
        self.seed = cfg.eval.seed if cfg.eval.seed is not None else cfg.training.seed
        if run.is_main_process:
            self._fd = start_samples_file(run.output_dir / SAMPLES_FILE, resumed_step)

    @property
    def active(self) -> bool:
        return bool(self.prompts)

    def at_evaluation(self, step: int) -> None:
        """Generate every prompt's completion (every rank); rank 0 writes and logs the rows."""
        if not self.prompts:
            return
        run = self.run
        rows = complete(run.accelerator, run.model, run.job.strategy, self.tokenizer, self.prompts, self.ids, run.config.eval, self.seed, step)
        if self._fd is not None:
            append_rows(self._fd, rows)
            if run.config.training.report_to:
                log_samples(run.accelerator, step, rows)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def samples_summary(run: RunContext) -> dict[str, Any] | None:
    """``run.json``'s ``samples``: the file and the last evaluation's completions (main
    process; None without ``eval.samples``)."""
    if not run.config.eval.samples:
        return None
    rows = read_samples(run.output_dir) if run.is_main_process else []
    step = max((row["step"] for row in rows), default=None)
    return {"file": SAMPLES_FILE, "step": step, "last": [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows if r["step"] == step]}
