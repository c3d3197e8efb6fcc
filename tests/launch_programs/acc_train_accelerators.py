"""Other people's patterns with ``acc_train.Accelerator`` forced in: ``acc_train_accelerators.py
[SCRIPT]``. With SCRIPT (Accelerate's own test_script.py), ``accelerate.Accelerator`` is
acc-train's while SCRIPT runs. Without, four Accelerators in one process: the user's, a second
one, one built as HF Trainer builds it (explicit ``fsdp_plugin=None, deepspeed_plugin=None``),
and one after ``AcceleratorState._reset_state()``; each prepares and steps a model. Rank 0
prints ``RESULT {json}``: each Accelerator's distributed type and mixed precision.
"""

import json
import os
import runpy
import sys

import accelerate
import torch
from accelerate.state import AcceleratorState

from acc_train import Accelerator

if len(sys.argv) > 1:
    accelerate.Accelerator = Accelerator  # what a script importing it afterwards gets
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)


def step(accelerator):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.ones(8, 8), batch_size=4)  # DeepSpeed sizes its batches from it
    model, opt, loader = accelerator.prepare(model, opt, loader)
    loss = model(next(iter(loader))).sum()
    accelerator.backward(loss)
    opt.step()
    return {"type": accelerator.distributed_type.name, "mixed_precision": accelerator.mixed_precision}


seen = [step(Accelerator())]
seen.append(step(Accelerator()))
seen.append(step(Accelerator(fsdp_plugin=None, deepspeed_plugin=None)))
AcceleratorState._reset_state()
seen.append(step(Accelerator()))
if int(os.environ.get("RANK", "0")) == 0:
    print("RESULT", json.dumps(seen))
