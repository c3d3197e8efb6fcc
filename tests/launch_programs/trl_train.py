"""TRL as users write it, nothing of acc-train in it: ``trl_train.py WHICH[,WHICH...] MODEL OUT``
with WHICH among ``sft``, ``sft-lora``, ``dpo``, run one after another in this process (each
trainer builds its own Accelerator, as a script training several does).

SFT trains 4 steps saving at 2, then a new SFTTrainer resumes from checkpoint-2 (as a
restarted job does); DPO trains 3 steps (its reference model is a second copy of the model).
Rank 0 prints one ``RESULT {json}`` line, by WHICH: the trainers' own strategy flags, what each
rank holds of the parameters, and the losses.
"""

import json
import os
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

which, model_dir, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(model_dir)
tok.pad_token = tok.eos_token
words = "the quick brown fox jumps over a lazy dog while seven small models train".split()


class CountSteps(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def held(model):
    return sum(q.ds_tensor.numel() if hasattr(q, "ds_tensor") else q.to_local().numel() if hasattr(q, "to_local") else q.numel() for q in model.parameters())


def summary(trainer, counter):
    return {
        "fsdp": trainer.is_fsdp_enabled, "deepspeed": trainer.is_deepspeed_enabled, "type": trainer.accelerator.distributed_type.name,
        "world": trainer.accelerator.num_processes, "held": held(trainer.model_wrapped), "total": sum(p.numel() for p in trainer.model.parameters()) if not trainer.is_deepspeed_enabled else sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters()),
        "steps_run": counter.steps, "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
    }


def run_sft(which, out):
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": [" ".join(words[(i * 3 + j) % len(words)] for j in range(12)) for i in range(64)]})

    def sft(resume):
        peft_config = None
        if which == "sft-lora":
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        # bf16=False: TRL's configs default to bf16, which transformers refuses on a CPU unless use_cpu=True
        args = SFTConfig(output_dir=out, per_device_train_batch_size=4, max_steps=4, save_steps=2, logging_steps=1, learning_rate=1e-3,
                         report_to=[], seed=0, max_length=16, packing=False, bf16=False)
        counter = CountSteps()
        trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args, train_dataset=data,
                             processing_class=tok, peft_config=peft_config, callbacks=[counter])
        trainer.train(resume_from_checkpoint=resume)
        return summary(trainer, counter)

    return {"first": sft(None), "resumed": sft(os.path.join(out, "checkpoint-2")), "checkpoints": sorted(os.listdir(out))}


def run_dpo(out):
    from trl import DPOConfig, DPOTrainer

    prompts = [" ".join(words[i % 10: i % 10 + 3]) for i in range(32)]
    data = Dataset.from_dict({"prompt": prompts, "chosen": [" the quick fox"] * 32, "rejected": [" lazy dog dog"] * 32})
    args = DPOConfig(output_dir=out, per_device_train_batch_size=4, max_steps=3, logging_steps=1, learning_rate=1e-3, report_to=[],
                     seed=0, max_length=16, save_strategy="no", bf16=False)
    counter = CountSteps()
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args, train_dataset=data,
                         processing_class=tok, callbacks=[counter])
    trainer.train()
    return {"first": summary(trainer, counter)}


result = {}
for name in which.split(","):
    result[name] = run_dpo(os.path.join(out, name)) if name == "dpo" else run_sft(name, os.path.join(out, name))
if int(os.environ.get("RANK", "0")) == 0:
    print("RESULT", json.dumps(result))
