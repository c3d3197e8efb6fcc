"""Accelerate's documented way to save a trained transformers model, unchanged: train a few
steps, then ``state_dict = accelerator.get_state_dict(model)`` and
``accelerator.unwrap_model(model).save_pretrained(OUT, ..., state_dict=state_dict)``. Under
ZeRO-3 ``get_state_dict`` gathers the partitions (DeepSpeed's
``stage3_gather_16bit_weights_on_model_save``). Nothing of acc-train in it.

Usage: save_pretrained.py OUT. Rank 0 prints one ``RESULT {json}`` line: the distributed type
and, per tensor of the state dict it saved, its sum (the test reloads ``OUT`` and compares).
"""

import json
import sys

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)

accelerator = Accelerator()
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
model.train()
for (batch,) in loader:
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

accelerator.wait_for_everyone()
state_dict = accelerator.get_state_dict(model)
# (save_pretrained empties the dict it is given as it writes it)
sums = {name: float(t.float().sum()) for name, t in state_dict.items()} if accelerator.is_main_process else {}
accelerator.unwrap_model(model).save_pretrained(out, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state_dict)
if accelerator.is_main_process:
    sys.stdout.write("RESULT " + json.dumps({"type": accelerator.distributed_type.name, "sums": sums}) + "\n")
    sys.stdout.flush()
accelerator.wait_for_everyone()
