"""The baseline: a plain, hand-written Accelerate loop (prepare / backward / step).

Same model, data, seed, batch and optimizer as acc-train's demo job, so the two differ only in
the loop around them. Launch with ``torchrun --standalone --nproc-per-node N``; writes a JSON
summary (step time, peak memory per rank, losses) to ``--out``.

Usage: torchrun --standalone --nproc-per-node 2 bench/handwritten_loop.py --steps 60 --out hw.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, gather_object, set_seed
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

from acc_train.config import DataConfig
from acc_train.data import load_blocks
from acc_train.model import DEMO_MODEL_CONFIG

WARMUP_STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[DistributedDataParallelKwargs()])
    set_seed(args.seed)
    train_blocks, _ = load_blocks(DataConfig(seq_len=args.seq_len, eval_fraction=0.0), tokenizer=None)
    model = LlamaForCausalLM(LlamaConfig(**DEMO_MODEL_CONFIG))
    g = torch.Generator()
    g.manual_seed(args.seed)
    loader = DataLoader(train_blocks, batch_size=args.micro_batch_size, shuffle=True, drop_last=True, generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=args.steps // 10, num_training_steps=args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    model.train()
    losses, step_times = [], []
    step = 0
    t_prev = time.perf_counter()
    while step < args.steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            step += 1
            now = time.perf_counter()
            if step > WARMUP_STEPS:
                step_times.append(now - t_prev)
            t_prev = now
            if step >= args.steps:
                break

    mine = {"rank": accelerator.process_index, "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available():
        mine["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
    per_rank = sorted(gather_object([mine]), key=lambda r: r["rank"])
    if accelerator.is_main_process:
        with open(args.out, "w") as f:
            json.dump(
                {"step_time_s": statistics.median(step_times), "per_rank": per_rank, "losses": losses, "world_size": accelerator.num_processes},
                f,
            )


if __name__ == "__main__":
    main()
