"""An HF Trainer script as users write it, nothing of acc-train in it: ``trainer_train.py MODEL OUT``.

Trains 6 steps saving at 3 and 6, then a new Trainer resumes from checkpoint-3 (as a restarted
job does). Rank 0 prints one ``RESULT {json}`` line: the trainers' own strategy flags, what each
rank holds of the parameters, the steps each trainer ran, and the losses by step.
"""

import json
import os
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

model_dir, out = sys.argv[1:3]
tok = AutoTokenizer.from_pretrained(model_dir)
tok.pad_token = tok.eos_token
words = "the quick brown fox jumps over a lazy dog while seven small models train".split()
texts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(12)) for i in range(64)]
data = Dataset.from_dict({"text": texts}).map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])


class CountSteps(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def held(q):
    return q.ds_tensor.numel() if hasattr(q, "ds_tensor") else q.to_local().numel() if hasattr(q, "to_local") else q.numel()


def train(resume):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # a model loaded after a ZeRO-3 TrainingArguments exists is built partitioned (zero.Init): count ds_numel
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=6, save_steps=3, logging_steps=1,
                             learning_rate=1e-3, report_to=[], seed=0)
    counter = CountSteps()
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[counter])
    trainer.train(resume_from_checkpoint=resume)
    return {
        "fsdp": trainer.is_fsdp_enabled, "deepspeed": trainer.is_deepspeed_enabled, "type": trainer.accelerator.distributed_type.name,
        "world": trainer.args.world_size, "held": sum(held(q) for q in trainer.model_wrapped.parameters()), "total": total,
        "steps_run": counter.steps, "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
    }


result = {"first": train(None), "resumed": train(os.path.join(out, "checkpoint-3"))}
result["checkpoints"] = sorted(os.listdir(out))
if int(os.environ.get("RANK", "0")) == 0:
    print("RESULT", json.dumps(result))
