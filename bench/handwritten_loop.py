"""The baselines: hand-written loops of one strategy each, with no Accelerate and no acc-train.

``--strategy ddp``: torch ``DistributedDataParallel``; ``fsdp``: FSDP2, ``fully_shard`` as
Accelerate 1.16 wraps the model for acc-train's ``fsdp`` (every decoder layer, the input
embedding, the final norm and output head as one group, then the root; fp32); ``zero3``: ``deepspeed.initialize``
with the DeepSpeed config acc-train generates for ``--strategy zero3`` (:func:`ds_config`). The job is acc-train's demo job, rebuilt here so that nothing of
acc-train is imported: the demo Llama (seeded as acc-train seeds it), the standard library's
sources as bytes in blocks of ``--seq-len``, the batches in acc-train's order (a permutation
seeded by seed + epoch, batches dealt round-robin to the ranks, as Accelerate shards them),
AdamW with no weight decay on norms and biases, a cosine schedule with 10% warm-up, clipping at
1.0, and the loss as acc-train computes it: the sum of the token losses over the number of
tokens the step counts on all ranks (one all-reduce), summed over ranks for the log every step
(acc-train logs it every step by default).

Timing: the wall clock of whole iterations, from the end of the previous step to the end of
this one (batch fetch, forward, backward, clipping, optimizer and scheduler steps, reducing the
loss); the first 3 steps are left out. Peak memory: the process's own peak RSS (``VmHWM``, as
acc-train's run.json reports it; ``ru_maxrss`` where /proc is missing) on CPU, or
``max_memory_allocated`` (GPU) right after the last step.

On CUDA (``--device cuda``, the default where a GPU is visible) each rank takes its local GPU
and NCCL, and the loop is what a hand-written GPU loop is: the fp32 model on the GPU, bf16
autocast around the forward (``--mixed-precision bf16``: as Accelerate's bf16, the master weights
and the optimizer stay fp32) and fused AdamW (``fused=True``, acc-train's choice on CUDA). Elsewhere
it runs on CPU with gloo and torch's default AdamW, as before. ``--model-config JSON`` overrides keys of
the demo model's config and ``--max-bytes`` the demo corpus's size (acc-train's
``model.config`` and ``data.demo_max_bytes``): the device check trains acc-train's ~1B job here.

Launch with ``torchrun --standalone --nproc-per-node N``, or one process as plain ``python``
(world size 1: torchrun's variables filled in where they are missing, an in-memory store, no
rendezvous); rank 0 writes a JSON summary (median step time, whole-run tokens per second, peak
memory per rank, losses) to ``--out``, atomically (a temporary file renamed into place), so a
reader that sees the file sees all of it.

Exit: once the summary is written the ranks meet, destroy the process group and end through
``os._exit(0)``, as acc-train's workers do: a normal interpreter exit ran the destructors of
torch's and DeepSpeed's threads and sometimes died on them (SIGABRT, "terminate called without an
active exception") or hung in a futex, after the result was written.

Usage: torchrun --standalone --nproc-per-node 2 bench/handwritten_loop.py --strategy fsdp --steps 60 --out hw.json
       python bench/handwritten_loop.py --strategy zero3 --steps 20 --out hw.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

WARMUP_STEPS = 3
#: read the losses back every this many steps (acc-train's training.read_every default, torchtitan's log_freq)
READ_EVERY = 10

#: acc_train.model.build.DEMO_MODEL_CONFIG (copied: importing acc_train would weigh on the baseline)
DEMO_MODEL_CONFIG = {
    "vocab_size": 256, "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 3,
    "num_attention_heads": 6, "num_key_value_heads": 6, "max_position_embeddings": 1024,
    "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}  # fmt: skip
DEMO_MAX_BYTES = 1_500_000


def ds_config(micro_batch_size: int, max_grad_norm: float) -> dict:
    """The DeepSpeed config acc-train hands DeepSpeed for ``--strategy zero3`` in fp32, as
    Accelerate completes it (read from ``accelerator.state.deepspeed_plugin.deepspeed_config``
    after ``prepare`` in a 2-process CPU run; ``zero3_init_flag`` is off, so the model is built
    whole and partitioned by ``deepspeed.initialize``, as here)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False},
        "steps_per_print": math.inf,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
    }


def demo_blocks(seq_len: int, max_bytes: int = DEMO_MAX_BYTES) -> torch.Tensor:
    """acc-train's demo corpus: the standard library's ``*.py`` in name order, as bytes."""
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    raw = b"\n".join(chunks)[:max_bytes]
    n = len(raw) // seq_len
    return torch.tensor(list(raw[: n * seq_len]), dtype=torch.long).view(n, seq_len)


def rank_batches(blocks: torch.Tensor, epoch: int, seed: int, mbs: int, rank: int, world: int):
    """This rank's batches of one epoch, in acc-train's order."""
    usable = len(blocks) - len(blocks) % (world * mbs)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order = torch.randperm(len(blocks), generator=g)[:usable]
    for i in range(rank, usable // mbs, world):
        yield blocks[order[i * mbs : (i + 1) * mbs]]


def optimizer_for(model: torch.nn.Module, lr: float, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW with acc-train's groups; ``fused`` (CUDA) as acc-train builds it there, else torch's default."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    impl = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **impl)


def default_to_one_process() -> None:
    """Started as plain ``python`` (none of torchrun's variables): world size 1, with the
    variables torchrun would set, since DeepSpeed and the device lookup read them."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:  # a free port, in case anything rendezvouses over TCP after all
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in defaults.items():
        os.environ.setdefault(name, value)


def write_atomically(path: Path, text: str) -> None:
    """``path`` replaced in one step: a reader (bench_loop.py polls for it) never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=["ddp", "fsdp", "zero3"], default="ddp")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--model-config", default="{}", help="JSON: keys of the demo model's config to override")
    parser.add_argument("--max-bytes", type=int, default=DEMO_MAX_BYTES, help="size of the demo corpus")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--mixed-precision", choices=["no", "bf16"], default="no", help="bf16: autocast around the forward")
    parser.add_argument(
        "--optimizer", choices=["torch", "ds-fused-adam"], default="torch",
        help="ds-fused-adam: DeepSpeed's FusedAdam (its CUDA op, built on first use), with --strategy zero3",
    )  # fmt: skip
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.optimizer == "ds-fused-adam" and args.strategy != "zero3":
        parser.error("--optimizer ds-fused-adam goes with --strategy zero3")

    default_to_one_process()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # one process has no one to meet: an in-memory store, no TCP rendezvous (as a
        # single-GPU loop starts, with or without torchrun's variables)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda text: print(f"handwritten_loop: {text}", flush=True)) if rank == 0 else (lambda text: None)
    say(f"{backend} process group of {world}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)
    blocks = demo_blocks(args.seq_len, args.max_bytes)
    model = LlamaForCausalLM(LlamaConfig(**{**DEMO_MODEL_CONFIG, **json.loads(args.model_config)})).to(device)
    say(f"model of {sum(p.numel() for p in model.parameters()):,} parameters on {device}, {len(blocks)} blocks of {args.seq_len}")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16")
    engine = None
    if args.strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    elif args.strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # Accelerate 1.16's FSDP2 wrapping (fsdp2_prepare_model): each decoder layer; the input
        # embedding; the tail [final norm, output head] as one group kept gathered after forward;
        # then the root, with torch's default for it
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=True)
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        tied = embed.weight is head.weight
        if not tied:
            fully_shard(embed, reshard_after_forward=True)
        fully_shard([model.model.norm, embed, head] if tied else [model.model.norm, head], reshard_after_forward=False)
        fully_shard(model)
    optimizer = optimizer_for(model, lr=1e-3, fused=cuda and args.strategy != "zero3")
    if args.strategy == "zero3":
        import deepspeed

        if args.optimizer == "ds-fused-adam":
            from deepspeed.ops.adam import FusedAdam

            optimizer = FusedAdam(optimizer.param_groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=True)

        config = ds_config(args.micro_batch_size, args.max_grad_norm)
        config["bf16"]["enabled"] = args.mixed_precision == "bf16"
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        model = engine
    scheduler = get_scheduler("cosine", optimizer=optimizer, num_warmup_steps=math.ceil(0.1 * args.steps), num_training_steps=args.steps)

    model.train()
    losses, step_times = [], []
    held: list = []  # the losses of the steps since the last read
    step = epoch = 0
    t_prev = t_start = time.perf_counter()
    while step < args.steps:
        for batch in rank_batches(blocks, epoch, args.seed, args.micro_batch_size, rank, world):
            # the loss as acc-train (and transformers' Trainer) defines it: the mean over every token
            # the step counts, on all ranks (sum of token losses over the all-reduced count)
            batch = batch.to(device, non_blocking=True)
            counted = torch.tensor(batch[:, 1:].numel(), device=device)
            dist.all_reduce(counted)
            with autocast:
                logits = model(input_ids=batch, use_cache=False).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1), reduction="sum") / counted
            if engine is not None:  # DeepSpeed clips (gradient_clipping) and zeroes the gradients itself
                engine.backward(loss * world)  # ranks' gradients are averaged
                engine.step()
            else:
                (loss * world).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            mean = loss.detach().float()
            dist.all_reduce(mean)
            held.append(mean)  # on the device until the next read, as acc-train holds its steps
            step += 1
            if step % READ_EVERY == 0 or step == args.steps:  # one host read per READ_EVERY steps
                losses.extend(torch.stack(held).tolist())
                held = []
            if step == args.steps:
                say(f"step {step} loss {losses[-1]:.4f}")
            now = time.perf_counter()
            if step > WARMUP_STEPS:
                step_times.append(now - t_prev)
            t_prev = now
            if step >= args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - t_start

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if os.path.exists("/proc/self/status"):  # the process image's own peak, as acc-train's run.json
        with open("/proc/self/status") as f:
            peak = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), peak)
    if cuda:
        peak = int(torch.cuda.max_memory_allocated())
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, "peak_memory_bytes": peak})
    if rank == 0:
        write_atomically(
            Path(args.out),
            json.dumps({
                "strategy": args.strategy, "step_time_s": statistics.median(step_times), "per_rank": per_rank, "losses": losses, "world_size": world,
                "device": device.type, "mixed_precision": args.mixed_precision,
                "tokens_per_s": args.steps * args.micro_batch_size * args.seq_len * world / elapsed, "elapsed_s": elapsed,
            })  # fmt: skip
        )
    say(f"done: {args.out}")
    # the ranks leave together, and the process group goes before the interpreter does
    dist.barrier()
    try:
        dist.destroy_process_group()
    except Exception as exc:  # the result is written; a teardown error must not lose it
        print(f"handwritten_loop: rank {rank}: destroy_process_group failed: {exc!r}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
    # no interpreter teardown (see the module's docstring): flush what was printed, then go
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
