"""The seed's script, unchanged: Accelerate's own four lines (``from accelerate import
Accelerator``, ``Accelerator()``, ``accelerator.prepare(...)``, ``accelerator.backward(loss)``)
around a tiny regression model. Nothing of acc-train in it.

Each rank prints one ``RESULT {json}`` line: Accelerate's distributed type, the world size, the
parameter elements this rank holds, and the loss of every step averaged over the ranks.
"""

import json
import sys

import torch
from accelerate import Accelerator

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
inputs_all = torch.randn(128, 8, generator=torch.Generator().manual_seed(1))
training_dataloader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs_all, inputs_all.sum(1, keepdim=True) * 3), batch_size=8)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
loss_function = torch.nn.functional.mse_loss

accelerator = Accelerator()
model, optimizer, training_dataloader, scheduler = accelerator.prepare(model, optimizer, training_dataloader, scheduler)

losses = []
for batch in training_dataloader:
    optimizer.zero_grad()
    inputs, targets = batch
    outputs = model(inputs)
    loss = loss_function(outputs, targets)
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    losses.append(accelerator.reduce(loss.detach(), "mean").item())


def held(p):
    if hasattr(p, "ds_tensor"):  # ZeRO-3 partition
        return p.ds_tensor.numel()
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()  # FSDP2 DTensor shard, or the whole tensor


sys.stdout.write("RESULT " + json.dumps({
    "rank": accelerator.process_index, "type": accelerator.distributed_type.name, "world": accelerator.num_processes,
    "held": sum(held(p) for p in model.parameters()), "total": 8 * 32 + 32 + 32 + 1, "losses": losses,
}) + "\n")  # one write: the ranks share the stdout pipe
sys.stdout.flush()
