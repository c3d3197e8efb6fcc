"""An Accelerate script as users write it, nothing of acc-train in it, that reports where it ran:
``accelerate``'s four lines around a tiny regression model, then one ``RESULT {json}`` line per
rank with the process group's backend, the devices of the parameters and of a batch, Accelerate's
distributed type and mixed precision, and the losses (the device check's GPU tests read it)."""

import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
inputs_all = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs_all, inputs_all.sum(1, keepdim=True)), batch_size=8)

accelerator = Accelerator()
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses, batch_device = [], None
# DeepSpeed's bf16 holds the model in bf16 and casts no inputs (autocast does, under DDP and FSDP)
dtype = next(model.parameters()).dtype
for inputs, targets in loader:
    batch_device = inputs.device.type
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(inputs.to(dtype)).float(), targets.float())
    accelerator.backward(loss)
    optimizer.step()
    losses.append(accelerator.reduce(loss.detach(), "mean").item())

sys.stdout.write("RESULT " + json.dumps({
    "rank": accelerator.process_index, "type": accelerator.distributed_type.name, "world": accelerator.num_processes,
    "backend": dist.get_backend() if dist.is_initialized() else None, "device": accelerator.device.type,
    "param_device": next(model.parameters()).device.type, "batch_device": batch_device,
    "mixed_precision": accelerator.mixed_precision, "losses": losses,
}) + "\n")
sys.stdout.flush()
